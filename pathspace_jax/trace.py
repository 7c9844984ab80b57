"""`trace`: find the reduction graph of a forward function by abstract interpretation.

``jax.make_jaxpr(fn)(params, *args)`` is interpreted once, abstractly. Every
array axis carries a list of *atoms* (labels in a union-find; an axis that was
flattened from several axes carries several atoms, in row-major order). Each
primitive has one small rule saying how atoms flow:

* ``dot_general`` / ``conv_general_dilated`` with a parameter operand unify the
  contracted activation axis with the parameter's input axis and give the result
  the parameter's output axis: that is an edge tensor between two node groups
  (conv kernel spatial axes are *taps*: each tap its own edge);
* ``add`` unifies the atoms of its operands: a parameter added to an activation
  is a bias, two activations added together (a residual, a recurrence) tie their
  groups into one;
* ReLU (``max(x, 0)``), leaky ReLU (``select_n``), pooling, reshape, transpose,
  slicing of positions, concatenation keep or re-arrange atoms;
* ``scan`` / ``while`` tie the carry to itself (recurrent kernels become edges
  from a group to itself); ``pjit``, ``custom_jvp_call``, ``custom_vjp_call``,
  ``checkpoint``, ``cond`` are entered;
* anything that is not positively homogeneous per node (``tanh``, ``exp``,
  ``rsqrt``, a product of activations, adding a non-zero constant, a reduction
  over nodes, an unknown primitive) **pins** the atoms it touches.

Parameter names, module names and leaf order are never read.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pathspace_jax import jaxpr as jx
from pathspace_jax import rules
from pathspace_jax.errors import UnsupportedModelError
from pathspace_jax.graph import BIAS_NODE, EdgeLeaf, NodeGroup, PathSpace, leaf_path_strings
from pathspace_jax.skeleton import choose_by_value

__all__ = ["trace", "UnsupportedModelError", "leaf_path_strings"]


# ---------------------------------------------------------------------------
# Atoms: a union-find over axis labels.
# ---------------------------------------------------------------------------


class _Atoms:
    def __init__(self):
        self.parent: list[int] = []
        self.size: list[int] = []
        self.expand: list[list[int] | None] = []  # product structure (row-major)
        self.alias: list[list[int] | None] = []  # concatenation of whole atoms
        self.position: list[bool] = []
        self.input: list[bool] = []
        self.output: list[bool] = []
        self.reasons: list[list[str]] = []

    def new(self, size: int, *, position=False, input=False) -> int:
        i = len(self.parent)
        self.parent.append(i)
        self.size.append(int(size))
        self.expand.append(None)
        self.alias.append(None)
        self.position.append(position)
        self.input.append(input)
        self.output.append(False)
        self.reasons.append([])
        return i

    def find(self, a: int) -> int:
        root = a
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[a] != root:
            self.parent[a], a = root, self.parent[a]
        return root

    def factors(self, atoms: Sequence[int]) -> list[int]:
        """Fully expanded roots of a list of atoms."""
        out: list[int] = []
        for a in atoms:
            r = self.find(a)
            if self.expand[r] is None:
                out.append(r)
            else:
                out.extend(self.factors(self.expand[r]))
        return out

    def pin(self, atoms: Sequence[int], reason: str) -> None:
        for r in self.factors(atoms):
            if reason not in self.reasons[r]:
                self.reasons[r].append(reason)

    def _set_expand(self, r: int, children: list[int]) -> None:
        self.expand[r] = list(children)
        for c in self.factors(children):
            self.position[c] |= self.position[r]
            self.input[c] |= self.input[r]
            self.output[c] |= self.output[r]
            self.reasons[c].extend(x for x in self.reasons[r] if x not in self.reasons[c])

    def union(self, a: int, b: int, reason: str) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return
        if ra > rb:
            ra, rb = rb, ra
        assert self.size[ra] == self.size[rb], "union of atoms of different sizes"
        self.parent[rb] = ra
        self.position[ra] |= self.position[rb]
        self.input[ra] |= self.input[rb]
        self.output[ra] |= self.output[rb]
        self.reasons[ra].extend(x for x in self.reasons[rb] if x not in self.reasons[ra])
        ea, eb = self.expand[ra], self.expand[rb]
        if ea is None and eb is not None:
            self.expand[ra] = eb
        elif ea is not None and eb is not None:
            self.unify(ea, eb, reason)
        la, lb = self.alias[ra], self.alias[rb]
        if la is None:
            self.alias[ra] = lb
        elif lb is not None and la != lb:
            self.pin([ra], reason + " (two different concatenations tied together)")

    def unify(self, xs: Sequence[int], ys: Sequence[int], reason: str) -> None:
        """Make two axes (atom lists of equal total size) the same, factor by factor."""
        fa, fb = self.factors(xs), self.factors(ys)
        i = j = 0
        while i < len(fa) and j < len(fb):
            a, b = self.find(fa[i]), self.find(fb[j])
            sa, sb = self.size[a], self.size[b]
            if sa == sb:
                self.union(a, b, reason)
                i, j = i + 1, j + 1
                continue
            # split the larger atom into the run of smaller ones that makes it up
            small, big, k0, swap = (fa, b, i, False) if sa < sb else (fb, a, j, True)
            k, p = k0, 1
            while k < len(small) and p < self.size[big]:
                p *= self.size[self.find(small[k])]
                k += 1
            if p != self.size[big] or self.alias[big] is not None:
                self.pin(list(fa) + list(fb), reason + " (axes reshaped incompatibly)")
                return
            self._set_expand(big, [self.find(s) for s in small[k0:k]])
            if swap:
                i, j = i + 1, k
            else:
                i, j = k, j + 1


# ---------------------------------------------------------------------------
# Abstract values.
# ---------------------------------------------------------------------------

ACT, PARAM, CONST = "act", "param", "const"


@dataclasses.dataclass
class _Val:
    """kind: 'act' (depends on inputs and is rescaled with its nodes), 'param'
    (a view of one parameter leaf) or 'const' (fixed, or scale invariant: literals,
    integer inputs, predicates, masks). ``axes`` is one atom list per array axis
    ``scalars`` keeps the atoms of size-1 axes that were squeezed away (a single
    output unit read as ``y[:, 0]`` is still an output node)."""

    kind: str
    axes: list[list[int]]
    leaf: int | None = None
    zero: bool = False
    scalars: list[int] = dataclasses.field(default_factory=list)  # atoms of squeezed size-1 axes
    random: bool = False  # a constant computed from random numbers (a dropout mask, a PRNG key)


class _Interpreter:
    def __init__(self, leaf_paths: Sequence[str]):
        self.atoms = _Atoms()
        self.leaf_paths = list(leaf_paths)
        self.uses: list[list[tuple[int, str, int]]] = [[] for _ in leaf_paths]
        self.other: list[list[str]] = [[] for _ in leaf_paths]
        self.leaf_axes: list[list[list[int]]] = []
        self.step = 0
        self.eqn = None
        # the atoms of every equation's outputs, keyed by the chain of equation indices through calls and
        # loop bodies (``site``); `boundary_sites` turns them into pinned flags for `pathspace_jax.squared`
        self.site: tuple = ()
        self.sites: dict[tuple, list[list[int] | None]] = {}

    # -- helpers -------------------------------------------------------------
    def reason(self, what: str = "") -> str:
        name = self.eqn.primitive.name if self.eqn is not None else "?"
        where = jx.where(self.eqn) if self.eqn is not None else ""
        return f"{name}{': ' + what if what else ''} at {where}"

    def fresh(self, shape, *, position=False, input=False) -> list[list[int]]:
        return [[self.atoms.new(d, position=position, input=input)] for d in shape]

    def size(self, axis: Sequence[int]) -> int:
        return int(np.prod([self.atoms.size[self.atoms.find(a)] for a in axis], dtype=np.int64))

    def use(self, v: _Val, atoms: Sequence[int], role: str) -> None:
        for a in atoms:
            self.uses[v.leaf].append((a, role, self.step))

    def mark_other(self, v: _Val, why: str) -> None:
        if v.kind == PARAM:
            self.other[v.leaf].append(self.reason(why))
            self.atoms.pin(self.all_atoms(v), self.reason(why))

    def pin(self, v: _Val, why: str) -> None:
        self.atoms.pin(self.all_atoms(v), self.reason(why))

    def all_atoms(self, v: _Val) -> list[int]:
        return [a for ax in v.axes for a in ax] + list(v.scalars)

    # -- running jaxprs ------------------------------------------------------
    def read(self, env, x) -> _Val:
        if jx.is_literal(x):
            val = jx.literal_value(x)
            return _Val(CONST, self.fresh(np.shape(val)), zero=not np.any(val))
        return env[x]

    def run(self, jaxpr: jx.Jaxpr, consts: Sequence[_Val], args: Sequence[_Val]) -> list[_Val]:
        env: dict[Any, _Val] = {}
        for var, val in zip(jaxpr.constvars, consts):
            env[var] = val
        for var, val in zip(jaxpr.invars, args):
            env[var] = val
        prefix = self.site
        for idx, eqn in enumerate(jaxpr.eqns):
            self.eqn = eqn
            self.step += 1
            self.site = prefix + (idx,)
            ins = [self.read(env, x) for x in eqn.invars]
            outs = self.apply(eqn, ins)
            if any(v.random for v in ins):
                self.randomness(ins, outs)
            for var, val in zip(eqn.outvars, outs):
                shape = getattr(var.aval, "shape", ())
                assert len(val.axes) == len(shape), (eqn.primitive.name, val.axes, shape)
                env[var] = val
            self.sites[self.site] = [self.all_atoms(v) if v.kind == ACT else None for v in outs]
        self.site = prefix
        return [self.read(env, x) for x in jaxpr.outvars]

    def run_closed(self, cj: jx.ClosedJaxpr, args: Sequence[_Val]) -> list[_Val]:
        """Run a sub-jaxpr (``self.eqn`` is restored afterwards: reasons name the calling equation's line)."""
        eqn = self.eqn
        outs = self.run(cj.jaxpr, [self.const_val(c) for c in cj.consts], args)
        self.eqn = eqn
        return outs

    def const_val(self, c) -> _Val:
        shape = np.shape(c)
        try:
            zero = not np.any(np.asarray(c))
        except Exception:
            zero = False
        return _Val(CONST, self.fresh(shape), zero=zero)

    # -- dispatch ------------------------------------------------------------
    def apply(self, eqn, ins: list[_Val]) -> list[_Val]:
        name = eqn.primitive.name
        structure = rules.rule(name).structure  # the rule table: one entry per primitive
        method = getattr(self, "rule_" + name, None) if structure == "method" else None
        if method is not None:
            return method(eqn, ins)
        if structure == "relabel":
            return [dataclasses.replace(v) for v in ins[: len(eqn.outvars)]]
        if structure == "nonlinear":
            return [self.nonlinear(eqn, ins)]
        if structure in ("degree0", "compare"):
            return [self.degree0(eqn, ins)]
        if rules.is_random(name):
            return [_Val(CONST, self.fresh(v.aval.shape), random=True) for v in eqn.outvars]
        if structure == "source":
            return [_Val(CONST, self.fresh(v.aval.shape)) for v in eqn.outvars]
        sub = jx.call_body(eqn)  # jit, custom_jvp_call, custom_vjp_call, checkpoint, ...: entered
        if sub is not None:
            return self.run_closed(sub, ins)
        return self.unknown(eqn, ins)

    def randomness(self, ins: Sequence[_Val], outs: Sequence[_Val]) -> None:
        """Random numbers reach the network (dropout, noise): the groups they touch are pinned, since κ, path
        norms and the skeleton are defined for one deterministic network."""
        why = (
            "uses random numbers (dropout or noise in the traced function): trace the deterministic function "
            "instead, e.g. deterministic=True or train=False, and apply dropout only in the loss"
        )
        for o in outs:
            if o.kind == CONST:
                o.random = True
            elif o.kind == ACT:
                self.pin(o, why)
                for v in ins:
                    if v.kind == ACT:
                        self.pin(v, why)

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
            val = _Val(kind, axes)
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

    def broadcast(self, eqn, ins: Sequence[_Val], *, unify: bool) -> list[list[int]]:
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

    def ew(self, kind: str, ins: Sequence[_Val], axes, **kw) -> _Val:
        """The result of an elementwise op; squeezed size-1 atoms of the operands carry over."""
        return _Val(kind, axes, scalars=list(dict.fromkeys(a for v in ins for a in v.scalars)), **kw)

    # -- elementwise arithmetic -------------------------------------------------
    def rule_add(self, eqn, ins):
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
            self.use(v, self.all_atoms(v), "out")
        if any(not c.zero for c in consts):
            for v in acts:
                self.pin(v, "adds a constant offset")
        return [self.ew(ACT, ins, axes)]

    rule_sub = rule_add
    rule_add_any = rule_add

    def rule_mul(self, eqn, ins):
        acts = [v for v in ins if v.kind == ACT]
        params = [v for v in ins if v.kind == PARAM]
        consts = [v for v in ins if v.kind == CONST]
        if len(acts) > 1:
            for v in acts:
                self.pin(v, "product of activations")
        if acts and params:
            for v in params:
                self.mark_other(v, "elementwise product of a parameter and an activation")
            for v in acts:
                self.pin(v, "elementwise product with a parameter")
        if acts:
            return [self.ew(ACT, ins, self.broadcast(eqn, acts + params + consts, unify=len(acts) > 1))]
        if len(params) == 1 and eqn.primitive.name == "mul":
            # a parameter times a fixed coefficient is still a view of that parameter
            return [self.ew(PARAM, ins, self.broadcast(eqn, params + consts, unify=False), leaf=params[0].leaf)]
        if params:
            for v in params:
                self.mark_other(v, "product of parameters")
            return [self.ew(CONST, ins, self.broadcast(eqn, ins, unify=False))]
        return [self.ew(CONST, ins, self.broadcast(eqn, ins, unify=False), zero=any(c.zero for c in consts))]

    def rule_div(self, eqn, ins):
        num, den = ins
        if den.kind == CONST and num.kind in (ACT, PARAM):
            if num.kind == PARAM:
                return [self.ew(PARAM, ins, self.broadcast(eqn, [num, den], unify=False), leaf=num.leaf)]
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
            return [_Val(ACT, [list(a) for a in v.axes])]
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

    # -- structure ---------------------------------------------------------------
    def rule_reshape(self, eqn, ins):
        """Factors are matched right to left (numpy's broadcasting convention), so
        ``(C,) -> (1, C)`` keeps the parameter's atom on the last axis."""
        v = ins[0]
        new_sizes = jx.param(eqn, "new_sizes")
        if jx.param(eqn, "dimensions", None) is not None:
            return self.unknown(eqn, ins)
        flat = [x for ax in v.axes for a in ax for x in self._ids(a)]
        scalars = list(v.scalars)
        # a new unit axis of a function input (x.reshape(b, 8, 8, 1) of a (b, 64) input, the channel axis
        # of a conv) holds input nodes
        from_input = bool(flat) and all(self.atoms.input[self.atoms.find(a)] for a in flat)
        out: list[list[int]] = []
        k = len(flat) - 1
        for d in reversed(new_sizes):
            if d == 1:
                if k >= 0 and self.size([flat[k]]) == 1:
                    out.append([flat[k]])
                    k -= 1
                else:
                    out.append([scalars.pop()] if scalars else [self.atoms.new(1, input=from_input)])
                continue
            cur: list[int] = []
            p = 1
            while p < d and k >= 0:
                f = flat[k]
                s = self.size([f])
                if s == 1:
                    scalars.append(f)
                    k -= 1
                elif p * s <= d:
                    cur.insert(0, f)
                    p *= s
                    k -= 1
                elif d % p == 0 and s % (d // p) == 0 and self.atoms.alias[self.atoms.find(f)] is None:
                    need = d // p
                    first, rest = self.atoms.new(s // need), self.atoms.new(need)
                    self.atoms._set_expand(self.atoms.find(f), [first, rest])
                    flat[k : k + 1] = [first, rest]
                    k += 1
                else:
                    return self.unknown(eqn, ins)
            if p != d:
                return self.unknown(eqn, ins)
            out.append(cur)
        scalars.extend(flat[: k + 1])
        return [dataclasses.replace(v, axes=out[::-1], scalars=scalars)]

    def _ids(self, a: int) -> list[int]:
        """Like `_Atoms.factors` but keeps atom ids where there is no product structure."""
        r = self.atoms.find(a)
        if self.atoms.expand[r] is None:
            return [a]
        return [x for c in self.atoms.expand[r] for x in self._ids(c)]

    def rule_squeeze(self, eqn, ins):
        v = ins[0]
        dims = {d % len(v.axes) for d in jx.param(eqn, "dimensions")}
        gone = [a for k in sorted(dims) for a in v.axes[k]]
        return [
            dataclasses.replace(v, axes=[ax for k, ax in enumerate(v.axes) if k not in dims], scalars=v.scalars + gone)
        ]

    def rule_transpose(self, eqn, ins):
        v = ins[0]
        return [dataclasses.replace(v, axes=[v.axes[p] for p in jx.param(eqn, "permutation")])]

    def rule_broadcast_in_dim(self, eqn, ins):
        v = ins[0]
        shape = jx.param(eqn, "shape")
        out = self.fresh(shape)
        in_shape = eqn.invars[0].aval.shape
        for k, d in enumerate(jx.param(eqn, "broadcast_dimensions")):
            if in_shape[k] == shape[d]:
                out[d] = list(v.axes[k])
        return [dataclasses.replace(v, axes=out)]

    def _reslice(self, eqn, v: _Val, keep: Sequence[bool], out_shape, why: str) -> _Val:
        """Axes that are not kept get fresh atoms; the old atoms are pinned (a node
        group may not be cut), which does nothing to positions (batch, time, space)."""
        out = []
        for k, d in enumerate(out_shape):
            if keep[k] or self.size(v.axes[k]) == d == 1:
                out.append(list(v.axes[k]))
            else:
                if v.kind == PARAM:
                    self.mark_other(v, why)
                self.atoms.pin(v.axes[k], self.reason(why))
                out.append([self.atoms.new(d, position=True)])
        return dataclasses.replace(v, axes=out)

    def rule_slice(self, eqn, ins):
        v = ins[0]
        in_shape, out_shape = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
        keep = [a == b for a, b in zip(in_shape, out_shape)]
        return [self._reslice(eqn, v, keep, out_shape, "slices part of an axis")]

    def rule_rev(self, eqn, ins):
        v = ins[0]
        keep = [k not in jx.param(eqn, "dimensions") for k in range(len(v.axes))]
        return [self._reslice(eqn, v, keep, eqn.outvars[0].aval.shape, "reverses the nodes of a group")]

    def rule_dynamic_slice(self, eqn, ins):
        return self.rule_slice(eqn, ins[:1])

    def rule_pad(self, eqn, ins):
        v, pad = ins
        if v.kind == ACT and not pad.zero:
            self.pin(v, "pads with a non-zero value")
        out_shape = eqn.outvars[0].aval.shape
        keep = [cfg == (0, 0, 0) for cfg in jx.param(eqn, "padding_config")]
        return [self._reslice(eqn, v, keep, out_shape, "pads an axis")]

    def rule_dynamic_update_slice(self, eqn, ins):
        op, upd = ins[0], ins[1]
        shape = eqn.outvars[0].aval.shape
        kind = ACT if ACT in (op.kind, upd.kind) else CONST
        for v in (op, upd):
            self.mark_other(v, "updated in place")
        if kind == ACT and not (op.kind == CONST and op.zero) and op.kind != ACT:
            self.pin(upd, "written into a non-zero constant")
        out = []
        for k, d in enumerate(shape):
            if eqn.invars[1].aval.shape[k] == d:
                self.atoms.unify(op.axes[k], upd.axes[k], self.reason())
                out.append(list(op.axes[k]))
            else:
                self.atoms.pin(op.axes[k] + upd.axes[k], self.reason("partial update of an axis"))
                out.append(list(op.axes[k]))
        return [_Val(kind, out)]

    def rule_concatenate(self, eqn, ins):
        dim = jx.param(eqn, "dimension")
        shape = eqn.outvars[0].aval.shape
        acts = [v for v in ins if v.kind == ACT]
        for v in ins:
            self.mark_other(v, "concatenated")
        kind = ACT if acts else CONST
        out = []
        for k, d in enumerate(shape):
            if k != dim:
                lists = [v.axes[k] for v in ins]
                for other in lists[1:]:
                    self.atoms.unify(lists[0], other, self.reason())
                out.append(list(lists[0]))
                continue
            new = self.atoms.new(d)
            segs = []
            for v, var in zip(ins, eqn.invars):
                fs = self.atoms.factors(v.axes[k])
                if len(fs) == 1 and v.kind == ACT:
                    segs.append(fs[0])
                elif var.aval.shape[k] > 0:
                    segs = None
                    break
            if segs is None:
                for v in ins:
                    self.atoms.pin(v.axes[k], self.reason("concatenates along an axis of mixed structure"))
                self.atoms.position[new] = True
            else:
                self.atoms.alias[new] = segs
            out.append([new])
        zero = kind == CONST and all(v.zero for v in ins)
        return [_Val(kind, out, zero=zero)]

    def rule_split(self, eqn, ins):
        v = ins[0]
        axis = jx.param(eqn, "axis")
        outs = []
        for var in eqn.outvars:
            shape = var.aval.shape
            keep = [k != axis for k in range(len(shape))]
            outs.append(self._reslice(eqn, v, keep, shape, "splits an axis"))
        return outs

    def rule_gather(self, eqn, ins):
        op, idx = ins[0], ins[1]
        dn = jx.param(eqn, "dimension_numbers")
        slice_sizes = jx.param(eqn, "slice_sizes")
        in_shape = eqn.invars[0].aval.shape
        out_shape = eqn.outvars[0].aval.shape
        if idx.kind != CONST or dn.operand_batching_dims:
            return self.unknown(eqn, ins)
        # operand axes that survive as slices, in order
        offset_src = [
            k for k in range(len(in_shape)) if k not in dn.collapsed_slice_dims and k not in dn.operand_batching_dims
        ]
        batch_axes = [ax for ax in idx.axes[:-1]]
        out: list[list[int]] = []
        b = o = 0
        for k in range(len(out_shape)):
            if k in dn.offset_dims:
                src = offset_src[o]
                o += 1
                if slice_sizes[src] == in_shape[src]:
                    out.append(list(op.axes[src]))
                    if op.kind == PARAM:
                        self.use(op, op.axes[src], "out")
                else:
                    if op.kind == PARAM:
                        self.mark_other(op, "gathered in part")
                    self.atoms.pin(op.axes[src], self.reason("gathers part of an axis"))
                    out.append([self.atoms.new(out_shape[k], position=True)])
            else:
                ax = batch_axes[b] if b < len(batch_axes) else []
                b += 1
                out.append(list(ax) if self.size(ax) == out_shape[k] else [self.atoms.new(out_shape[k], position=True)])
        for k in dn.start_index_map:
            if op.kind == PARAM:
                # an embedding lookup: rows of the table are edges from one-hot inputs
                for a in self.atoms.factors(op.axes[k]):
                    self.atoms.input[a] = True
                self.use(op, op.axes[k], "in")
            elif op.axes[k]:
                self.atoms.pin(op.axes[k], self.reason("indexes into an axis"))
        return [_Val(ACT if op.kind in (ACT, PARAM) else CONST, out)]

    # -- reductions and pooling ------------------------------------------------
    def _reduce(self, eqn, ins, why):
        v = ins[0]
        axes = set(jx.param(eqn, "axes"))
        self.mark_other(v, "reduced")
        gone = []
        for k in axes:
            if self.size(v.axes[k]) > 1:
                self.atoms.pin(v.axes[k], self.reason(why))
            else:
                gone += v.axes[k]
        kind = v.kind if v.kind != PARAM else CONST
        return [_Val(kind, [ax for k, ax in enumerate(v.axes) if k not in axes], zero=v.zero, scalars=v.scalars + gone)]

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
        return [_Val(CONST, [ax for k, ax in enumerate(v.axes) if k not in axes])]

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
        return [
            dataclasses.replace(self._reslice(eqn, v, keep, out_shape, "pools over the nodes of a group"), kind=kind)
        ]

    rule_reduce_window_sum = rule_reduce_window_max = rule_reduce_window_min = _pool

    # -- linear maps with parameters ------------------------------------------------
    def rule_dot_general(self, eqn, ins):
        lhs, rhs = ins
        (lc, rc), (lb, rb) = jx.param(eqn, "dimension_numbers")
        lfree = [k for k in range(len(lhs.axes)) if k not in lc and k not in lb]
        rfree = [k for k in range(len(rhs.axes)) if k not in rc and k not in rb]
        out = [list(lhs.axes[k]) for k in lb] + [list(lhs.axes[k]) for k in lfree] + [list(rhs.axes[k]) for k in rfree]
        kinds = (lhs.kind, rhs.kind)
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
            for a, b in zip(pb, xb):
                self.atoms.unify(x.axes[b], p.axes[a], self.reason())
                for f in self.atoms.factors(p.axes[a]):
                    self.atoms.position[f] = True
                self.use(p, p.axes[a], "tap")
            for a in pfree:
                self.use(p, p.axes[a], "out")
            return [_Val(ACT, out)]
        if kinds == (CONST, CONST):
            return [_Val(CONST, out)]
        for v in ins:
            self.mark_other(v, "multiplied by a parameter")
        if ACT in kinds:
            if kinds == (ACT, ACT):
                for v in ins:
                    self.pin(v, "product of activations")
            else:
                x, xc = (lhs, lc) if lhs.kind == ACT else (rhs, rc)
                for b in xc:
                    self.atoms.pin(x.axes[b], self.reason("mixes nodes with fixed coefficients"))
            for a, b in zip(lb, rb):
                self.atoms.unify(lhs.axes[a], rhs.axes[b], self.reason())
            return [_Val(ACT, out)]
        return [_Val(CONST, out)]

    def rule_conv_general_dilated(self, eqn, ins):
        lhs, rhs = ins
        dn = jx.param(eqn, "dimension_numbers")
        lspec, rspec, ospec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
        out_shape = eqn.outvars[0].aval.shape
        out = [[] for _ in out_shape]
        out[ospec[0]] = list(lhs.axes[lspec[0]])
        for k in ospec[2:]:
            out[k] = [self.atoms.new(out_shape[k], position=True)]
        grouped = jx.param(eqn, "feature_group_count") != 1 or jx.param(eqn, "batch_group_count") != 1
        if rhs.kind == PARAM and lhs.kind in (ACT, CONST) and not grouped:
            self.atoms.unify(lhs.axes[lspec[1]], rhs.axes[rspec[1]], self.reason())
            self.use(rhs, rhs.axes[rspec[1]], "in")
            if lhs.kind == CONST:
                for f in self.atoms.factors(lhs.axes[lspec[1]]):
                    self.atoms.input[f] = True
            self.use(rhs, rhs.axes[rspec[0]], "out")
            for k in rspec[2:]:
                self.use(rhs, rhs.axes[k], "tap")
                for f in self.atoms.factors(rhs.axes[k]):
                    self.atoms.position[f] = True
            for k in lspec[2:]:
                for f in self.atoms.factors(lhs.axes[k]):
                    self.atoms.position[f] = True
            out[ospec[1]] = list(rhs.axes[rspec[0]])
            return [_Val(ACT, out)]
        if lhs.kind == CONST and rhs.kind == CONST:
            out[ospec[1]] = [self.atoms.new(out_shape[ospec[1]])]
            return [_Val(CONST, out)]
        why = "grouped convolution" if grouped else "convolution without a parameter kernel"
        for v in ins:
            self.mark_other(v, why)
            if v.kind == ACT:
                self.pin(v, why)
        out[ospec[1]] = [self.atoms.new(out_shape[ospec[1]])]
        val = _Val(ACT, out)
        self.pin(val, why)
        return [val]

    # -- control flow ---------------------------------------------------------------
    def _carry_in(self, v: _Val) -> _Val:
        if v.kind == CONST:
            return _Val(ACT, [list(ax) for ax in v.axes]) if v.zero else v
        if v.kind == PARAM:
            self.mark_other(v, "carried through a loop")
            return _Val(CONST, [list(ax) for ax in v.axes])
        return v

    def _tie_carry(self, init: Sequence[_Val], carry_in: Sequence[_Val], carry_out: Sequence[_Val]):
        for i0, ci, co in zip(init, carry_in, carry_out):
            if ci.kind == ACT or co.kind == ACT:
                for a, b in zip(ci.axes, co.axes):
                    self.atoms.unify(a, b, self.reason("loop carry"))
                if i0.kind == CONST and not i0.zero:
                    self.atoms.pin(self.all_atoms(ci), self.reason("loop carry starts from a non-zero constant"))
                if co.kind == PARAM:
                    self.mark_other(co, "carried through a loop")

    def rule_scan(self, eqn, ins):
        sc = jx.scan(eqn)
        nc, nk = sc.num_consts, sc.num_carry
        consts, init, xs = ins[:nc], ins[nc : nc + nk], ins[nc + nk :]
        carry = [self._carry_in(v) for v in init]
        body_xs = []
        for v in xs:
            if v.axes:
                for f in self.atoms.factors(v.axes[0]):
                    self.atoms.position[f] = True
            if v.kind == PARAM:
                self.mark_other(v, "sliced by a scan")
                body_xs.append(_Val(CONST, [list(ax) for ax in v.axes[1:]]))
            else:
                body_xs.append(dataclasses.replace(v, axes=[list(ax) for ax in v.axes[1:]]))
        outs = self.run_closed(sc.body, list(consts) + carry + body_xs)
        self._tie_carry(init, carry, outs[:nk])
        time = [self.atoms.new(sc.length, position=True)]
        ys = [
            dataclasses.replace(v, axes=[list(time)] + v.axes, kind=v.kind if v.kind != PARAM else CONST)
            for v in outs[nk:]
        ]
        return carry + ys

    def rule_while(self, eqn, ins):
        w = jx.while_loop(eqn)
        cn, bn = w.cond_nconsts, w.body_nconsts
        bconsts, init = ins[cn : cn + bn], ins[cn + bn :]
        carry = [self._carry_in(v) for v in init]
        outs = self.run_closed(w.body, list(bconsts) + carry)
        self._tie_carry(init, carry, outs)
        return carry

    def rule_cond(self, eqn, ins):
        ops = ins[1:]
        results = [self.run_closed(br, ops) for br in jx.cond_branches(eqn)]
        outs = []
        for vals in zip(*results):
            acts = [v for v in vals if v.kind == ACT]
            if not acts:
                outs.append(_Val(CONST, [list(a) for a in vals[0].axes]))
                continue
            for v in acts[1:]:
                for a, b in zip(acts[0].axes, v.axes):
                    self.atoms.unify(a, b, self.reason("branches of cond"))
            outs.append(acts[0])
        return outs


# ---------------------------------------------------------------------------
# Building the PathSpace.
# ---------------------------------------------------------------------------


def _check_params(params) -> tuple[list[Any], Any, list[str]]:
    leaves, treedef = jax.tree_util.tree_flatten(params)
    paths = leaf_path_strings(params)
    if not leaves:
        raise TypeError("params has no array leaves: pass the parameter pytree (e.g. variables['params']).")
    for path, leaf in zip(paths, leaves):
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            raise TypeError(
                f"params leaf {path!r} is a {type(leaf).__name__}, not an array: params must be a pytree of "
                "arrays (for Flax linen pass variables['params']; for nnx pass the nnx.State of nnx.Param)."
            )
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            raise TypeError(
                f"params leaf {path!r} has dtype {leaf.dtype}; parameters must be floating point arrays "
                "(move integer or boolean state out of the params pytree)."
            )
    return leaves, treedef, paths


def trace(fn: Callable[..., Any], params, *args, strict: bool = False, skeleton: str = "index", **kwargs) -> PathSpace:
    """Find the reduction graph of the ReLU part of ``fn``.

    ``fn(params, *args, **kwargs)`` must return the network's outputs (an array or
    a pytree of arrays). The structure is read off ``jax.make_jaxpr(fn)`` by
    abstract interpretation (see the module docstring): parameter names, module
    names and leaf order are never used, so linen, nnx and plain JAX functions
    all work the same way.

    Node groups that meet an operation that is not positively homogeneous per node
    (tanh, softmax, normalisation, gating products, an unknown primitive) are
    *pinned*: treated as boundary nodes and never rescaled. `describe` lists them.

    Args:
      fn: the forward function, ``fn(params, *args, **kwargs) -> outputs``.
      params: pytree of floating point arrays (or ``jax.ShapeDtypeStruct``).
      *args: example inputs (arrays or ``ShapeDtypeStruct``); only shapes and
        dtypes are used. Integer inputs are token ids (an embedding lookup).
      strict: raise `UnsupportedModelError` instead of pinning, naming the
        primitive, the source line and the parameter paths involved.
      skeleton: how the skeleton (the basis paths of `to_coords` and G-SGD) is
        chosen. ``"index"`` (default): from the graph alone (the ``j mod n``
        pattern), so the space describes structure only and serves any params of
        that structure (an ensemble, a checkpoint, another seed). ``"values"``
        (opt-in): per node, the incoming and outgoing edge of the largest path value
        in *these* ``params`` (`pathspace_jax.skeleton.choose_by_value`; the same for
        every rescaling of them), which ties the chart to them: use it only with
        these params and their descendants. It falls back to ``"index"`` when
        ``params`` are abstract (``ShapeDtypeStruct``, tracers).
      **kwargs: static keyword arguments bound into ``fn`` (e.g. ``train=False``).

    Returns:
      A `PathSpace` (frozen, hashable, holds no JAX arrays).

    Example:
      >>> dense = flax.linen.Dense(3)
      >>> p = dense.init(key, x)["params"]
      >>> s = pj.trace(lambda p, x: dense.apply({"params": p}, x), p, x)
      >>> s.num_hidden  # one layer: no hidden node
      0

    References:
      Meng et al., "G-SGD: Optimizing ReLU neural networks in its positively
      scale-invariant space", ICLR 2019; "Path Space for Recurrent Neural Networks with ReLU
      Activations" (the reduction graph).
    """
    if skeleton not in ("values", "index"):
        raise ValueError(f"skeleton must be 'values' or 'index', got {skeleton!r}")
    leaves, treedef, paths = _check_params(params)
    bound = functools.partial(fn, **kwargs) if kwargs else fn
    arg_specs = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a)), args)
    space = _run_trace(bound, leaves, treedef, paths, arg_specs, strict)[0]
    concrete = all(
        isinstance(x, (np.ndarray, np.generic)) or (isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer))
        for x in leaves
    )
    if skeleton == "values" and concrete:
        space = dataclasses.replace(space, skeleton_edges=choose_by_value(space, leaves))
    return space


