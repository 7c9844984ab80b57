"""The abstract interpreter that finds a network's structure (`Interpreter`, run by `pathspace_jax.trace`).

Each primitive has one small rule saying how atoms flow (`pathspace_jax.rules` gives each its kind; the
primitives that rearrange entries have theirs in `pathspace_jax.shape_rules`, `piece_rules` and `index_rules`):

* ``dot_general`` / ``conv_general_dilated`` with a parameter operand unify the contracted activation axis
  with the parameter's input axis and give the result the parameter's output axis: an edge tensor between
  two node groups (a convolution kernel's spatial axes are taps: each tap its own edge); a constant kernel that
  selects one tap of one channel per output feature (``lax.conv_general_dilated_patches``, inside
  ``nn.ConvLocal``) re-arranges atoms, any other constant kernel pins them; a batch axis of
  the parameter (an ensemble's members, experts) or a grouped convolution's groups are part of the nodes on
  both sides, the result's axis atoms of its own (`Interpreter.diagonal`; `pathspace_jax.trace` makes it a
  position where a layer shares it);
* ``add`` unifies the atoms of its operands: a parameter added to an activation is a bias, two activations
  added together (a residual, a recurrence) tie their groups into one;
* ReLU (``max(x, 0)``), leaky ReLU (``select_n``), pooling, reshape, transpose, slicing of positions and
  concatenation keep or re-arrange atoms;
* ``scan`` / ``while`` tie the carry to itself (recurrent kernels become edges from a group to itself);
  calls (``pjit``, ``custom_jvp_call``, ``custom_vjp_call``, ``checkpoint``) and ``cond`` are entered;
* a per-unit scale (LayerScale, a normalisation's scale: `Interpreter.per_unit_scale`) is a diagonal edge, and
  a product with a fully pinned factor (a gate: `Interpreter.gated`; attention's weights summed with its
  values: `Interpreter.weighted_sum`) keeps the other operand's atoms;
* anything that is not positively homogeneous per node (``tanh``, ``exp``, ``rsqrt``, another product of
  activations, adding a non-zero constant, a reduction over nodes, an unknown primitive) **pins** the atoms
  it touches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from pathspace_jax import jaxpr as jx
from pathspace_jax import rules
from pathspace_jax.atoms import ACT, CONST, PARAM, Atoms, Val
from pathspace_jax.graph import FROZEN
from pathspace_jax.index_rules import IndexRules
from pathspace_jax.ir import Eqn, LayerStack, Recorder
from pathspace_jax.piece_rules import PieceRules
from pathspace_jax.shape_rules import ShapeRules

MIXES_COMPUTED = "mixes nodes with coefficients computed from parameters"


class Recorded(list):
    """A rule's results that are recorded already (a call's body inlined, a scan): `Interpreter.run` keeps
    their ids and records nothing more for the equation."""


class Interpreter(ShapeRules, PieceRules, IndexRules):
    """The abstract interpreter behind `pathspace_jax.trace`: runs a jaxpr on `Val`s, one rule per equation
    (`pathspace_jax.rules` says which), unifying and pinning atoms; records every equation it runs, with its
    results' atoms, in ``rec`` (`pathspace_jax.ir.Recorder`): the flat program, in the same pass."""

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
        self.deferred: list[tuple[list[int], list[int], str, bool]] = []  # `defer`, settled by `settle`
        self.shared_inputs: set[int] = set()  # input atoms that a layer shares its weights along (`shared_along`)
        # constants concatenated beside a layer's units, each with whether it is zeros (`settle`)
        self.beside: list[tuple[int, bool]] = []
        # parameters reversed along some axes, which must turn out to be a convolution's taps (`settle`)
        self.reversed: list[tuple[Val, list[int], str]] = []
        # the atoms of axes along which a parameter or an activation is copied (`ShapeRules.rule_broadcast_in_dim`)
        # and those of a sum it enters so, with why: units of a layer there are pinned (`settle`)
        self.copies: set[int] = set()
        self.copied_into: list[tuple[list[int], str]] = []
        # layer i's slice of a params leaf that a scan slices (`layer_slice`): a leaf of its own, after the real ones
        self.slices: dict[tuple[int, int], int] = {}  # (stacked leaf, layer) -> slice leaf
        self.apart: dict[int, set[int]] = {}  # leaf -> its axes' atoms before they were flattened (`flattened`)
        # a params leaf's batch axis in a dot_general or a grouped convolution's groups (its atoms, the input side)
        # -> the atoms of the result's axis (`diagonal_ends`)
        self.diagonal: dict[tuple[int, tuple[int, ...]], list[int]] = {}
        self.scales: set[tuple[int, tuple[int, ...]]] = set()  # the keys of `diagonal` that are per-unit scales
        # per jaxpr being run (innermost last): a variable -> the equations that read it (None: an output)
        self.consumers: list[dict[Any, list]] = []

    # -- helpers -------------------------------------------------------------
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
        the |·|^p network takes as boundaries). `settle` decides once the whole function has run."""
        self.deferred.append((new, source, why, fixed))

    def settle(self) -> None:
        """Decide the constants concatenated beside a layer's units (inputs, or pinned where a layer writes into them
        too: `ShapeRules.side_by_side`), the input positions (`input_positions`), the `defer`red atoms, in order (a
        later one's source may be an earlier one's result), then the parameters reversed (views where along taps,
        else "other": `ShapeRules.rule_rev`)."""
        written, atoms = set(), self.atoms
        stack = [f for uses in self.uses for a, role, _, _ in uses if role == "out" for f in atoms.factors([a])]
        while stack:  # (an output axis unified with a concatenation's: the groups side by side in it too)
            r = atoms.find(stack.pop())
            if r not in written:
                written.add(r)
                stack += atoms.factors(atoms.alias[r] or [])
        for a, zero in self.beside:
            fs = atoms.factors([a])
            if any(f in written or atoms.position[f] for f in fs):
                if not zero:  # (zeros added to a layer's units are those units)
                    atoms.pin(fs, "a constant concatenated beside a layer's units, and a layer writes into it")
            else:
                for f in fs:
                    atoms.input[f] = True
        self.input_positions()
        for new, source, why, fixed in self.deferred:
            if all(self.atoms.position[f] for f in self.atoms.factors(source)):
                self.atoms.make_positions(new)
            elif not all(self.atoms.position[f] for f in self.atoms.factors(new)):
                self.atoms.pin(new, why)
                if fixed:  # the result, and what it was computed from (an input: the same value 1 in κ)
                    self.fixed += new + source
        for v, axes, why in self.reversed:  # (along nodes: the entries of other nodes, the parameter no edge)
            if not all(atoms.position[f] for f in atoms.factors(axes)):
                self.other[v.leaf].append(why)
                atoms.pin(self.all_atoms(v), why)
        for axis, why in self.copied_into:  # (along positions and inputs: a bias shared by them, as usual)
            fs = atoms.factors(axis)  # (said only where no other reason pins them: a LayerNorm's mean has one)
            atoms.pin([f for f in fs if not (atoms.position[f] or atoms.input[f] or atoms.reasons[f])], why)

    def all_atoms(self, v: Val) -> list[int]:
        return [a for ax in v.axes for a in ax] + list(v.scalars)

    @staticmethod
    def axes_note(v: Val) -> list[list[int]]:
        """An activation's atoms as the recording notes them (`pathspace_jax.ir.Recorder`): one list per axis, then
        the squeezed ones."""
        return [list(ax) for ax in v.axes] + [list(v.scalars)]

    # -- running jaxprs ------------------------------------------------------
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
        eqns = self.live(jaxpr)
        consumers: dict[Any, list] = {}
        for eqn, var in [(e, v) for e in eqns for v in e.invars] + [(None, v) for v in jaxpr.outvars]:
            if not jx.is_literal(var):
                consumers.setdefault(var, []).append(eqn)
        self.consumers.append(consumers)
        for eqn in eqns:
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
        self.consumers.pop()
        return [self.read(env, x) for x in jaxpr.outvars]

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
        read = [v for e in Interpreter.live(jaxpr) for v in e.invars] + list(jaxpr.outvars)
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

    # -- dispatch ------------------------------------------------------------
    def apply(self, eqn, ins: list[Val]) -> list[Val]:
        name = eqn.primitive.name
        structure = rules.rule(name).structure  # the rule table: one entry per primitive
        method = getattr(self, "rule_" + name.replace("-", "_"), None) if structure == "method" else None
        if ins and ins[0].factors is not None and ins[0].kind == CONST and (structure == "relabel" or
                                                                            name == "broadcast_in_dim"):  # fmt: skip
            return [self.held_reshaped(eqn, ins[0])]
        if method is not None:
            return method(eqn, ins)
        if structure == "relabel":
            return [dataclasses.replace(v) for v in ins[: len(eqn.outvars)]]
        if structure == "nonlinear":
            return [self.nonlinear(eqn, ins)]
        if structure in ("degree0", "compare"):
            return [self.degree0(eqn, ins)]
        if structure == "source" or rules.is_random(name):  # (a random draw: a value of the inputs alone)
            return [Val(CONST, self.fresh(v.aval.shape)) for v in eqn.outvars]
        sub = jx.call_body(eqn)  # jit, custom_jvp_call, custom_vjp_call, checkpoint, ...: entered
        if sub is not None:
            return self.enter(eqn, sub, ins)
        return self.unknown(eqn, ins)

    def held_reshaped(self, eqn, v: Val) -> Val:
        """A kernel held by `kernel_scale` cast or broadcast: both factors are (each recorded), or, broadcast where a
        factor does not have the kernel's shape, the kernel is no longer held (`unscaled`)."""
        shape = eqn.invars[0].aval.shape
        if eqn.primitive.name == "broadcast_in_dim" and any(tuple(map(self.size, f.axes)) != shape for f in v.factors):
            (v,) = self.unscaled([v])
            return self.apply(eqn, [v])[0]
        c, p = (self.record(eqn, [f], self.apply(eqn, [f]))[0] for f in v.factors)
        return dataclasses.replace(self.apply(eqn, [dataclasses.replace(v, factors=None)])[0], factors=(c, p))

    def enter(self, eqn, sub: jx.ClosedJaxpr, ins: list[Val]) -> Recorded:
        """A call, inlined. A ``custom_jvp``/``custom_vjp`` call is also recorded as one equation holding its
        body's equations (`pathspace_jax.program` keeps ReLU-like ones whole where their derivative matters)."""
        if not eqn.primitive.name.startswith("custom_"):
            return Recorded(self.run_closed(sub, ins))
        frame = self.rec.push(consts_of_caller=True)
        outs = self.run_closed(sub, ins)
        self.rec.pop()
        self.rec.emit(Eqn(eqn.primitive, dict(eqn.params), [v.id for v in ins], [v.id for v in outs], eqn,
                          inner=frame.eqns))  # fmt: skip
        return Recorded(outs)

    def unknown(self, eqn, ins):
        why = "not known to be positively homogeneous"
        for v in ins:
            if v.kind == ACT:
                self.pin(v, why)
            self.mark_other(v, why)
        kind = ACT if any(v.kind == ACT for v in ins) else CONST
        outs = []
        for var in eqn.outvars:
            axes = self.fresh(getattr(var.aval, "shape", ()))
            val = Val(kind, axes)
            if kind == ACT:
                self.pin(val, why)
            outs.append(val)
        return outs

    def nonlinear(self, eqn, ins):
        for v in ins:
            if v.kind == ACT:
                self.pin(v, "nonlinear, not positively homogeneous")
            self.mark_other(v, "used in a nonlinear function")
        kind = ACT if any(v.kind == ACT for v in ins) else CONST
        return self.ew(kind, ins, self.broadcast(eqn, ins, unify=False))

    def degree0(self, eqn, ins):
        acts = [v for v in ins if v.kind == ACT]
        for v in ins:
            self.mark_other(v, "compared")
        if rules.rule(eqn.primitive.name).structure == "compare" and acts:
            consts = [v for v in ins if v.kind == CONST]
            if any(not c.zero for c in consts):
                for v in acts:
                    self.pin(v, "compared with a non-zero constant")
            unify = len(acts) > 1
            return self.ew(CONST, ins, self.broadcast(eqn, ins, unify=unify))
        return self.ew(CONST, ins, self.broadcast(eqn, ins, unify=False))

    def rule_stop_gradient(self, eqn, ins):
        """The same values: an activation goes on as it is (``relu(h) * stop_gradient(h)`` is a product of
        activations, not a ReLU layer). A fully pinned value (spectral normalisation's power iteration vectors, which
        its σ(W) reads as constants) or one without activations is a constant of the structure: a parameter behind it
        is held fixed (a frozen layer), no edge."""
        if ins[0].kind == ACT and not self.fully_pinned(ins[0]):
            return [dataclasses.replace(ins[0])]
        self.mark_other(ins[0], FROZEN)
        return [self.ew(CONST, ins, self.broadcast(eqn, ins, unify=False))]

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

    # -- elementwise arithmetic -------------------------------------------------
    def rule_add(self, eqn, ins):
        if any(v.pieces is not None for v in ins):  # a kernel's output cut in pieces (`kernel_pieces`)
            if (biased := self.bias_of_pieces(ins)) is not None:
                return [biased]
            why = "adds to a kernel's output cut into pieces something other than its bias"
            for v in ins:
                if v.kind == PARAM:
                    self.mark_other(v, why)
                else:
                    self.pin(v, why)
            out = Val(ACT, self.fresh(eqn.outvars[0].aval.shape))
            self.pin(out, why)
            return [out]
        acts = [v for v in ins if v.kind == ACT]
        params = [v for v in ins if v.kind == PARAM]
        consts = [v for v in ins if v.kind == CONST]
        if not acts:
            if params:
                for v in params:
                    self.mark_other(v, "combined with another parameter or constant")
                return [self.ew(CONST, ins, self.broadcast(eqn, ins, unify=False))]
            return [self.ew(CONST, ins, self.broadcast(eqn, ins, unify=False), zero=all(c.zero for c in consts))]
        axes = self.broadcast(eqn, acts + params, unify=True)  # activations first: they name the output
        for v in params:
            if not self.all_atoms(v):  # one number added to every unit: no edge (the units pinned below)
                self.mark_other(v, "a single number added to a layer's units")
            self.use(v, self.all_atoms(v), "out")
        shape = eqn.outvars[0].aval.shape
        for v in acts + params:  # a bias shared along the units of a layer (a token-mixing layer's, along channels)
            for k, d in enumerate(shape):
                if d > 1 and (len(v.axes) != len(shape) or self.size(v.axes[k]) == 1 or self.copies & set(v.axes[k])):
                    what = "a parameter" if v.kind == PARAM else "an activation"
                    why = f"adds {what} whose value is the same at every unit of a layer: they cannot rescale apart"
                    self.copied_into.append((axes[k], self.reason(why)))
        if any(not c.zero for c in consts):
            for v in acts:
                self.pin(v, "adds a constant offset")
        return [self.ew(ACT, ins, axes)]

    rule_sub = rule_add
    rule_add_any = rule_add

    def rule_mul(self, eqn, ins):
        if (held := self.kernel_scale(eqn, ins)) is not None:
            return [held]
        if any(v.factors is not None for v in ins) and (scaled := self.normalised_scale(eqn, ins)):
            return scaled
        acts = [v for v in ins if v.kind == ACT]
        params = [v for v in ins if v.kind == PARAM]
        consts = [v for v in ins if v.kind == CONST]
        if len(acts) == 1 and len(params) == 1 and eqn.primitive.name == "mul":
            if all(self.size(ax) == 1 for ax in params[0].axes):
                # a learned scalar (PReLU's slope, a gain): a coefficient of every unit alike, so x's units keep
                # their rescaling (and the scalar's gradient is invariant under it); the |w|^p network takes it raised
                self.mark_other(params[0], "a learned scalar coefficient (PReLU's slope, a gain)")
                out = self.ew(ACT, ins, self.broadcast(eqn, ins, unify=False))
                return self.record(eqn, ins, [out], coefficient=True)
            if self.fully_pinned(acts[0]) and not params[0].scaled and self.one_product(eqn.outvars[0]):
                return [self.ew(ACT, ins, self.broadcast(eqn, ins, unify=False), factors=(acts[0], params[0]))]
            if scaled := self.per_unit_scale(eqn, ins, *acts, *params):
                return scaled
        if len(acts) == 2 and eqn.primitive.name == "mul" and (gated := self.gated(eqn, *acts)):
            return [gated]
        if len(acts) > 1:
            for v in acts:
                self.pin(v, "product of activations")
        if acts and params:
            for v in params:
                self.mark_other(v, "elementwise product of a parameter and an activation")
            for v in acts:
                self.pin(v, "elementwise product with a parameter")
        if acts:
            out = self.ew(ACT, ins, self.broadcast(eqn, acts + params + consts, unify=len(acts) > 1))
            if not params and all(map(self.fully_pinned, acts)):  # (a top-k router's weights spread by a one-hot)
                self.pin(out, "a product of pinned values and constants")
            return [out]
        if len(params) == 1 and eqn.primitive.name == "mul" and not any(c.from_params for c in consts):
            # a parameter times a fixed coefficient is still a view of that parameter
            axes = self.broadcast(eqn, params + consts, unify=False)
            return [self.ew(PARAM, ins, axes, leaf=params[0].leaf, scaled=params[0].scaled or bool(consts))]
        if params:
            for v in params:
                self.mark_other(v, "product of parameters")
            return [self.ew(CONST, ins, self.broadcast(eqn, ins, unify=False))]
        return [self.ew(CONST, ins, self.broadcast(eqn, ins, unify=False), zero=any(c.zero for c in consts))]

    def fully_pinned(self, v: Val) -> bool:
        """Whether every atom of ``v`` is pinned (a normalised value, a softmax's output): no rescaling changes it,
        and the flat program has it among its boundary values."""
        return all(self.atoms.reasons[r] for r in self.atoms.factors(self.all_atoms(v)))

    def gated(self, eqn, a: Val, b: Val) -> Val | None:
        """``g * x`` with ``g`` fully pinned and ``x`` an activation that is not, of the result's shape (a gate:
        SwiGLU's ``swish(x W) * (x V)``, a sigmoid gate on a ReLU layer): g's entries are coefficients that no
        rescaling changes, so x's units go on, and the result scales with them. None otherwise."""
        shape, pinned_a = eqn.outvars[0].aval.shape, self.fully_pinned(a)
        if pinned_a == self.fully_pinned(b):
            return None
        x, g = (b, a) if pinned_a else (a, b)
        if len(x.axes) != len(shape) or any(self.size(ax) != d for ax, d in zip(x.axes, shape, strict=True)):
            return None  # x broadcast along an axis of g: its unit would feed g's pinned ones
        return self.ew(ACT, [x, g], self.broadcast(eqn, [x, g], unify=False))

    def one_product(self, var) -> bool:
        """Whether the jaxpr variable ``var`` is read once, by a ``mul``."""
        uses = self.consumers[-1].get(var, [])
        return len(uses) == 1 and uses[0] is not None and uses[0].primitive.name == "mul"

    def normalised_scale(self, eqn, ins) -> Recorded | None:
        """``n * (s * p)`` with ``n`` and ``s`` fully pinned and ``p`` a per-unit parameter (`Val.factors`): a
        LayerNorm's or BatchNorm's scale, which flax multiplies into the per-example ``rsqrt(var + eps)`` before
        the centred value. Recorded as ``(n * s) * p``: a diagonal edge from the normalised value's (pinned) group
        into a group of its own (`per_unit_scale`), whose units the scale, the offset added next and the weights
        reading them rescale. None where that does not apply: the parameter is then not an edge."""
        shape = eqn.outvars[0].aval.shape
        (r, n), pending = sorted(ins, key=lambda v: v.factors is None), [v for v in ins if v.factors is not None]
        if len(pending) == 1 and n.kind == ACT and self.fully_pinned(n):
            s, p = r.factors
            xs = self.broadcast(eqn, [n, s], unify=False)
            if all(self.size(ax) == d for ax, d in zip(xs, shape, strict=True)):
                (x,) = self.record(eqn, [n, s], [self.ew(ACT, [n, s], xs)])
                if scaled := self.per_unit_scale(eqn, [x, p], x, p):
                    return scaled
        for v in pending:
            self.mark_other(v.factors[1], "elementwise product of a parameter and an activation")
        return None

    def per_unit_scale(self, eqn, ins, x: Val, p: Val, as_=None) -> Recorded | None:
        """``x * p`` with ``p`` a parameter that varies along some of ``x``'s axes only (a learned per-unit scale:
        LayerScale, a gain after a ReLU, a normalisation's scale): a diagonal edge, entry c from node c of x's
        group (pinned or not) to node c of a group of its own (`diagonal_ends`), the other axes broadcast. None
        (the product pins, as before) where p varies along no axis (a scalar is a coefficient: `rule_mul`), or p
        is combined with fixed coefficients (BatchNorm's scale over its running deviation: the running mean it
        subtracts breaks the symmetry, although it is 0 at initialisation)."""
        shape = eqn.outvars[0].aval.shape
        if p.scaled or len(p.axes) != len(shape) or len(x.axes) != len(shape):
            return None
        own = {f for ax in self.leaf_axes[p.leaf] for f in self.atoms.factors(ax)}
        out, diagonal = [], False
        for k, d in enumerate(shape):
            full = self.size(p.axes[k]) == d == self.size(x.axes[k])  # x not broadcast along it
            if d > 1 and full and set(self.atoms.factors(p.axes[k])) <= own:
                self.atoms.unify(x.axes[k], p.axes[k], self.reason())
                out.append(self.diagonal_ends(p, p.axes[k]))
                self.scales.add((p.leaf, tuple(p.axes[k])))
                diagonal = True
            else:
                out.append(list(x.axes[k]))
        if not diagonal:
            return None
        return self.record(eqn, ins, [self.ew(ACT, ins, out)], as_=as_, edge=True)

    def kernel_scale(self, eqn, ins: Sequence[Val]) -> Val | None:
        """A kernel ``c * p`` in the making: ``c`` coefficients computed from parameters and ``p`` a parameter that
        varies along some of c's axes only, the product read once, as the kernel of a ``dot_general`` or a
        convolution (`read_as_kernel`). Held as its factors (`Val.factors`) for `scaled_kernel`, in any order the
        product is written: Flax's ``v / ‖v‖ * g`` (``nn.WeightNorm``) and ``g * (v / ‖v‖)``; ``g * v / ‖v‖`` (``c``
        is then ``v``, and ``v / ‖v‖`` once divided); PyTorch's ``v * (g / ‖v‖)`` (``g / ‖v‖`` is ``(1 / ‖v‖) *
        g``). A held product times or over further coefficients holds their product or quotient (recorded: the
        program computes ``c`` itself). None otherwise."""
        name, shape = eqn.primitive.name, eqn.outvars[0].aval.shape
        if name not in ("mul", "div") or len(ins) != 2 or any(v.kind == ACT for v in ins):
            return None
        if not self.read_as_kernel(eqn.outvars[0]):
            return None
        held = [v for v in ins if v.factors is not None]
        if held:  # (c·p)·x = (c·x)·p, (c·p)/x = (c/x)·p; (c·q)·g with q no gain and g one: (c·q)·g (v / ‖v‖ * g)
            if len(held) != 1 or name == "div" and ins[1] is held[0]:
                return None
            (c, p), x = held[0].factors, ins[1 - ins.index(held[0])]
            if name == "mul" and not self.gain(p, shape) and x.kind == PARAM and self.gain(x, shape):
                p, x = x, p
            if not self.gain(p, shape, broadcast=False):
                return None
            if x.kind == PARAM:  # (v·(g/‖v‖), v/‖v‖·g: v combined with the coefficients)
                self.mark_other(x, "combined with a per-unit gain into a kernel's coefficients")
            operands = [c, x]
            c = self.ew(CONST, operands, self.broadcast(eqn, operands, unify=False), from_params=True)
            (c,) = self.record(eqn, operands, [c])
            return self.ew(CONST, ins, self.broadcast(eqn, ins, unify=False), from_params=True, factors=(c, p))
        if name == "div":  # g / x = (1 / x)·g, g a gain if a product makes it one (`gain` there)
            p, x = ins
            if p.kind != PARAM or x.kind != CONST or not x.from_params or not self.gain(p, shape, broadcast=False):
                return None
            one = Val(CONST, self.fresh(shape), id=("lit", np.ones(shape, eqn.outvars[0].aval.dtype)))
            c = self.ew(CONST, [x], self.broadcast(eqn, [x], unify=False), from_params=True)
            (c,) = self.record(eqn, [one, x], [c])
            return self.ew(CONST, ins, self.broadcast(eqn, ins, unify=False), from_params=True, factors=(c, p))
        for p, c in (ins, ins[::-1]):
            full = len(c.axes) == len(shape) and all(self.size(ax) == d for ax, d in zip(c.axes, shape, strict=True))
            coefficients = c.kind == CONST and c.from_params or c.kind == PARAM
            if p.kind == PARAM and coefficients and full and self.gain(p, shape):
                if c.kind == PARAM:  # g·v: v is coefficients once divided by its norm (`scaled_kernel` checks)
                    self.mark_other(c, "combined with a per-unit gain into a kernel's coefficients")
                return self.ew(CONST, ins, self.broadcast(eqn, ins, unify=False), from_params=True, factors=(c, p))
        return None

    def gain(self, p: Val, shape, *, broadcast: bool = True) -> bool:
        """Whether the parameter ``p`` varies along some axes of ``shape`` only (with ``broadcast``: not along one
        of more than one entry at least), each one of its own leaf's: a gain per output unit of a kernel of that
        shape (`kernel_scale`)."""
        if p.kind != PARAM or p.scaled or len(p.axes) != len(shape):
            return False
        own = {f for ax in self.leaf_axes[p.leaf] for f in self.atoms.factors(ax)}
        varying = [k for k, ax in enumerate(p.axes) if self.size(ax) > 1]
        if broadcast and not any(self.size(ax) == 1 < d for ax, d in zip(p.axes, shape, strict=True)):
            return False
        return bool(varying) and all(self.size(p.axes[k]) == shape[k] and set(self.atoms.factors(p.axes[k])) <= own
                                     for k in varying)  # fmt: skip

    def read_as_kernel(self, var) -> bool:
        """Whether the jaxpr variable ``var`` is read once, by a ``dot_general`` or a convolution, or first cast (a
        kernel in a layer's compute dtype: mixed precision), broadcast, multiplied or divided (`kernel_scale`)."""
        uses = self.consumers[-1].get(var, [])
        if len(uses) != 1 or uses[0] is None:
            return False
        name = uses[0].primitive.name
        if name in ("convert_element_type", "broadcast_in_dim", "mul") or name == "div" and uses[0].invars[0] is var:
            return self.read_as_kernel(uses[0].outvars[0])
        return name in ("dot_general", "conv_general_dilated")

    def scaled_kernel(self, eqn, ins: Sequence[Val]) -> Recorded | None:
        """A ``dot_general`` or convolution of an activation ``x`` with a kernel ``c * p`` held by `kernel_scale`,
        where p varies along output axes only: ``x·(c * p) = (x·c) * p``, recorded so. ``x·c`` is a product with
        fixed coefficients (new nodes, pinned: rescaling a unit that c reads changes ‖v‖), and p a learned per-unit
        scale of its result (`per_unit_scale`): a diagonal edge into units of their own, which p, a bias added next
        and the next layer's weights rescale. None where p varies along another axis: p is then no edge."""
        k = 0 if ins[0].factors is not None else 1
        x, (c, p), shape = ins[1 - k], ins[k].factors, eqn.outvars[0].aval.shape
        varying = [j for j, ax in enumerate(p.axes) if self.size(ax) > 1]
        dtype = eqn.invars[k].aval.dtype
        if x.kind != ACT or eqn.outvars[0].aval.dtype != dtype or c.kind != CONST:
            return None  # (c a parameter: g·v read undivided)
        if eqn.primitive.name == "dot_general":
            (lc, rc), (lb, rb) = jx.param(eqn, "dimension_numbers")
            free = [[j for j in range(len(v.axes)) if j not in (lc, rc)[i] and j not in (lb, rb)[i]]
                    for i, v in enumerate(ins)]  # fmt: skip
            if not set(varying) <= set(free[k]):
                return None
            first = len(lb) + (len(free[0]) if k == 1 else 0)  # where the kernel's free axes are in the result
            at = [first + free[k].index(j) for j in varying]
        else:
            dn = jx.param(eqn, "dimension_numbers")
            if k != 1 or varying != [dn.rhs_spec[0]] or jx.param(eqn, "batch_group_count") != 1:
                return None
            at = [dn.out_spec[1]]
        ins = [c if i == k else v for i, v in enumerate(ins)]
        (y,) = self.record(eqn, ins, self.apply(eqn, ins))
        new_shape, axes = [1] * len(shape), [[self.atoms.new(1)] for _ in shape]
        for j, o in zip(varying, at, strict=True):
            new_shape[o], axes[o] = shape[o], list(p.axes[j])
        old_shape = tuple(self.size(ax) for ax in p.axes)
        q = Val(PARAM, axes, leaf=p.leaf, id=p.id)
        if tuple(new_shape) != old_shape:
            (q,) = self.record(eqn, [p], [q], as_=jx.reshape(old_shape, tuple(new_shape), dtype))
        scaled = self.per_unit_scale(eqn, [y, q], y, q, as_=jx.product(shape, tuple(new_shape), dtype))
        assert scaled is not None, "kernel_scale and scaled_kernel check what per_unit_scale needs"
        return scaled

    def unscaled(self, ins: Sequence[Val]) -> list[Val]:
        """``ins`` with a kernel held by `kernel_scale` that `scaled_kernel` did not take as the product it is: its
        parameter is combined into fixed coefficients (no edge)."""
        for v in ins:
            if v.factors is not None:
                self.mark_other(v.factors[1], "product of parameters")
        return [dataclasses.replace(v, factors=None) if v.factors is not None else v for v in ins]

    def rule_div(self, eqn, ins):
        if (held := self.kernel_scale(eqn, ins)) is not None:
            return [held]
        ins = self.unscaled(ins)
        num, den = ins
        if den.kind == CONST and (num.kind == ACT or num.kind == PARAM and not den.from_params):
            if num.kind == PARAM:
                return [self.ew(PARAM, ins, self.broadcast(eqn, [num, den], unify=False), leaf=num.leaf, scaled=True)]
            return [self.ew(ACT, ins, self.broadcast(eqn, [num, den], unify=False))]
        if num.kind == CONST and den.kind == CONST:
            return [self.ew(CONST, ins, self.broadcast(eqn, ins, unify=False), zero=num.zero)]
        return [self.nonlinear(eqn, ins)]

    def rule_max(self, eqn, ins):
        acts = [v for v in ins if v.kind == ACT]
        if not acts:
            return [self.nonlinear(eqn, ins)]
        for v in ins:
            if v.kind == PARAM:
                self.mark_other(v, "max with a parameter")
            if v.kind == CONST and not v.zero:
                for a in acts:
                    self.pin(a, "max/min with a non-zero constant")
        return [self.ew(ACT, ins, self.broadcast(eqn, acts + [v for v in ins if v.kind != ACT], unify=len(acts) > 1))]

    rule_min = rule_max

    def rule_abs(self, eqn, ins):
        (v,) = ins
        if v.kind == ACT:
            return [Val(ACT, [list(a) for a in v.axes])]
        return [self.nonlinear(eqn, ins)]

    def rule_select_n(self, eqn, ins):
        pred, cases = ins[0], ins[1:]
        acts = [v for v in cases if v.kind == ACT]
        if pred.kind == ACT:
            self.pin(pred, "selects on an activation")
        if not acts:
            for v in cases:
                self.mark_other(v, "selected")
            return [self.ew(CONST, ins, self.broadcast(eqn, ins, unify=False), zero=all(v.zero for v in cases))]
        for v in cases:
            self.mark_other(v, "selected")
            if v.kind == CONST and not v.zero:
                for a in acts:
                    self.pin(a, "selects a non-zero constant")
        return [self.ew(ACT, ins, self.broadcast(eqn, acts + [pred] + cases, unify=len(acts) > 1))]

    def rule_clamp(self, eqn, ins):
        return [self.nonlinear(eqn, ins)]

    # -- reductions and pooling ------------------------------------------------
    def _reduce(self, eqn, ins, why):
        """A sum or maximum along ``axes``: over the nodes of a group it pins them, except a maximum along a factor
        of a kernel's output axis that a reshape split off the units the result keeps (maxout, ``z.reshape(b,
        units, k).max(-1)``): each unit is one node shared along it, as by positions (its pieces rescale together,
        and their maximum with them). (A sum, a normalisation's mean over a group of channels, pins as before.) A
        maximum over entries that different weights feed is flagged for
        `pathspace_jax.program.refuse_exclusive_branches` (`weighted_along`)."""
        v = ins[0]
        axes = set(jx.param(eqn, "axes"))
        self.mark_other(v, "reduced")
        kept = [f for k in range(len(v.axes)) if k not in axes for f in self.atoms.factors(v.axes[k])]
        gone, exclusive = [], False
        for k in axes:
            if self.size(v.axes[k]) == 1:
                gone += v.axes[k]
                continue
            maximum = v.kind == ACT and eqn.primitive.name != "reduce_sum"
            exclusive |= maximum and self.weighted_along(v.axes[k])
            if maximum and self.split_from_units(v.axes[k], kept):
                self.atoms.make_positions(v.axes[k])
            else:
                self.atoms.pin(v.axes[k], self.reason(why))
        kind = v.kind if v.kind != PARAM else CONST
        out = Val(kind, [ax for k, ax in enumerate(v.axes) if k not in axes], zero=v.zero, scalars=v.scalars + gone)
        return self.record(eqn, ins, [out], exclusive=True) if exclusive else [out]

    def split_from_units(self, axis: Sequence[int], kept: Sequence[int]) -> bool:
        """Whether ``axis`` is a factor of a kernel's output axis that a reshape split, whose other factors include
        some of the atoms ``kept`` (`_reduce`: maxout's pieces; `ShapeRules._piece_at`: interleaved pieces)."""
        reduced = set(self.atoms.factors(axis))
        return any(reduced < (fs := set(self.atoms.factors([r]))) and fs & set(kept) for r in self.layer_outputs())

    def rule_reduce_sum(self, eqn, ins):
        return self._reduce(eqn, ins, "sums over the nodes of a group")

    def rule_reduce_max(self, eqn, ins):
        return self._reduce(eqn, ins, "takes a maximum over the nodes of a group")

    rule_reduce_min = rule_reduce_max

    def rule_reduce_prod(self, eqn, ins):
        return [self.nonlinear(eqn, ins)]

    def rule_argmax(self, eqn, ins):
        v = ins[0]
        axes = set(jx.param(eqn, "axes"))
        return [Val(CONST, [ax for k, ax in enumerate(v.axes) if k not in axes])]

    rule_argmin = rule_argmax

    def _cumulative(self, eqn, ins):
        v = ins[0]
        self.mark_other(v, "cumulative op")
        self.atoms.pin(v.axes[jx.param(eqn, "axis")], self.reason("accumulates along the nodes of a group"))
        return [dataclasses.replace(v, kind=v.kind if v.kind != PARAM else CONST)]

    rule_cumsum = rule_cummax = rule_cummin = _cumulative

    def _pool(self, eqn, ins):
        v = ins[0]
        windows, strides, padding = (jx.param(eqn, k) for k in ("window_dimensions", "window_strides", "padding"))
        out_shape = eqn.outvars[0].aval.shape
        in_shape = eqn.invars[0].aval.shape
        self.mark_other(v, "pooled")
        keep = []
        for k in range(len(out_shape)):
            trivial = (
                windows[k] == 1 and strides[k] == 1 and tuple(padding[k]) == (0, 0) and in_shape[k] == out_shape[k]
            )
            keep.append(trivial)
            if not trivial:
                for a in self.atoms.factors(v.axes[k]):
                    self.atoms.position[a] = True
        kind = v.kind if v.kind != PARAM else CONST
        out = dataclasses.replace(self._reslice(eqn, v, keep, out_shape, "pools over the nodes of a group"), kind=kind)
        exclusive = eqn.primitive.name != "reduce_window_sum" and v.kind == ACT
        if exclusive and any(self.weighted_along(v.axes[k]) for k, trivial in enumerate(keep) if not trivial):
            return self.record(eqn, ins, [out], exclusive=True)  # (max pooling after nn.ConvLocal)
        return [out]

    def weighted_along(self, axis: Sequence[int]) -> bool:
        """Whether a parameter's entries differ along ``axis``: a kernel's output axis, or the result's side of a
        parameter's batch axis (`diagonal`; nn.ConvLocal's positions). A maximum along it keeps, per entry, the
        piece of one parameter's entries; `pathspace_jax.program.refuse_exclusive_branches` says what that means."""
        written = {f for r in self.layer_outputs() for f in self.atoms.factors([r])}
        written |= {f for ends in self.diagonal.values() for f in self.atoms.factors(ends)}
        return bool(written & set(self.atoms.factors(axis)))

    rule_reduce_window_sum = rule_reduce_window_max = rule_reduce_window_min = _pool

    # -- linear maps with parameters ------------------------------------------------
    def zero_product(self, eqn, ins) -> list[Val] | None:
        """A product with an operand known to be all zeros (a Python loop's zero initial state times its recurrent
        kernel): zeros, neither an edge nor a source of paths (a constant input); None otherwise."""
        if any(v.kind == CONST and v.zero for v in ins):
            return [Val(CONST, self.fresh(eqn.outvars[0].aval.shape), zero=True)]
        return None

    def rule_dot_general(self, eqn, ins):
        if zeros := self.zero_product(eqn, ins):
            return zeros
        if any(v.factors is not None for v in ins):
            if (scaled := self.scaled_kernel(eqn, ins)) is not None:
                return scaled
            ins = self.unscaled(ins)
        lhs, rhs = ins
        (lc, rc), (lb, rb) = jx.param(eqn, "dimension_numbers")
        lfree = [k for k in range(len(lhs.axes)) if k not in lc and k not in lb]
        rfree = [k for k in range(len(rhs.axes)) if k not in rc and k not in rb]
        out = [list(lhs.axes[k]) for k in lb] + [list(lhs.axes[k]) for k in lfree] + [list(rhs.axes[k]) for k in rfree]
        kinds = (lhs.kind, rhs.kind)
        if self.coefficient_product(ins):
            return [Val(CONST, out)]
        if PARAM in kinds and (ACT in kinds or CONST in kinds):
            p, x, pc, xc, pb, xb, pfree = (
                (rhs, lhs, rc, lc, rb, lb, rfree) if rhs.kind == PARAM else (lhs, rhs, lc, rc, lb, rb, lfree)
            )
            for a, b in zip(pc, xc):
                self.atoms.unify(x.axes[b], p.axes[a], self.reason())
                self.use(p, p.axes[a], "in")
                if x.kind == CONST:
                    for f in self.atoms.factors(x.axes[b]):
                        self.atoms.input[f] = True
            for j, (a, b) in enumerate(zip(pb, xb)):
                # one weight per entry along a batch axis (an ensemble's members, a mixture's experts): each entry
                # is part of the nodes on both sides, the result's its own atoms (`diagonal`)
                self.atoms.unify(x.axes[b], p.axes[a], self.reason())
                out[j] = self.diagonal_ends(p, p.axes[a])
            at = len(pb) + (len(lfree) if p is rhs else 0)  # where p's free axes begin in the result
            pieces = self.kernel_pieces(eqn, p, x, (pc, xc, pb), pfree, out, at) if len(pfree) > 1 else None
            for a in pfree if pieces is None else ():
                self.use(p, p.axes[a], "out")
            if x.kind == ACT:
                self.shared_along(x, xc, [k for k in range(len(x.axes)) if k not in xc and k not in xb])
            return [pieces or Val(ACT, out)]
        if kinds == (CONST, CONST):
            return [Val(CONST, out)]
        if kinds == (ACT, ACT) and (summed := self.weighted_sum(ins, (lc, rc), (lb, rb), (lfree, rfree))):
            return [summed]
        for v in ins:
            self.mark_other(v, "multiplied by a parameter")
        if ACT in kinds:
            if kinds == (ACT, ACT):
                for v in ins:
                    self.pin(v, "product of activations")
            else:  # fixed coefficients (a constant, or parameters that are not an edge): new nodes, pinned
                if lhs.kind == ACT:
                    x, xc, c, cfree, first = lhs, lc, rhs, rfree, len(lb) + len(lfree)
                else:
                    x, xc, c, cfree, first = rhs, rc, lhs, lfree, len(lb)
                why = self.reason(MIXES_COMPUTED if c.from_params else "mixes nodes with fixed coefficients")
                for b in xc:
                    self.atoms.pin(x.axes[b], why)
                mixed = [a for b in xc for a in x.axes[b]]
                for j, k in enumerate(cfree):  # never the coefficients' own atoms (a concatenation's positions)
                    out[first + j] = [self.atoms.new(self.size(c.axes[k]))]
                    self.defer(out[first + j], mixed, why, fixed=True)
            for a, b in zip(lb, rb):
                self.atoms.unify(lhs.axes[a], rhs.axes[b], self.reason())
            return [Val(ACT, out)]
        return [Val(CONST, out)]

    def kernel_pieces(self, eqn, p: Val, x: Val, dims, pfree: Sequence[int], out: list[list[int]], at: int):
        """A kernel with several output axes whose output (plus perhaps a bias) is read only in pieces along the first,
        ``out[at]``: queries, keys and values from ``nn.DenseGeneral(features=(3, heads, d))`` read as ``qkv[:, :,
        0]``, ..., or from Gemma's ``jnp.einsum("BTD,SNDH->SBTNH", x, w)`` unpacked. Its output axes are one node
        axis, flattened in the leaf (`flattened`), cut into a group per piece as a ``Dense``'s output reshaped and
        read in pieces is (`_cut_in_pieces`); or, where the pieces axis is the kernel's first and its output axes are
        not its last, each piece's slice is a leaf of its own (`layer_slice`), as layers stacked in one leaf are.
        Else None."""
        (pc, xc, pb), leaf, shape = dims, p.leaf, eqn.outvars[0].aval.shape
        own = self.leaf_axes[leaf]
        if p.scaled or p.axes != own or pb or any(u[2] != self.step for u in self.uses[leaf]):
            return None  # (read before: its axes have uses of their own)
        var, readers = eqn.outvars[0], self.consumers[-1].get(eqn.outvars[0], [])
        if len(readers) == 1 and readers[0] is not None and readers[0].primitive.name in ("add", "add_any"):
            var = readers[0].outvars[0]  # through the bias (`bias_of_pieces`)
        if list(pfree) == list(range(len(own) - len(pfree), len(own))) and at + len(pfree) == len(out):
            flat = self.atoms.new(int(np.prod(shape[at:])))
            if (cut := self._cut_in_pieces(Val(ACT, [*out[:at], [flat]]), flat, var, at, shape)) is not None:
                self.use(p, [flat], "out")
                self.flattened(leaf, len(pfree), flat)
            return cut
        if pfree[0] != 0 or {w for _, w in self._piece_reads(var, at, shape)} != {1}:
            return None
        self.uses[leaf] = []  # read by its slices instead
        axes, per, segs = [list(ax) for ax in out], [], []
        for i in range(shape[at]):
            piece = Val(PARAM, [], leaf=self.layer_slice(leaf, i))
            mine = self.leaf_axes[piece.leaf]  # (the leaf's axes but the first)
            for a, b in zip(pc, xc, strict=True):
                self.atoms.unify(x.axes[b], mine[a - 1], self.reason())
                self.use(piece, mine[a - 1], "in")
            units = [a for k in pfree[1:] for a in mine[k - 1]]
            self.use(piece, units, "out")
            segs.append(self.atoms.new(int(np.prod(shape[at + 1 : at + len(pfree)]))))
            self.atoms.set_expand(segs[-1], units)
            piece_axes = [list(mine[k - 1]) for k in pfree[1:]]
            per.append([*out[:at], [self.atoms.new(1)], *piece_axes, *out[at + len(pfree) :]])
        axes[at] = [self.atoms.new(shape[at])]
        self.atoms.alias[axes[at][0]] = segs
        for j in range(at + 1, at + len(pfree)):
            axes[j] = [self.atoms.new(shape[j])]
        return Val(ACT, axes, pieces=(at, per, None, None))

    def flattened(self, leaf: int, m: int, flat: int) -> None:
        """The last ``m`` axes of ``leaf`` are the one node axis ``flat`` (`kernel_pieces`): its other reads, which
        see the axes apart, make it no edge tensor (`pathspace_jax.trace`)."""
        own = self.leaf_axes[leaf]
        self.apart[leaf] = {a for ax in own[-m:] for a in ax}
        self.leaf_axes[leaf] = [*own[:-m], [flat], *[[] for _ in range(m - 1)]]

    def bias_of_pieces(self, ins: Sequence[Val]) -> Val | None:
        """A bias added to a kernel's output cut in pieces (`kernel_pieces`), along all of its axes: its axes are
        the kernel's node axis too, flattened (`flattened`). Else None."""
        (x, b), acts = (ins if ins[0].kind == ACT else ins[::-1]), [v for v in ins if v.kind == ACT]
        if len(acts) != 1 or x.pieces is None or x.pieces[3] is None:
            return None  # (None: a kernel read in slices, `kernel_pieces`, or its pieces transposed)
        if b.kind != PARAM or b.scaled or self.uses[b.leaf]:
            return None
        n, own = x.pieces[3], self.leaf_axes[b.leaf]
        if len(own) != len(x.axes) - n or b.axes[n:] != own:  # (its other axes: broadcast)
            return None
        self.use(b, [x.pieces[2]], "out")
        self.flattened(b.leaf, len(own), x.pieces[2])
        return dataclasses.replace(x, scalars=list(dict.fromkeys(a for v in ins for a in v.scalars)))

    def coefficient_product(self, ins: Sequence[Val]) -> bool:
        """Whether a product of a parameter and a constant computed from parameters (a power iteration's vector
        times the kernel): a coefficient computed from parameters, not a layer with a fixed input (the parameter is
        no edge)."""
        params = [v for v in ins if v.kind == PARAM]
        if not params or not any(v.kind == CONST and v.from_params for v in ins):
            return False
        for v in params:
            self.mark_other(v, "multiplied by a coefficient computed from parameters")
        return True

    def weighted_sum(self, ins, contracted, batch, free) -> Val | None:
        """A ``dot_general`` of a fully pinned ``a`` and an activation ``x`` that is not (attention's weights times its
        values): a's entries are coefficients that no rescaling changes, so x's units go on through the sum, along
        x's batch axes (the heads) and free axes, and the result scales with them. x's contracted axes (the keys)
        must be positions: where they turn out to be nodes, they are pinned (`settle`). a's free axes (the
        queries) are its own where they are positions or input axes (self-attention's: the sequence's); where they
        are nodes (learned queries, ``nn.MultiHeadDotProductAttention(probe, x)`` with a parameter ``probe``: the
        pinned nodes of fixed coefficients; the units of a pinned layer, in an outer product), the result's are
        positions of their own: each of its entries is x's unit times a coefficient, shared by the entries of that
        axis. None where neither or both are fully pinned (as `gated`)."""
        pinned_rhs = self.fully_pinned(ins[1])
        if self.fully_pinned(ins[0]) == pinned_rhs:
            return None
        j = 0 if pinned_rhs else 1  # the activation's side
        x = ins[j]
        why = self.reason("sums nodes with coefficients computed from pinned values")
        kept = [x.axes[k] for k in (*batch[j], *free[j])]
        for k in contracted[j]:
            if self.written_with(x.axes[k], kept):  # a mixture's experts (nn.vmap'd): their units shared, as positions
                self.atoms.make_positions(x.axes[k])
            self.defer(list(x.axes[k]), list(x.axes[k]), why)
        out = [list(x.axes[k]) for k in batch[j]]
        for v, fr in zip(ins, free, strict=True):
            for k in fr:
                fs = self.atoms.factors(v.axes[k])
                if v is x or all(self.atoms.input[f] or self.atoms.position[f] for f in fs):
                    out.append(list(v.axes[k]))
                else:
                    out.append([self.atoms.new(self.size(v.axes[k]), position=True)])
        return Val(ACT, out)

    def input_positions(self) -> None:
        """An input axis that a layer shares its weights along (``nn.Dense`` applied to every row of a ``(B, T, F)``
        input) and that kernels read only together with nodes (a head over the flattened ``T × units``) is a
        position, as an image's rows are for a convolution: the units rescale alike at every entry, and the head
        has one edge per position and unit. One that a kernel reads on its own (a token-mixing layer) stays an
        input axis, and so does the examples' axis, which no kernel reads."""
        atoms, reads = self.atoms, {}
        for uses in self.uses:
            by_use: dict[int, list[int]] = {}  # the factors that one use of a kernel reads, over all its read axes
            for a, role, step, _ in uses:
                if role == "in":  # (a flattened feature map concatenated with other features: its factors)
                    by_use.setdefault(step, []).extend(atoms.resolve([a]))
            for fs in by_use.values():
                for f in fs:
                    reads.setdefault(f, []).append(fs)
        for r in set(atoms.factors(list(self.shared_inputs))):
            if atoms.position[r] or r not in reads:
                continue
            if all(len(fs) > 1 and not all(atoms.input[f] for f in fs) for fs in reads[r]):
                atoms.make_positions([r])

    def shared_along(self, x: Val, read: Sequence[int], free: Sequence[int]) -> None:
        """A layer reads the axes ``read`` of ``x`` with weights shared along its ``free`` axes. Where a free axis
        and a read one were written by one kernel (its output axes: ``nn.DenseGeneral`` with two feature axes, an
        ``nn.vmap``'d layer's members), the free axis is a position: the nodes are shared along it, as the
        weights are (the units of the read axis rescale alike at every entry of the free one)."""
        atoms = self.atoms
        for k in free:
            self.shared_input(x.axes[k])
        free = [  # the examples' axis and other input axes are not a kernel's (and the common case: no search)
            k for k in free if self.size(x.axes[k]) > 1
            and not all(atoms.input[f] or atoms.position[f] for f in atoms.factors(x.axes[k]))
        ]  # fmt: skip
        if not free:
            return
        for k in free:
            if self.written_with(x.axes[k], [x.axes[j] for j in read]):
                atoms.make_positions(x.axes[k])

    def shared_input(self, axis: Sequence[int]) -> None:
        """A layer shares its weights along ``axis``: if it is an input axis, perhaps a position (`input_positions`)."""
        fs = self.atoms.factors(axis)
        if self.size(axis) > 1 and all(self.atoms.input[f] and not self.atoms.position[f] for f in fs):
            self.shared_inputs.update(fs)

    def written_with(self, axis: Sequence[int], others: Sequence[Sequence[int]]) -> bool:
        """Whether ``axis`` and one of ``others`` (atom lists) were written by one kernel, as two of its output
        axes (``nn.DenseGeneral`` with two feature axes, an ``nn.vmap``'d layer's members and units). Axes of one
        entry say nothing (a batch of one example, a power iteration's row vector)."""
        others = [o for o in others if self.size(o) > 1]
        if self.size(axis) == 1 or not others:
            return False
        atoms, outs = self.atoms, {}
        for leaf, uses in enumerate(self.uses):
            for a, role, _, _ in uses:
                if role == "out":
                    outs.setdefault(leaf, set()).update(atoms.factors([a]))
        f, fs = set(atoms.factors(axis)), [set(atoms.factors(o)) for o in others]
        return any(f <= own and any(r and r <= own for r in fs) for own in outs.values())

    def rule_conv_general_dilated(self, eqn, ins):
        if zeros := self.zero_product(eqn, ins):
            return zeros
        if any(v.factors is not None for v in ins):
            if (scaled := self.scaled_kernel(eqn, ins)) is not None:
                return scaled
            ins = self.unscaled(ins)
        lhs, rhs = ins
        dn = jx.param(eqn, "dimension_numbers")
        lspec, rspec, ospec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
        out_shape = eqn.outvars[0].aval.shape
        out = [[] for _ in out_shape]
        out[ospec[0]] = list(lhs.axes[lspec[0]])
        for k in ospec[2:]:
            out[k] = [self.atoms.new(out_shape[k], position=True)]
        groups = jx.param(eqn, "feature_group_count")
        grouped = jx.param(eqn, "batch_group_count") != 1
        if self.coefficient_product(ins):
            return [Val(CONST, out)]
        if rhs.kind == PARAM and lhs.kind in (ACT, CONST) and not grouped:
            # G groups: input channel (g, i) feeds output channel (g, o) only, through kernel entry (i, g·O/G + o);
            # g is a batch axis of the channels (depthwise convolutions, an ensemble's under nn.vmap), as in
            # `rule_dot_general`
            (g_in, c_in), (g_out, c_out) = (self.split(ax, groups) for ax in (lhs.axes[lspec[1]], rhs.axes[rspec[0]]))
            self.atoms.unify(c_in, rhs.axes[rspec[1]], self.reason())
            self.use(rhs, rhs.axes[rspec[1]], "in" if c_in else "tap")
            if lhs.kind == CONST:
                for f in self.atoms.factors(lhs.axes[lspec[1]]):
                    self.atoms.input[f] = True
            if g_in:
                self.atoms.unify(g_in, g_out, self.reason())
                g_out = self.diagonal_ends(rhs, g_out)
            self.use(rhs, c_out, "out")
            for k in rspec[2:]:
                self.use(rhs, rhs.axes[k], "tap")
                self.atoms.make_positions(rhs.axes[k])
            for k in lspec[2:]:
                self.atoms.make_positions(lhs.axes[k])
            out[ospec[1]] = list(g_out) + list(c_out)
            return [Val(ACT, out)]
        if lhs.kind == CONST and rhs.kind == CONST:
            out[ospec[1]] = [self.atoms.new(out_shape[ospec[1]])]
            return [Val(CONST, out)]
        if lhs.kind == ACT and rhs.kind == CONST and not grouped and self.selects_taps(eqn, rhs, groups):
            # each output feature (c, t) is input channel c at tap t (times a fixed coefficient): the channel's
            # nodes, at other positions (`lax.conv_general_dilated_patches`, behind `nn.ConvLocal`)
            for k in lspec[2:]:
                self.atoms.make_positions(lhs.axes[k])
            taps = out_shape[ospec[1]] // groups
            out[ospec[1]] = list(lhs.axes[lspec[1]]) + [self.atoms.new(taps, position=True)]
            return [Val(ACT, out)]
        why = "batch-grouped convolution" if grouped else "convolution without a parameter kernel"
        if not grouped and rhs.kind == CONST and rhs.from_params:
            why = MIXES_COMPUTED
        for v in ins:
            self.mark_other(v, why)
            if v.kind == ACT:
                self.pin(v, why)
        out[ospec[1]] = [self.atoms.new(out_shape[ospec[1]])]
        val = Val(ACT, out)
        self.pin(val, why)
        return [val]

    def selects_taps(self, eqn, kernel: Val, groups: int) -> bool:
        """Whether a convolution's constant ``kernel`` (a value the trace can compute) has one group per input
        channel and, for each output feature, exactly one non-zero entry: every output is one input entry times
        a fixed coefficient, as ``lax.conv_general_dilated_patches`` makes them."""
        dn = jx.param(eqn, "dimension_numbers")
        if groups != eqn.invars[0].aval.shape[dn.lhs_spec[1]]:
            return False
        k = self.rec.value(kernel.id)
        if k is None:
            return False
        k = np.moveaxis(k, (dn.rhs_spec[0], dn.rhs_spec[1]), (0, 1))
        return k.shape[1] == 1 and bool(np.all(np.count_nonzero(k.reshape(k.shape[0], -1), axis=1) == 1))

    def diagonal_ends(self, p: Val, axis: list[int]) -> list[int]:
        """The atoms that parameter ``p``'s batch axis ``axis`` gives the result (`diagonal`), the same at every use
        of the leaf: the output side of its nodes, whose input side is ``axis`` itself."""
        self.use(p, axis, "diag")
        return list(self.diagonal.setdefault((p.leaf, tuple(axis)), [self.atoms.new(self.size(axis))]))

    def split(self, axis: list[int], groups: int) -> tuple[list[int], list[int]]:
        """The atoms of ``axis`` as ``groups`` consecutive blocks: (the block's atoms, the atoms within a block),
        either empty where it has one entry (one group, or one entry per group)."""
        if groups == 1:
            return [], list(axis)
        ids, blocks = [i for a in axis for i in self._ids(a)], 1  # atom ids: a parameter's roles are kept by id
        for k, a in enumerate(ids):
            if blocks == groups:
                return ids[:k], ids[k:]
            blocks *= self.size([a])
        if blocks == groups:
            return ids, []
        parts = [self.atoms.new(groups), self.atoms.new(self.size(axis) // groups)]
        self.atoms.unify(axis, parts, self.reason())
        return parts[:1], parts[1:]

    # -- control flow ---------------------------------------------------------------
    def _carry_in(self, v: Val) -> Val:
        if v.kind == CONST:
            return Val(ACT, [list(ax) for ax in v.axes], id=v.id) if v.zero else v
        if v.kind == PARAM:
            self.mark_other(v, "carried through a loop")
            return Val(CONST, [list(ax) for ax in v.axes], id=v.id)
        return v

    def _tie_carry(self, init: Sequence[Val], carry_in: Sequence[Val], carry_out: Sequence[Val]):
        for i0, ci, co in zip(init, carry_in, carry_out):
            if ci.kind == ACT or co.kind == ACT:
                for a, b in zip(ci.axes, co.axes):
                    self.atoms.unify(a, b, self.reason("loop carry"))
                if i0.kind == CONST and not i0.zero:
                    self.atoms.pin(self.all_atoms(ci), self.reason("loop carry starts from a non-zero constant"))
                if co.kind == PARAM:
                    self.mark_other(co, "carried through a loop")

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

    def _layer_counter(self, sc, consts, init) -> int | None:
        """The carry index of the counter of a loop over layers stacked in a params leaf that reads them by it
        (``lax.fori_loop(0, n, lambda i, h: relu(h @ ws[i]), x)``): a counter from a known start, and a whole
        params leaf among the consts that the body slices dynamically. Else None."""
        k = jx.loop_counter(sc)
        if k is None or sc.reverse or not isinstance(init[k].id, tuple):
            return None
        whole = [j for j, v in enumerate(consts) if v.kind == PARAM and v.axes == self.leaf_axes[v.leaf]]
        return k if any(jx.dynamically_sliced(sc, j) for j in whole) else None

    def _layer_stack(self, sc, consts, init, xs, counter: int | None = None):
        """A scan that slices params leaves along its axis (``nn.scan`` over layers, with or without remat) is a
        stack of distinct layers, not a recurrence: the body runs (and is recorded) once per layer, with layer
        i's slices as leaves of their own, and each layer's carry feeds the next (their groups are not tied).
        With ``counter`` (`_layer_counter`), that carry is a literal at each step, so the body's ``ws[i]`` is a
        static slice: layer i's. Returns the last carry and the per-step outputs (``ys``, recorded stacked), their
        atoms tied across the layers. The frame notes where each layer's equations lie (`pathspace_jax.ir.LayerStack`),
        for the programs that run the stack as one scan (`pathspace_jax.program`)."""
        nk = len(init)
        x_avals, y_avals = jx.in_avals(sc.body)[len(consts) + nk :], jx.out_avals(sc.body)[nk:]
        carry, per_layer = [v if k == counter else self._carry_in(v) for k, v in enumerate(init)], {}
        slices = [self.rec.layers(v.id, (sc.length, *a.shape), a.dtype) for v, a in zip(xs, x_avals, strict=True)]
        frame, eqn = self.rec.frames[-1], self.eqn
        spans, body_ins, body_outs = [], [], []
        for layer in reversed(range(sc.length)) if sc.reverse else range(sc.length):
            body_xs = []
            for v, ids in zip(xs, slices, strict=True):
                i = ids[layer]
                if v.layers is not None:  # leaves stacked for the scan (`rule_stack`): layer i reads leaf i
                    body_xs.append(v.layers[layer])
                elif v.kind == PARAM:
                    leaf = self.layer_slice(v.leaf, layer)
                    body_xs.append(Val(PARAM, [list(ax) for ax in self.leaf_axes[leaf]], leaf=leaf, id=i))
                else:
                    body_xs.append(dataclasses.replace(v, axes=[list(ax) for ax in v.axes[1:]], id=i))
            start = len(frame.eqns)
            outs = self.run_closed(sc.body, list(consts) + carry + body_xs)
            spans.append((start, len(frame.eqns)))
            body_ins.append([v.id for v in list(consts) + carry + body_xs])
            body_outs.append([v.id for v in outs])
            carry, per_layer[layer] = (
                [v if k == counter else self._carry_in(v) for k, v in enumerate(outs[:nk])],
                outs[nk:],
            )
        ys = []
        for j, a in enumerate(y_avals):
            vals = [per_layer[layer][j] for layer in range(sc.length)]
            # the layers' params given back stacked (nnx.scan returns the modules it scanned over; under nnx.remat
            # JAX cannot see that they are its inputs) are the leaf again, not a value the layers share: untied
            tied = vals[1:] if vals[0].kind != PARAM else []
            for v in tied:
                for a0, b in zip(vals[0].axes, v.axes, strict=True):
                    self.atoms.unify(a0, b, self.reason("stacked over the layers of a scan"))
            ys.append(dataclasses.replace(vals[0], id=self.rec.stack([v.id for v in vals], a.shape, a.dtype)))
        plain = counter is None and all(v.layers is None for v in xs)
        frame.stacks.append(LayerStack(eqn, tuple(self.callers), sc, [v.id for v in init], [v.id for v in xs], spans,
                                       body_ins, body_outs, [v.id for v in ys], plain))  # fmt: skip
        return carry, ys

    def rule_scan(self, eqn, ins):
        sc = jx.scan(eqn)
        nc, nk = sc.num_consts, sc.num_carry
        consts, init, xs = ins[:nc], ins[nc : nc + nk], ins[nc + nk :]
        for v in xs:  # the scanned axis: positions (time steps, or layers)
            if v.axes:
                self.atoms.make_positions(v.axes[0])
        sliced = [v for v in xs if v.kind == PARAM]
        stacked = [v for v in xs if v.layers is not None]
        counter = None if sliced or stacked else self._layer_counter(sc, consts, init)
        layers = bool(sliced or stacked) and all(v.axes == self.leaf_axes[v.leaf] for v in sliced)
        layers = layers or counter is not None
        if layers:
            carry, ys = self._layer_stack(sc, consts, init, xs, counter)
        else:  # a recurrence: its body recorded as a program of its own
            carry = [self._carry_in(v) for v in init]
            body_xs = []
            for v in xs:
                for leaf in v.layers or ():
                    self.mark_other(leaf, "stacked and sliced by a scan")
                if v.kind == PARAM:
                    self.mark_other(v, "sliced by a scan")
                    body_xs.append(Val(CONST, [list(ax) for ax in v.axes[1:]]))
                else:
                    body_xs.append(dataclasses.replace(v, axes=[list(ax) for ax in v.axes[1:]]))
            body = self.rec.push()
            body_ins = [v.with_id(self.rec.new()) for v in list(consts) + carry + body_xs]
            body.in_ids = [v.id for v in body_ins]
            outs = self.run_closed(sc.body, body_ins)
            body.out_ids = [v.id for v in outs]
            self.rec.pop()
            self._tie_carry(init, carry, outs[:nk])
            ys = outs[nk:]
        time = [self.atoms.new(sc.length, position=True)]
        ys = [dataclasses.replace(v, axes=[list(time)] + v.axes, kind=v.kind if v.kind != PARAM else CONST) for v in ys]
        return Recorded(carry + ys) if layers else self.record(eqn, ins, carry + ys, scan=sc, body=body)

    def rule_while(self, eqn, ins):
        w = jx.while_loop(eqn)
        cn, bn = w.cond_nconsts, w.body_nconsts
        bconsts, init = ins[cn : cn + bn], ins[cn + bn :]
        carry = [self._carry_in(v) for v in init]
        self.rec.push()  # recorded as one equation (the programs refuse while loops)
        outs = self.run_closed(w.body, list(bconsts) + carry)
        self.rec.pop()
        self._tie_carry(init, carry, outs)
        return carry

    def rule_cond(self, eqn, ins):
        ops = ins[1:]
        self.rec.push()  # recorded as one equation (the programs refuse cond)
        results = [self.run_closed(br, ops) for br in jx.cond_branches(eqn)]
        self.rec.pop()
        outs = []
        for vals in zip(*results):
            acts = [v for v in vals if v.kind == ACT]
            if not acts:
                outs.append(Val(CONST, [list(a) for a in vals[0].axes]))
                continue
            for v in acts[1:]:
                for a, b in zip(acts[0].axes, v.axes):
                    self.atoms.unify(a, b, self.reason("branches of cond"))
            outs.append(acts[0])
        return outs
