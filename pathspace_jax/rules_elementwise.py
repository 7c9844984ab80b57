"""The tracing rules of elementwise primitives: the families (`relabel`, `nonlinear`, `degree0`, `compare`,
`source`, `unknown`), sums, products, quotients, maxima, selections."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from pathspace_jax import idioms, ir, pieces, rewrites
from pathspace_jax.atoms import ACT, CONST, PARAM, Val
from pathspace_jax.graph import FROZEN

if TYPE_CHECKING:
    from pathspace_jax.tracer import Walker


def relabel(w: Walker, eqn, ins) -> list[Val]:
    """Each output is its operand, same entries and axes (a dtype conversion, a copy, ``neg``)."""
    return [dataclasses.replace(v) for v in ins[: len(eqn.outvars)]]


def source(w: Walker, eqn, ins) -> list[Val]:
    """Fresh constants whose operands do not matter (``iota``; a random draw: a value of the inputs alone)."""
    return [Val(CONST, w.fresh(v.aval.shape)) for v in eqn.outvars]


def unknown(w: Walker, eqn, ins) -> list[Val]:
    """A primitive with no rule: the activations it touches are pinned, and parameters it reads are no edges."""
    why = "not known to be positively homogeneous"
    for v in ins:
        if v.kind == ACT:
            w.pin(v, why)
        w.mark_other(v, why)
    kind = ACT if any(v.kind == ACT for v in ins) else CONST
    outs = []
    for var in eqn.outvars:
        axes = w.fresh(getattr(var.aval, "shape", ()))
        val = Val(kind, axes)
        if kind == ACT:
            w.pin(val, why)
        outs.append(val)
    return outs


def nonlinear(w: Walker, eqn, ins) -> list[Val]:
    """Not positively homogeneous (``tanh``, ``exp``): the activations it reads are pinned."""
    for v in ins:
        if v.kind == ACT:
            w.pin(v, "nonlinear, not positively homogeneous")
        w.mark_other(v, "used in a nonlinear function")
    kind = ACT if any(v.kind == ACT for v in ins) else CONST
    return [w.ew(kind, ins, w.broadcast(eqn, ins, unify=False))]


def degree0(w: Walker, eqn, ins) -> list[Val]:
    """Its output does not scale with its operands (``sign``): a constant of the structure."""
    for v in ins:
        w.mark_other(v, "compared")
    return [w.ew(CONST, ins, w.broadcast(eqn, ins, unify=False))]


def compare(w: Walker, eqn, ins) -> list[Val]:
    """As `degree0`; comparing an activation with a non-zero constant pins it, and compared activations are tied."""
    acts = [v for v in ins if v.kind == ACT]
    if not acts:
        return degree0(w, eqn, ins)
    for v in ins:
        w.mark_other(v, "compared")
    if any(not c.zero for c in ins if c.kind == CONST):
        for v in acts:
            w.pin(v, "compared with a non-zero constant")
    return [w.ew(CONST, ins, w.broadcast(eqn, ins, unify=len(acts) > 1))]


def rule_stop_gradient(w: Walker, eqn, ins):
    """The same values: an activation goes on as it is (``relu(h) * stop_gradient(h)`` is a product of
    activations, not a ReLU layer). A fully pinned value (spectral normalisation's power iteration vectors, which
    its σ(W) reads as constants) or one without activations is a constant of the structure: a parameter behind it
    is held fixed (a frozen layer), no edge."""
    if ins[0].kind == ACT and not w.fully_pinned(ins[0]):
        return [dataclasses.replace(ins[0])]
    w.mark_other(ins[0], FROZEN)
    return [w.ew(CONST, ins, w.broadcast(eqn, ins, unify=False))]


def rule_add(w: Walker, eqn, ins):
    if any(v.pieces is not None for v in ins):  # a kernel's output cut in pieces (`kernel_pieces`)
        if (biased := pieces.bias_of_pieces(w, ins)) is not None:
            return [biased]
        why = "adds to a kernel's output cut into pieces something other than its bias"
        for v in ins:
            if v.kind == PARAM:
                w.mark_other(v, why)
            else:
                w.pin(v, why)
        out = Val(ACT, w.fresh(eqn.outvars[0].aval.shape))
        w.pin(out, why)
        return [out]
    acts = [v for v in ins if v.kind == ACT]
    params = [v for v in ins if v.kind == PARAM]
    consts = [v for v in ins if v.kind == CONST]
    if not acts:
        if params:
            for v in params:
                w.mark_other(v, "combined with another parameter or constant")
            return [w.ew(CONST, ins, w.broadcast(eqn, ins, unify=False))]
        return [w.ew(CONST, ins, w.broadcast(eqn, ins, unify=False), zero=all(c.zero for c in consts))]
    axes = w.broadcast(eqn, acts + params, unify=True)  # activations first: they name the output
    for v in params:
        if not w.all_atoms(v):  # one number added to every unit: no edge (the units pinned below)
            w.mark_other(v, "a single number added to a layer's units")
        w.use(v, w.all_atoms(v), "out")
    shape = eqn.outvars[0].aval.shape
    for v in acts + params:  # a bias shared along the units of a layer (a token-mixing layer's, along channels)
        for k, d in enumerate(shape):
            if d > 1 and (len(v.axes) != len(shape) or w.size(v.axes[k]) == 1 or w.copies & set(v.axes[k])):
                what = "a parameter" if v.kind == PARAM else "an activation"
                why = f"adds {what} whose value is the same at every unit of a layer: they cannot rescale apart"
                w.copied_into.append((axes[k], w.reason(why)))
    if any(not c.zero for c in consts):
        for v in acts:
            w.pin(v, "adds a constant offset")
    return [w.ew(ACT, ins, axes)]


def rule_mul(w: Walker, eqn, ins):
    if (held := idioms.kernel_scale(w, eqn, ins, divide=False)) is not None:
        return [held]
    if any(v.factors is not None for v in ins) and (scaled := idioms.normalised_scale(w, eqn, ins)):
        return scaled
    acts = [v for v in ins if v.kind == ACT]
    params = [v for v in ins if v.kind == PARAM]
    consts = [v for v in ins if v.kind == CONST]
    if len(acts) == 1 and len(params) == 1:
        if all(w.size(ax) == 1 for ax in params[0].axes):
            # a learned scalar (PReLU's slope, a gain): a coefficient of every unit alike, so x's units keep
            # their rescaling (and the scalar's gradient is invariant under it); the |w|^p network takes it raised
            w.mark_other(params[0], "a learned scalar coefficient (PReLU's slope, a gain)")
            out = w.ew(ACT, ins, w.broadcast(eqn, ins, unify=False))
            return w.record(eqn, ins, [out], coefficient=True)
        if (
            w.fully_pinned(acts[0])
            and not params[0].scaled
            and w.matched(rewrites.READ_ONCE_BY_A_PRODUCT, eqn.outvars[0])
        ):
            return [w.ew(ACT, ins, w.broadcast(eqn, ins, unify=False), factors=(acts[0], params[0]))]
        if scaled := per_unit_scale(w, eqn, ins, *acts, *params):
            return scaled
    if len(acts) == 2 and (gate := gated(w, eqn, *acts)):
        return [gate]
    if len(acts) > 1:
        for v in acts:
            w.pin(v, "product of activations")
    if acts and params:
        for v in params:
            w.mark_other(v, "elementwise product of a parameter and an activation")
        for v in acts:
            w.pin(v, "elementwise product with a parameter")
    if acts:
        out = w.ew(ACT, ins, w.broadcast(eqn, acts + params + consts, unify=len(acts) > 1))
        if not params and all(map(w.fully_pinned, acts)):  # (a top-k router's weights spread by a one-hot)
            w.pin(out, "a product of pinned values and constants")
        return [out]
    if len(params) == 1 and not any(c.from_params for c in consts):
        # a parameter times a fixed coefficient is still a view of that parameter
        axes = w.broadcast(eqn, params + consts, unify=False)
        return [w.ew(PARAM, ins, axes, leaf=params[0].leaf, scaled=params[0].scaled or bool(consts))]
    if params:
        for v in params:
            w.mark_other(v, "product of parameters")
        return [w.ew(CONST, ins, w.broadcast(eqn, ins, unify=False))]
    return [w.ew(CONST, ins, w.broadcast(eqn, ins, unify=False), zero=any(c.zero for c in consts))]


def gated(w: Walker, eqn, a: Val, b: Val) -> Val | None:
    """``g * x`` with ``g`` fully pinned and ``x`` an activation that is not, of the result's shape (a gate:
    SwiGLU's ``swish(x W) * (x V)``, a sigmoid gate on a ReLU layer): g's entries are coefficients that no
    rescaling changes, so x's units go on, and the result scales with them. None otherwise."""
    shape, pinned_a = eqn.outvars[0].aval.shape, w.fully_pinned(a)
    if pinned_a == w.fully_pinned(b):
        return None
    x, g = (b, a) if pinned_a else (a, b)
    if len(x.axes) != len(shape) or any(w.size(ax) != d for ax, d in zip(x.axes, shape, strict=True)):
        return None  # x broadcast along an axis of g: its unit would feed g's pinned ones
    return w.ew(ACT, [x, g], w.broadcast(eqn, [x, g], unify=False))