def _run_trace(bound, leaves, treedef, paths, arg_specs, strict):
    param_specs = [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in leaves]
    try:
        closed = jax.make_jaxpr(lambda ps, a: bound(jax.tree_util.tree_unflatten(treedef, ps), *a))(
            param_specs, arg_specs
        )
    except Exception as e:
        shapes = jax.tree_util.tree_map(lambda s: f"{s.dtype}{list(s.shape)}", arg_specs)
        raise ValueError(
            f"fn(params, *args) could not be traced with args of shapes {shapes}: {type(e).__name__}: {e}"
        ) from e
    interp = _interpret(closed, param_specs, jax.tree_util.tree_leaves(arg_specs), paths)
    return _build(interp, treedef, leaves, paths, bound, arg_specs, strict), closed, interp


def _interpret(closed, param_specs, input_specs, paths) -> _Interpreter:
    """Run the abstract interpreter on ``closed``, a jaxpr of ``(param leaves, input leaves)``."""
    interp = _Interpreter(paths)
    n_leaves = len(param_specs)
    in_vals: list[_Val] = []
    for i, leaf in enumerate(param_specs):
        axes = interp.fresh(leaf.shape)
        interp.leaf_axes.append(axes)
        in_vals.append(_Val(PARAM, axes, leaf=i))
    for a in input_specs:
        if jnp.issubdtype(a.dtype, jnp.floating):
            in_vals.append(_Val(ACT, interp.fresh(a.shape, input=True)))
        else:
            is_key = jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)
            in_vals.append(_Val(CONST, interp.fresh(a.shape, input=True), random=is_key))
    interp.sites[("in",)] = [interp.all_atoms(v) if v.kind == ACT else None for v in in_vals[n_leaves:]]
    consts = [interp.const_val(c) for c in closed.consts]
    outs = interp.run(closed.jaxpr, consts, in_vals)
    interp.eqn = None
    for v in outs:
        if v.kind == ACT:
            for a in _resolve_alias_roots(interp.atoms, interp.all_atoms(v)):
                interp.atoms.output[a] = True
    if not any(interp.uses[i] or interp.other[i] for i in range(n_leaves)):
        raise ValueError(
            "fn does not use params: its outputs do not depend on any parameter leaf. trace(fn, params, *args) "
            "expects fn(params, *args) to compute the network's outputs from params."
        )
    unused = [paths[i] for i in range(n_leaves) if not interp.uses[i] and not interp.other[i]]
    if unused:
        raise ValueError(
            f"params leaves {unused} are not used by fn: remove them from the params pytree passed to trace "
            "(or make fn use them)."
        )
    return interp


