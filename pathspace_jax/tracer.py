"""The walker that finds a network's structure (`Walker`, run by `pathspace_jax.trace`).

It runs a jaxpr on abstract values (`pathspace_jax.atoms.Val`: one list of axis labels, "atoms", per axis) and,
for each equation, looks its `pathspace_jax.rules.Rule` up and calls the rule's tracing function, which unifies
and pins atoms; it records every equation it runs (`pathspace_jax.ir.Recorder`): the flat program, in the same
pass. The walker holds the state and nothing else; the rules, grouped by concern:

* `pathspace_jax.rules_linear`: ``dot_general`` / ``conv_general_dilated`` with a parameter operand are edge
  tensors between two node groups (a kernel's spatial axes are taps, a batch axis or a grouped convolution's
  groups part of the nodes on both sides); constant kernels re-arrange atoms or pin them;
* `pathspace_jax.rules_elementwise`: sums (a bias, a residual, a recurrence tie groups), products (a per-unit
  scale is a diagonal edge, a product with a fully pinned factor a gate), ReLU's ``max(x, 0)``, selections, and the
  families (relabellings, nonlinear functions that pin, degree-0 functions, sources, unknown primitives);
* `pathspace_jax.rules_reduce`, `rules_shape`, `rules_index`, `pieces`: reductions and pooling, reshapes and
  slices, gathers and scatters, a layer's output cut into pieces;
* `pathspace_jax.rules_control`: ``scan`` / ``while`` tie the carry to itself (or run layers stacked in a leaf
  once per layer), ``cond``'s branches are tied; calls are entered by the walker;
* idioms that span equations (`pathspace_jax.idioms`, `pieces`) ask the patterns of `pathspace_jax.rewrites` how
  a value is used, and the axis roles that depend on the whole walk are decided by `pathspace_jax.roles`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from pathspace_jax import idioms, rewrites, rules, rules_elementwise
from pathspace_jax import jaxpr as jx
from pathspace_jax.atoms import ACT, CONST, PARAM, Atoms, Val
from pathspace_jax.ir import Eqn, Recorded, Recorder


class Walker:
    """The abstract interpreter behind `pathspace_jax.trace`: walks a jaxpr on `Val`s, looking each equation's rule
    up in the table (`pathspace_jax.rules`) and applying it, which unifies and pins atoms; records every equation it
    runs, with its results' atoms, in ``rec`` (`pathspace_jax.ir.Recorder`): the flat program, in the same pass.
    It holds the walk's state; the rules are functions of it, in the modules ``rules_*``, `pieces`, `idioms`, and
    the roles decided from the whole walk in `pathspace_jax.roles`."""

    def __init__(self, leaf_paths: Sequence[str]):
        self.atoms = Atoms()
        self.leaf_paths = list(leaf_paths)
        self.uses: list[list[tuple[int, str, int, tuple]]] = [[] for _ in leaf_paths]  # (atom, role, step, site)
        self.other: list[list[str]] = [[] for _ in leaf_paths]
        self.leaf_axes: list[list[list[int]]] = []
        self.step = 0
        self.eqn = None
        self.callers: list = []  # the call equations being run (`run_closed`), outermost first
        self.rec = Recorder()
        # atoms of values that fixed coefficients produce (pinned, though not always a node group): the |·|^p
        # network and DDP treat those values as boundaries (`pathspace_jax.trace.record`)
        self.fixed: list[int] = []
        self.deferred: list[tuple[list[int], list[int], str, bool]] = []  # `defer`, settled by `roles.settle`
        self.shared_inputs: set[int] = set()  # input atoms that a layer shares its weights along (`roles.shared_along`)
        # axes a layer shares its weights along, each with the axes read beside it (`roles.shared_along`): positions
        # where one kernel wrote both (`roles.settle`, once every kernel has been seen)
        self.shared_along: list[tuple[list[int], list[list[int]]]] = []
        # constants concatenated beside a layer's units, each with whether it is zeros (`roles.settle`)
        self.beside: list[tuple[int, bool]] = []
        # parameters reversed along some axes, which must turn out to be a convolution's taps (`roles.settle`)
        self.reversed: list[tuple[Val, list[int], str]] = []
        # the atoms of axes along which a parameter or an activation is copied (`rules_shape.rule_broadcast_in_dim`)
        # and those of a sum it enters so, with why: units of a layer there are pinned (`roles.settle`)
        self.copies: set[int] = set()
        self.copied_into: list[tuple[list[int], str]] = []
        # layer i's slice of a params leaf that a scan slices (`layer_slice`): a leaf of its own, after the real ones
        self.slices: dict[tuple[int, int], int] = {}  # (stacked leaf, layer) -> slice leaf
        self.apart: dict[int, set[int]] = {}  # leaf -> its axes' atoms before they were flattened (`flattened`)
        # a params leaf's batch axis in a dot_general or a grouped convolution's groups (its atoms, the input side)
        # -> the atoms of the result's axis (`diagonal_ends`)
        self.diagonal: dict[tuple[int, tuple[int, ...]], list[int]] = {}
        self.scales: set[tuple[int, tuple[int, ...]]] = set()  # the keys of `diagonal` that are per-unit scales
        # the idioms' patterns matched on each jaxpr run (`pathspace_jax.rewrites`), innermost last, and per jaxpr
        self.matches: list[rewrites.Matches] = []
        self._matched: dict[int, tuple[jx.Jaxpr, rewrites.Matches]] = {}

    def reason(self, what: str = "") -> str:
        name = self.eqn.primitive.name if self.eqn is not None else "?"
        return f"{name}{': ' + what if what else ''} at {self.where()}"

    def where(self) -> str:
        """The source line of the current equation, or of the nearest enclosing call that has one (JAX's own
        helpers, a ReLU's custom_jvp for one, carry none)."""
        return self.line(self.site())

    def site(self) -> tuple:
        """Where the interpreter is (the equation and its callers), for `line` to name later if need be."""
        return (*self.callers, self.eqn)

    @staticmethod
    def line(site: tuple) -> str:
        """The source line of a `site`: its innermost equation's that has one."""
        for eqn in reversed(site):
            if eqn is not None and (w := jx.where(eqn)) != jx.UNKNOWN_SOURCE:
                return w
        return jx.UNKNOWN_SOURCE

    def fresh(self, shape, *, position=False, input=False) -> list[list[int]]:
        return [[self.atoms.new(d, position=position, input=input)] for d in shape]

    def size(self, axis: Sequence[int]) -> int:
        return int(np.prod([self.atoms.size[self.atoms.find(a)] for a in axis], dtype=np.int64))

    def use(self, v: Val, atoms: Sequence[int], role: str) -> None:
        site = self.site()  # named later, and only for a leaf that turns out not to be an edge tensor
        for a in atoms:
            self.uses[v.leaf].append((a, role, self.step, site))

    def mark_other(self, v: Val, why: str) -> None:
        if v.kind == PARAM:
            self.other[v.leaf].append(self.reason(why))
            self.atoms.pin(self.all_atoms(v), self.reason(why))

    def pin(self, v: Val, why: str) -> None:
        self.atoms.pin(self.all_atoms(v), self.reason(why))

    def defer(self, new: list[int], source: list[int], why: str, *, fixed: bool = False) -> None:
        """New atoms made from ``source`` (a slice of it, or fixed coefficients applied along it): positions if
        ``source`` turns out to be positions (time, space: a convolution or a scan may say so later), otherwise
        new nodes, pinned with ``why`` (and, with ``fixed``, values that fixed coefficients produce or read, which
        the |·|^p network takes as boundaries). `roles.settle` decides once the whole function has run."""
        self.deferred.append((new, source, why, fixed))

    def all_atoms(self, v: Val) -> list[int]:
        return [a for ax in v.axes for a in ax] + list(v.scalars)

    @staticmethod
    def axes_note(v: Val) -> list[list[int]]:
        """An activation's atoms as the recording notes them (`pathspace_jax.ir.Recorder`): one list per axis, then
        the squeezed ones."""
        return [list(ax) for ax in v.axes] + [list(v.scalars)]

    def read(self, env, x) -> Val:
        if jx.is_literal(x):
            val = jx.literal_value(x)
            return Val(CONST, self.fresh(np.shape(val)), zero=not np.any(val), id=("lit", val))
        return env[x]

    def run(self, jaxpr: jx.Jaxpr, consts: Sequence[Val], args: Sequence[Val]) -> list[Val]:
        env: dict[Any, Val] = {}
        for var, val in zip(jaxpr.constvars, consts):
            env[var] = val
        for var, val in zip(jaxpr.invars, args):
            env[var] = val
        if id(jaxpr) not in self._matched:  # (a layer stack's body runs once per layer: matched once)
            self._matched[id(jaxpr)] = jaxpr, rewrites.Matches(jaxpr, self.live(jaxpr))
        self.matches.append(self._matched[id(jaxpr)][1])
        for eqn in self.matches[-1].eqns:
            self.eqn = eqn
            self.step += 1
            ins = [self.read(env, x) for x in eqn.invars]
            known = [v.id[1] for v in ins if isinstance(v.id, tuple)]
            folded = jx.fold_scalar(eqn, known) if ins and len(known) == len(ins) else None
            if folded is not None:  # integer arithmetic on known scalars (an unrolled loop's counter): a literal
                env[eqn.outvars[0]] = Val(CONST, self.fresh(folded.shape), zero=not np.any(folded), id=("lit", folded))
                continue
            outs = self.apply(eqn, ins)
            if any(v.kind == PARAM or v.from_params for v in ins):
                made = [dataclasses.replace(v, from_params=True) if v.kind == CONST else v for v in outs]
                outs = Recorded(made) if isinstance(outs, Recorded) else made
            if not isinstance(outs, Recorded):
                outs = self.record(eqn, ins, outs)
            for var, val in zip(eqn.outvars, outs):
                shape = getattr(var.aval, "shape", ())
                assert len(val.axes) == len(shape), (eqn.primitive.name, val.axes, shape)
                env[var] = val
        self.matches.pop()
        return [self.read(env, x) for x in jaxpr.outvars]

    def matched(self, pattern: rewrites.Pattern, var):
        """What the idiom ``pattern`` says about the jaxpr variable ``var`` of the jaxpr being run (`rewrites`)."""
        return self.matches[-1](pattern, var)

    @staticmethod
    def live(jaxpr: jx.Jaxpr) -> list:
        """The equations of ``jaxpr`` that its outputs depend on, or that have effects: a value computed and never
        used (a statistic a model computes and drops) neither pins nor reads what it is computed from."""
        needed, out = {v for v in jaxpr.outvars if not jx.is_literal(v)}, []
        for eqn in reversed(jaxpr.eqns):
            if eqn.effects or any(v in needed for v in eqn.outvars):
                out.append(eqn)
                needed.update(v for v in eqn.invars if not jx.is_literal(v))
        return out[::-1]

    @staticmethod
    def read_only_by_dead_code(jaxpr: jx.Jaxpr, n: int) -> list[tuple[int, Any]]:
        """The first ``n`` inputs of ``jaxpr`` (its params leaves) that only equations outside `live` read, each with
        the first such equation."""
        read = [v for e in Walker.live(jaxpr) for v in e.invars] + list(jaxpr.outvars)
        read = {v for v in read if not jx.is_literal(v)}
        first = {}
        for e in jaxpr.eqns:
            for v in e.invars:
                if not jx.is_literal(v) and v not in read:
                    first.setdefault(v, e)
        return [(i, first[v]) for i, v in enumerate(jaxpr.invars[:n]) if v in first]

    def record(self, eqn, ins: Sequence[Val], outs: Sequence[Val], *, as_=None, **extra) -> Recorded:
        """Record ``eqn`` in the flat program (`pathspace_jax.ir`): its results get fresh ids, and their atoms
        are noted for the flags that `pathspace_jax.trace.record` derives. ``as_``: ``(primitive, params)`` that
        the program runs instead of the equation's own (a dynamic slice at known starts: a static one)."""
        outs = [v.with_id(self.rec.new()) for v in outs]
        for v in outs:
            self.rec.notes[v.id] = self.axes_note(v) if v.kind == ACT else "const" if v.kind == CONST else None
        ids = [v.id for v in ins], [v.id for v in outs]
        prim, params = as_ or (eqn.primitive, dict(eqn.params))
        self.rec.emit(Eqn(prim, params, *ids, eqn, callers=tuple(self.callers), **extra))
        return Recorded(outs)

    def run_closed(self, cj: jx.ClosedJaxpr, args: Sequence[Val]) -> list[Val]:
        """Run a sub-jaxpr (``self.eqn`` is restored afterwards: reasons name the calling equation's line)."""
        eqn = self.eqn
        self.callers.append(eqn)
        outs = self.run(cj.jaxpr, [self.const_val(c) for c in cj.consts], args)
        self.callers.pop()
        self.eqn = eqn
        return outs

    def const_val(self, c) -> Val:
        shape = np.shape(c)
        try:
            zero = not np.any(np.asarray(c))
        except Exception:
            zero = False
        return Val(CONST, self.fresh(shape), zero=zero, id=self.rec.const(c))

    def apply(self, eqn, ins: list[Val]) -> list[Val]:
        """Run ``eqn``'s rule: its entry's tracing function in the table (`pathspace_jax.rules`); a random draw is a
        value of the inputs alone, a call is entered, and a primitive with no entry is pinned (`unknown`)."""
        entry = rules.rule(eqn.primitive.name)
        if (held := idioms.reshaped_kernel(self, eqn, entry, ins)) is not None:
            return [held]
        if entry.trace is not None:
            return entry.trace(self, eqn, ins)
        if rules.is_random(eqn.primitive.name):
            return rules_elementwise.source(self, eqn, ins)
        sub = jx.call_body(eqn)  # jit, custom_jvp_call, custom_vjp_call, checkpoint, ...: entered
        if sub is not None:
            return self.enter(eqn, sub, ins)
        return rules_elementwise.unknown(self, eqn, ins)

    def enter(self, eqn, sub: jx.ClosedJaxpr, ins: list[Val]) -> Recorded:
        """A call, inlined. A ``custom_jvp``/``custom_vjp`` call is also recorded as one equation holding its
        body's equations (`pathspace_jax.program` keeps ReLU-like ones whole where their derivative matters)."""
        if not jx.has_custom_derivative(eqn):
            return Recorded(self.run_closed(sub, ins))
        frame = self.rec.push(consts_of_caller=True)
        outs = self.run_closed(sub, ins)
        self.rec.pop()
        self.rec.emit(Eqn(eqn.primitive, dict(eqn.params), [v.id for v in ins], [v.id for v in outs], eqn,
                          inner=frame.eqns))  # fmt: skip
        return Recorded(outs)

    def broadcast(self, eqn, ins: Sequence[Val], *, unify: bool) -> list[list[int]]:
        """Output axes of an elementwise op; with ``unify`` the operands' atoms are tied."""
        shape = eqn.outvars[0].aval.shape
        out = []
        for k, d in enumerate(shape):
            lists = [v.axes[k] for v in ins if len(v.axes) == len(shape) and self.size(v.axes[k]) == d]
            if not lists:
                out.append([self.atoms.new(d)])
                continue
            if unify:
                for other in lists[1:]:
                    self.atoms.unify(lists[0], other, self.reason())
            out.append(list(lists[0]))
        return out

    def ew(self, kind: str, ins: Sequence[Val], axes, **kw) -> Val:
        """The result of an elementwise op; squeezed size-1 atoms of the operands carry over."""
        return Val(kind, axes, scalars=list(dict.fromkeys(a for v in ins for a in v.scalars)), **kw)

    def fully_pinned(self, v: Val) -> bool:
        """Whether every atom of ``v`` is pinned (a normalised value, a softmax's output): no rescaling changes it,
        and the flat program has it among its boundary values."""
        return all(self.atoms.reasons[r] for r in self.atoms.factors(self.all_atoms(v)))

    def flattened(self, leaf: int, m: int, flat: int) -> None:
        """The last ``m`` axes of ``leaf`` are the one node axis ``flat`` (`kernel_pieces`): its other reads, which
        see the axes apart, make it no edge tensor (`pathspace_jax.trace`)."""
        own = self.leaf_axes[leaf]
        self.apart[leaf] = {a for ax in own[-m:] for a in ax}
        self.leaf_axes[leaf] = [*own[:-m], [flat], *[[] for _ in range(m - 1)]]

    def diagonal_ends(self, p: Val, axis: list[int]) -> list[int]:
        """The atoms that parameter ``p``'s batch axis ``axis`` gives the result (`diagonal`), the same at every use
        of the leaf: the output side of its nodes, whose input side is ``axis`` itself."""
        self.use(p, axis, "diag")
        return list(self.diagonal.setdefault((p.leaf, tuple(axis)), [self.atoms.new(self.size(axis))]))

    def layer_slice(self, leaf: int, layer: int) -> int:
        """The leaf index of layer ``layer``'s slice of params leaf ``leaf`` (stacked along its first axis): a
        leaf of its own, with fresh atoms (`pathspace_jax.trace` stacks the slices' edges back into one leaf)."""
        if (leaf, layer) not in self.slices:
            self.slices[(leaf, layer)] = len(self.uses)
            self.uses.append([])
            self.other.append([])
            self.leaf_axes.append([[self.atoms.new(self.size(ax))] for ax in self.leaf_axes[leaf][1:]])
            self.leaf_paths.append(f"{self.leaf_paths[leaf]}[{layer}]")
        return self.slices[(leaf, layer)]

    def layer_outputs(self) -> set[int]:
        """The roots of the axes that parameters' edges write (their output axes, role ``"out"``)."""
        return {self.atoms.find(a) for uses in self.uses for a, role, _, _ in uses if role == "out"}