def per_unit_scale(w: Walker, eqn, ins, x: Val, p: Val, as_=None) -> ir.Recorded | None:
    """``x * p`` with ``p`` a parameter that varies along some of ``x``'s axes only (a learned per-unit scale:
    LayerScale, a gain after a ReLU, a normalisation's scale): a diagonal edge, entry c from node c of x's
    group (pinned or not) to node c of a group of its own (`diagonal_ends`), the other axes broadcast. None
    (the product pins, as before) where p varies along no axis (a scalar is a coefficient: `rule_mul`), or p
    is combined with fixed coefficients (BatchNorm's scale over its running deviation: the running mean it
    subtracts breaks the symmetry, although it is 0 at initialisation)."""
    shape = eqn.outvars[0].aval.shape
    if p.scaled or len(p.axes) != len(shape) or len(x.axes) != len(shape):
        return None
    own = {f for ax in w.leaf_axes[p.leaf] for f in w.atoms.factors(ax)}
    out, diagonal = [], False
    for k, d in enumerate(shape):
        full = w.size(p.axes[k]) == d == w.size(x.axes[k])  # x not broadcast along it
        if d > 1 and full and set(w.atoms.factors(p.axes[k])) <= own:
            w.atoms.unify(x.axes[k], p.axes[k], w.reason())
            out.append(w.diagonal_ends(p, p.axes[k]))
            w.scales.add((p.leaf, tuple(p.axes[k])))
            diagonal = True
        else:
            out.append(list(x.axes[k]))
    if not diagonal:
        return None
    return w.record(eqn, ins, [w.ew(ACT, ins, out)], as_=as_, edge=True)