def boundary_sites(closed, n_params: int, paths: Sequence[str]) -> dict[tuple, tuple[bool, ...]]:
    """Which values of ``closed`` lie in a node group that is not positively homogeneous.

    ``closed`` is a jaxpr of ``(param leaves..., input leaves...)`` (as `pathspace_jax.squared` makes
    it). The interpreter is run on it, and for every equation (keyed by the chain of equation indices
    through calls and loop bodies; the inputs under ``("in",)``) each output gets a flag: True where the
    value's node axis belongs to a pinned group, or to an output group that meets an operation that is
    not positively homogeneous (a tanh head). Path-SGD and DDP-SGD treat those nodes as boundaries.
    """
    avals = jx.in_avals(closed)
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
    interp = _interpret(closed, specs[:n_params], specs[n_params:], paths)
    treedef = jax.tree_util.tree_structure(list(range(n_params)))
    _build(interp, treedef, specs[:n_params], list(paths), None, tuple(specs[n_params:]), False)
    atoms, roots = interp.atoms, interp.pinned_roots

    def flag(al) -> bool:
        return al is not None and any(atoms.find(r) in roots for r in _resolve_alias_roots(atoms, al))

    return {k: tuple(flag(a) for a in v) for k, v in interp.sites.items()}


def _resolve_alias_roots(atoms: _Atoms, xs: Sequence[int]) -> list[int]:
    out = []
    for r in atoms.factors(xs):
        if atoms.alias[r] is not None:
            out.extend(_resolve_alias_roots(atoms, atoms.alias[r]))
        else:
            out.append(r)
    return out


