"""The tracing rules of reductions, pooling and cumulative primitives."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from pathspace_jax import jaxpr as jx
from pathspace_jax import roles, rules_shape
from pathspace_jax.atoms import ACT, CONST, PARAM, Val

if TYPE_CHECKING:
    from pathspace_jax.tracer import Walker


def _reduce(w: Walker, eqn, ins, why: str, maximum: bool):
    """A sum or maximum along ``axes``: over the nodes of a group it pins them, except a maximum along a factor
    of a kernel's output axis that a reshape split off the units the result keeps (maxout, ``z.reshape(b,
    units, k).max(-1)``): each unit is one node shared along it, as by positions (its pieces rescale together,
    and their maximum with them). (A sum, a normalisation's mean over a group of channels, pins as before.) A
    maximum over entries that different weights feed is flagged for
    `pathspace_jax.program.refuse_exclusive_branches` (`weighted_along`)."""
    v = ins[0]
    axes = set(jx.param(eqn, "axes"))
    w.mark_other(v, "reduced")
    kept = [f for k in range(len(v.axes)) if k not in axes for f in w.atoms.factors(v.axes[k])]
    gone, exclusive = [], False
    for k in axes:
        if w.size(v.axes[k]) == 1:
            gone += v.axes[k]
            continue
        maximum = maximum and v.kind == ACT
        exclusive |= maximum and roles.weighted_along(w, v.axes[k])
        if maximum and roles.split_from_units(w, v.axes[k], kept):
            w.atoms.make_positions(v.axes[k])
        else:
            w.atoms.pin(v.axes[k], w.reason(why))
    kind = v.kind if v.kind != PARAM else CONST
    out = Val(kind, [ax for k, ax in enumerate(v.axes) if k not in axes], zero=v.zero, scalars=v.scalars + gone)
    return w.record(eqn, ins, [out], exclusive=True) if exclusive else [out]


def rule_reduce_sum(w: Walker, eqn, ins):
    return _reduce(w, eqn, ins, "sums over the nodes of a group", maximum=False)


def rule_reduce_max(w: Walker, eqn, ins):
    """A maximum (or minimum) along ``axes`` (`_reduce`)."""
    return _reduce(w, eqn, ins, "takes a maximum over the nodes of a group", maximum=True)


def rule_argmax(w: Walker, eqn, ins):
    v = ins[0]
    axes = set(jx.param(eqn, "axes"))
    return [Val(CONST, [ax for k, ax in enumerate(v.axes) if k not in axes])]


def rule_cumulative(w: Walker, eqn, ins):
    v = ins[0]
    w.mark_other(v, "cumulative op")
    w.atoms.pin(v.axes[jx.param(eqn, "axis")], w.reason("accumulates along the nodes of a group"))
    return [dataclasses.replace(v, kind=v.kind if v.kind != PARAM else CONST)]


def _pool(w: Walker, eqn, ins, maximum: bool):
    v = ins[0]
    windows, strides, padding = (jx.param(eqn, k) for k in ("window_dimensions", "window_strides", "padding"))
    out_shape = eqn.outvars[0].aval.shape
    in_shape = eqn.invars[0].aval.shape
    w.mark_other(v, "pooled")
    keep = []
    for k in range(len(out_shape)):
        trivial = windows[k] == 1 and strides[k] == 1 and tuple(padding[k]) == (0, 0) and in_shape[k] == out_shape[k]
        keep.append(trivial)
        if not trivial:
            for a in w.atoms.factors(v.axes[k]):
                w.atoms.position[a] = True
    kind = v.kind if v.kind != PARAM else CONST
    out = dataclasses.replace(
        rules_shape.reslice(w, eqn, v, keep, out_shape, "pools over the nodes of a group"), kind=kind
    )
    exclusive = maximum and v.kind == ACT
    if exclusive and any(roles.weighted_along(w, v.axes[k]) for k, trivial in enumerate(keep) if not trivial):
        return w.record(eqn, ins, [out], exclusive=True)  # (max pooling after nn.ConvLocal)
    return [out]


def rule_pool_sum(w: Walker, eqn, ins):
    """A sum over windows (average pooling): the pooled axes are positions."""
    return _pool(w, eqn, ins, maximum=False)


def rule_pool_max(w: Walker, eqn, ins):
    """A maximum (or minimum) over windows (max pooling): the pooled axes are positions; one over entries that
    different weights feed is flagged, as a reduction's is (`_reduce`)."""
    return _pool(w, eqn, ins, maximum=True)