def rule_div(w: Walker, eqn, ins):
    if (held := idioms.kernel_scale(w, eqn, ins, divide=True)) is not None:
        return [held]
    ins = idioms.unscaled(w, ins)
    num, den = ins
    if den.kind == CONST and (num.kind == ACT or num.kind == PARAM and not den.from_params):
        if num.kind == PARAM:
            return [w.ew(PARAM, ins, w.broadcast(eqn, [num, den], unify=False), leaf=num.leaf, scaled=True)]
        return [w.ew(ACT, ins, w.broadcast(eqn, [num, den], unify=False))]
    if num.kind == CONST and den.kind == CONST:
        return [w.ew(CONST, ins, w.broadcast(eqn, ins, unify=False), zero=num.zero)]
    return nonlinear(w, eqn, ins)


def rule_max(w: Walker, eqn, ins):
    acts = [v for v in ins if v.kind == ACT]
    if not acts:
        return nonlinear(w, eqn, ins)
    for v in ins:
        if v.kind == PARAM:
            w.mark_other(v, "max with a parameter")
        if v.kind == CONST and not v.zero:
            for a in acts:
                w.pin(a, "max/min with a non-zero constant")
    return [w.ew(ACT, ins, w.broadcast(eqn, acts + [v for v in ins if v.kind != ACT], unify=len(acts) > 1))]


def rule_abs(w: Walker, eqn, ins):
    (v,) = ins
    if v.kind == ACT:
        return [Val(ACT, [list(a) for a in v.axes])]
    return nonlinear(w, eqn, ins)


def rule_select_n(w: Walker, eqn, ins):
    pred, cases = ins[0], ins[1:]
    acts = [v for v in cases if v.kind == ACT]
    if pred.kind == ACT:
        w.pin(pred, "selects on an activation")
    if not acts:
        for v in cases:
            w.mark_other(v, "selected")
        return [w.ew(CONST, ins, w.broadcast(eqn, ins, unify=False), zero=all(v.zero for v in cases))]
    for v in cases:
        w.mark_other(v, "selected")
        if v.kind == CONST and not v.zero:
            for a in acts:
                w.pin(a, "selects a non-zero constant")
    return [w.ew(ACT, ins, w.broadcast(eqn, acts + [pred] + cases, unify=len(acts) > 1))]
