"""Idioms the walker reads whole: weight normalisation's kernel ``c * p`` (`kernel_scale`, `scaled_kernel`) and a
normalisation's scale folded into its reciprocal (`normalised_scale`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from pathspace_jax import ir, rewrites, rules_elementwise, rules_shape
from pathspace_jax import jaxpr as jx
from pathspace_jax.atoms import ACT, CONST, PARAM, Val

if TYPE_CHECKING:
    from pathspace_jax.tracer import Walker


def reshaped_kernel(w: Walker, eqn, entry, ins: Sequence[Val]) -> Val | None:
    """A kernel held by `kernel_scale` cast (a relabelling, `Rule.structure`) or broadcast: both factors are (each
    recorded), or, broadcast where a factor does not have the kernel's shape, the kernel is no longer held
    (`unscaled`). None where ``eqn`` is neither or its operand holds no kernel."""
    broadcast = entry.trace is rules_shape.rule_broadcast_in_dim
    if not ins or ins[0].factors is None or ins[0].kind != CONST or not (broadcast or entry.structure == "relabel"):
        return None
    v, shape = ins[0], eqn.invars[0].aval.shape
    if broadcast and any(tuple(map(w.size, f.axes)) != shape for f in v.factors):
        (v,) = unscaled(w, [v])
        return w.apply(eqn, [v])[0]
    c, p = (w.record(eqn, [f], w.apply(eqn, [f]))[0] for f in v.factors)
    return dataclasses.replace(w.apply(eqn, [dataclasses.replace(v, factors=None)])[0], factors=(c, p))


def normalised_scale(w: Walker, eqn, ins) -> ir.Recorded | None:
    """``n * (s * p)`` with ``n`` and ``s`` fully pinned and ``p`` a per-unit parameter (`Val.factors`): a
    LayerNorm's or BatchNorm's scale, which flax multiplies into the per-example ``rsqrt(var + eps)`` before
    the centred value. Recorded as ``(n * s) * p``: a diagonal edge from the normalised value's (pinned) group
    into a group of its own (`per_unit_scale`), whose units the scale, the offset added next and the weights
    reading them rescale. None where that does not apply: the parameter is then not an edge."""
    shape = eqn.outvars[0].aval.shape
    (r, n), pending = sorted(ins, key=lambda v: v.factors is None), [v for v in ins if v.factors is not None]
    if len(pending) == 1 and n.kind == ACT and w.fully_pinned(n):
        s, p = r.factors
        xs = w.broadcast(eqn, [n, s], unify=False)
        if all(w.size(ax) == d for ax, d in zip(xs, shape, strict=True)):
            (x,) = w.record(eqn, [n, s], [w.ew(ACT, [n, s], xs)])
            if scaled := rules_elementwise.per_unit_scale(w, eqn, [x, p], x, p):
                return scaled
    for v in pending:
        w.mark_other(v.factors[1], "elementwise product of a parameter and an activation")
    return None


def kernel_scale(w: Walker, eqn, ins: Sequence[Val], *, divide: bool) -> Val | None:
    """A kernel ``c * p`` in the making: ``c`` coefficients computed from parameters and ``p`` a parameter that
    varies along some of c's axes only, the product read once, as the kernel of a ``dot_general`` or a
    convolution (`pathspace_jax.rewrites.READ_AS_A_KERNEL`). Held as its factors (`Val.factors`) for
    `scaled_kernel`, in any order the product is written: Flax's ``v / ‖v‖ * g`` (``nn.WeightNorm``) and
    ``g * (v / ‖v‖)``; ``g * v / ‖v‖`` (``c`` is then ``v``, and ``v / ‖v‖`` once divided); PyTorch's
    ``v * (g / ‖v‖)`` (``g / ‖v‖`` is ``(1 / ‖v‖) * g``). A held product times or over further coefficients
    holds their product or quotient (recorded: the program computes ``c`` itself). ``divide``: ``eqn`` is a
    quotient (else a product). None otherwise."""
    shape = eqn.outvars[0].aval.shape
    if len(ins) != 2 or any(v.kind == ACT for v in ins):
        return None
    if not w.matched(rewrites.READ_AS_A_KERNEL, eqn.outvars[0]):
        return None
    held = [v for v in ins if v.factors is not None]
    if held:  # (c·p)·x = (c·x)·p, (c·p)/x = (c/x)·p; (c·q)·g with q no gain and g one: (c·q)·g (v / ‖v‖ * g)
        if len(held) != 1 or divide and ins[1] is held[0]:
            return None
        (c, p), x = held[0].factors, ins[1 - ins.index(held[0])]
        if not divide and not gain(w, p, shape) and x.kind == PARAM and gain(w, x, shape):
            p, x = x, p
        if not gain(w, p, shape, broadcast=False):
            return None
        if x.kind == PARAM:  # (v·(g/‖v‖), v/‖v‖·g: v combined with the coefficients)
            w.mark_other(x, "combined with a per-unit gain into a kernel's coefficients")
        operands = [c, x]
        c = w.ew(CONST, operands, w.broadcast(eqn, operands, unify=False), from_params=True)
        (c,) = w.record(eqn, operands, [c])
        return w.ew(CONST, ins, w.broadcast(eqn, ins, unify=False), from_params=True, factors=(c, p))
    if divide:  # g / x = (1 / x)·g, g a gain if a product makes it one (`gain` there)
        p, x = ins
        if p.kind != PARAM or x.kind != CONST or not x.from_params or not gain(w, p, shape, broadcast=False):
            return None
        one = Val(CONST, w.fresh(shape), id=("lit", np.ones(shape, eqn.outvars[0].aval.dtype)))
        c = w.ew(CONST, [x], w.broadcast(eqn, [x], unify=False), from_params=True)
        (c,) = w.record(eqn, [one, x], [c])
        return w.ew(CONST, ins, w.broadcast(eqn, ins, unify=False), from_params=True, factors=(c, p))
    for p, c in (ins, ins[::-1]):
        full = len(c.axes) == len(shape) and all(w.size(ax) == d for ax, d in zip(c.axes, shape, strict=True))
        coefficients = c.kind == CONST and c.from_params or c.kind == PARAM
        if p.kind == PARAM and coefficients and full and gain(w, p, shape):
            if c.kind == PARAM:  # g·v: v is coefficients once divided by its norm (`scaled_kernel` checks)
                w.mark_other(c, "combined with a per-unit gain into a kernel's coefficients")
            return w.ew(CONST, ins, w.broadcast(eqn, ins, unify=False), from_params=True, factors=(c, p))
    return None


def gain(w: Walker, p: Val, shape, *, broadcast: bool = True) -> bool:
    """Whether the parameter ``p`` varies along some axes of ``shape`` only (with ``broadcast``: not along one
    of more than one entry at least), each one of its own leaf's: a gain per output unit of a kernel of that
    shape (`kernel_scale`)."""
    if p.kind != PARAM or p.scaled or len(p.axes) != len(shape):
        return False
    own = {f for ax in w.leaf_axes[p.leaf] for f in w.atoms.factors(ax)}
    varying = [k for k, ax in enumerate(p.axes) if w.size(ax) > 1]
    if broadcast and not any(w.size(ax) == 1 < d for ax, d in zip(p.axes, shape, strict=True)):
        return False
    return bool(varying) and all(w.size(p.axes[k]) == shape[k] and set(w.atoms.factors(p.axes[k])) <= own
                                 for k in varying)  # fmt: skip


def scaled_kernel(w: Walker, eqn, ins: Sequence[Val], *, conv: bool) -> ir.Recorded | None:
    """A ``dot_general`` or convolution of an activation ``x`` with a kernel ``c * p`` held by `kernel_scale`,
    where p varies along output axes only: ``x·(c * p) = (x·c) * p``, recorded so. ``x·c`` is a product with
    fixed coefficients (new nodes, pinned: rescaling a unit that c reads changes ‖v‖), and p a learned per-unit
    scale of its result (`per_unit_scale`): a diagonal edge into units of their own, which p, a bias added next
    and the next layer's weights rescale. None where p varies along another axis: p is then no edge."""
    k = 0 if ins[0].factors is not None else 1
    x, (c, p), shape = ins[1 - k], ins[k].factors, eqn.outvars[0].aval.shape
    varying = [j for j, ax in enumerate(p.axes) if w.size(ax) > 1]
    dtype = eqn.invars[k].aval.dtype
    if x.kind != ACT or eqn.outvars[0].aval.dtype != dtype or c.kind != CONST:
        return None  # (c a parameter: g·v read undivided)
    if not conv:  # a dot_general
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
    (y,) = w.record(eqn, ins, w.apply(eqn, ins))
    new_shape, axes = [1] * len(shape), [[w.atoms.new(1)] for _ in shape]
    for j, o in zip(varying, at, strict=True):
        new_shape[o], axes[o] = shape[o], list(p.axes[j])
    old_shape = tuple(w.size(ax) for ax in p.axes)
    q = Val(PARAM, axes, leaf=p.leaf, id=p.id)
    if tuple(new_shape) != old_shape:
        (q,) = w.record(eqn, [p], [q], as_=jx.reshape(old_shape, tuple(new_shape), dtype))
    scaled = rules_elementwise.per_unit_scale(w, eqn, [y, q], y, q, as_=jx.product(shape, tuple(new_shape), dtype))
    assert scaled is not None, "kernel_scale and scaled_kernel check what per_unit_scale needs"
    return scaled


def unscaled(w: Walker, ins: Sequence[Val]) -> list[Val]:
    """``ins`` with a kernel held by `kernel_scale` that `scaled_kernel` did not take as the product it is: its
    parameter is combined into fixed coefficients (no edge)."""
    for v in ins:
        if v.factors is not None:
            w.mark_other(v.factors[1], "product of parameters")
    return [dataclasses.replace(v, factors=None) if v.factors is not None else v for v in ins]