def _build(interp: _Interpreter, treedef, leaves, paths, fn, arg_specs, strict) -> PathSpace:
    atoms = interp.atoms
    find = atoms.find

    # 1. the role of every factor of every leaf. Roles are kept per atom id (not
    # per root): a recurrent kernel's two axes share a root but not an id.
    def expand_roles(a: int, role: str | None, roles: dict[int, str]) -> list[tuple[int, str | None]]:
        role = roles.get(a, role)
        r = find(a)
        if atoms.expand[r] is None:
            return [(r, role)]
        return [x for c in atoms.expand[r] for x in expand_roles(c, role, roles)]

    leaf_info = []  # (kind, factors, node_in, node_out, note, first_step)
    for i in range(len(leaves)):
        note = "; ".join(dict.fromkeys(interp.other[i]))
        roles: dict[int, str] = {}
        for a, role, _ in interp.uses[i]:
            if roles.get(a, role) != role:
                note = note or f"one axis used with two roles ({roles[a]} and {role})"
            roles[a] = role
        first_step = min((s for _, _, s in interp.uses[i]), default=0)
        factors = [f for ax in interp.leaf_axes[i] for a in ax for f in expand_roles(a, None, roles)]
        kind = "other"
        if not note and any(role is None for _, role in factors):
            note = "some axes are neither contracted nor produced by an edge"
        if not note:
            # positions of the factors that are nodes (the others are taps)
            node_in = [k for k, (r, role) in enumerate(factors) if role == "in" and not atoms.position[r]]
            node_out = [k for k, (r, role) in enumerate(factors) if role == "out" and not atoms.position[r]]
            kind = "weight" if node_in else "bias"
            if not node_out:
                note = "no output node axis"
            elif any(atoms.alias[factors[k][0]] is not None for k in node_out):
                note = "its output axis is a concatenation"
        roots = [r for r, _ in factors]
        if note:
            atoms.pin(roots, f"{paths[i]} is not an edge tensor ({note})")
            leaf_info.append(("other", roots, None, None, note, first_step))
        else:
            leaf_info.append((kind, roots, node_in, node_out, "", first_step))

    # 2. node groups: keys are tuples of atom roots (aliases resolved)
    group_order: dict[tuple[int, ...], float] = {}
    fed: set[tuple[int, ...]] = set()  # groups that some edge enters

    def add_key(key: tuple[int, ...], step: float, entered: bool):
        if len(key) == 1 and atoms.alias[key[0]] is not None:
            for t in _resolve_alias_roots(atoms, [key[0]]):
                add_key((t,), step, entered)
            return
        canon = tuple(sorted(key))
        group_order[canon] = min(group_order.get(canon, np.inf), step)
        if entered:
            fed.add(canon)

    for kind, factors, node_in, node_out, _, step in leaf_info:
        if kind == "other":
            continue
        if node_in:
            add_key(tuple(factors[k] for k in node_in), step - 0.5, False)
        add_key(tuple(factors[k] for k in node_out), step, True)
    # a root in two different keys cannot be rescaled consistently
    seen: dict[int, tuple[int, ...]] = {}
    for key in group_order:
        for r in key:
            if r in seen:
                atoms.pin(list(key) + list(seen[r]), "one axis belongs to node groups of different shapes")
            seen[r] = key

    keys = sorted(group_order, key=lambda k: (group_order[k], k))
    groups: list[NodeGroup] = []
    key_index: dict[tuple[int, ...], int] = {}
    offset = 1  # node 0 is the bias node
    for gi, key in enumerate(keys):
        size = int(np.prod([atoms.size[r] for r in key]))
        reasons = tuple(dict.fromkeys(x for r in key for x in atoms.reasons[r]))
        if len(key) > 1:
            reasons = reasons + ("node group spans several array axes",)
        if key not in fed and not any(atoms.input[r] or atoms.output[r] for r in key):
            # rescaling nodes that no parameter enters would change the function (e.g. a unit channel axis
            # made by a reshape of a hidden layer's output, whose own kernel then has no node axis)
            reasons = reasons + ("no parameter edge enters these nodes (a node axis created by a reshape?)",)
        if any(atoms.input[r] for r in key):
            kind = "input"
        elif any(atoms.output[r] for r in key):
            kind = "output"
        elif reasons:
            kind = "pinned"
        else:
            kind = "hidden"
        groups.append(NodeGroup(f"g{gi}", size, kind, offset, reasons if kind != "input" else ()))
        key_index[key] = gi
        offset += size
    interp.pinned_roots = {r for key, gi in key_index.items() if groups[gi].reasons and groups[gi].kind != "input"
                           for r in key}  # fmt: skip
    num_nodes = offset
    offsets = np.array([g.offset for g in groups])

    def node_ids(root: int) -> np.ndarray:
        """Global node ids of the nodes along one (single-atom) group axis."""
        if atoms.alias[root] is not None:
            return np.concatenate([node_ids(t) for t in atoms.factors(atoms.alias[root])])
        g = groups[key_index[(root,)]]
        return g.offset + np.arange(g.size)

    # 3. per-entry source and destination nodes
    edge_leaves = []
    for i, (leaf, (kind, factors, node_in, node_out, note, _)) in enumerate(zip(leaves, leaf_info)):
        shape = tuple(int(d) for d in leaf.shape)
        if kind == "other":
            neg = np.full(shape, -1, np.int32)
            neg.setflags(write=False)
            edge_leaves.append(EdgeLeaf(paths[i], shape, str(leaf.dtype), "other", (), (), neg, neg, note))
            continue
        sizes = [atoms.size[r] for r in factors]

        def side(nodes: list[int], shape=shape, factors=factors, sizes=sizes) -> tuple[np.ndarray, tuple[int, ...]]:
            """Global node of every entry on one side of the edge; nodes = positions of node factors."""

            def grid(k: int) -> np.ndarray:
                return np.arange(sizes[k]).reshape([-1 if j == k else 1 for j in range(len(sizes))])

            if not nodes:
                return np.full(shape, BIAS_NODE, np.int32), ()
            if len(nodes) == 1:
                ids = node_ids(factors[nodes[0]])
                full = np.broadcast_to(ids[grid(nodes[0])], sizes).reshape(shape)
                gidx = np.searchsorted(offsets, np.unique(ids), side="right") - 1
                return full.astype(np.int32), tuple(sorted(set(gidx.tolist())))
            order = sorted(nodes, key=lambda k: factors[k])
            g = key_index[tuple(factors[k] for k in order)]
            local = np.zeros([1] * len(sizes), np.int64)
            for k in order:
                local = local * sizes[k] + grid(k)
            full = np.broadcast_to(groups[g].offset + local, sizes).reshape(shape)
            return full.astype(np.int32), (g,)

        src, sg = side(node_in)
        dst, dg = side(node_out)
        src.setflags(write=False)
        dst.setflags(write=False)
        edge_leaves.append(EdgeLeaf(paths[i], shape, str(leaf.dtype), kind, sg, dg, src, dst))

    space = PathSpace(treedef, tuple(edge_leaves), tuple(groups), num_nodes, fn, arg_specs)
    if strict:
        _check_strict(space)
    return space


def _check_strict(space: PathSpace) -> None:
    problems = []
    for gi, g in enumerate(space.groups):
        if g.kind == "pinned":
            near = [leaf.path for leaf in space.leaves if gi in leaf.src_groups or gi in leaf.dst_groups]
            problems.append(f"node group {g.name} (size {g.size}, parameters {near}): " + "; ".join(g.reasons))
    for leaf in space.leaves:
        if leaf.kind == "other":
            problems.append(f"parameter {leaf.path} is not an edge of the homogeneous part: {leaf.note}")
    if problems:
        raise UnsupportedModelError(
            "the model is not positively homogeneous everywhere (strict=True):\n  - "
            + "\n  - ".join(problems)
            + "\nUse strict=False to pin these node groups (treat them as boundary nodes) instead."
        )
