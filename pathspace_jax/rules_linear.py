"""The tracing rules of ``dot_general`` and ``conv_general_dilated``: a parameter operand is an edge tensor between
two node groups; a constant one mixes nodes with fixed coefficients."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from pathspace_jax import idioms, pieces, roles, rules_shape
from pathspace_jax import jaxpr as jx
from pathspace_jax.atoms import ACT, CONST, PARAM, Val

if TYPE_CHECKING:
    from pathspace_jax.tracer import Walker

MIXES_COMPUTED = "mixes nodes with coefficients computed from parameters"


def zero_product(w: Walker, eqn, ins) -> list[Val] | None:
    """A product with an operand known to be all zeros (a Python loop's zero initial state times its recurrent
    kernel): zeros, neither an edge nor a source of paths (a constant input); None otherwise."""
    if any(v.kind == CONST and v.zero for v in ins):
        return [Val(CONST, w.fresh(eqn.outvars[0].aval.shape), zero=True)]
    return None


def _zero_or_scaled(w: Walker, eqn, ins, *, conv: bool):
    """A product with zeros (`zero_product`), or with a kernel held by `idioms.kernel_scale` (`idioms.scaled_kernel`):
    ``(its results, ins)``; else ``(None, ins)``, a held kernel no longer held (`idioms.unscaled`)."""
    if zeros := zero_product(w, eqn, ins):
        return zeros, ins
    if any(v.factors is not None for v in ins):
        if (scaled := idioms.scaled_kernel(w, eqn, ins, conv=conv)) is not None:
            return scaled, ins
        ins = idioms.unscaled(w, ins)
    return None, ins


def rule_dot_general(w: Walker, eqn, ins):
    done, ins = _zero_or_scaled(w, eqn, ins, conv=False)
    if done is not None:
        return done
    lhs, rhs = ins
    (lc, rc), (lb, rb) = jx.param(eqn, "dimension_numbers")
    lfree = [k for k in range(len(lhs.axes)) if k not in lc and k not in lb]
    rfree = [k for k in range(len(rhs.axes)) if k not in rc and k not in rb]
    out = [list(lhs.axes[k]) for k in lb] + [list(lhs.axes[k]) for k in lfree] + [list(rhs.axes[k]) for k in rfree]
    kinds = (lhs.kind, rhs.kind)
    if coefficient_product(w, ins):
        return [Val(CONST, out)]
    if PARAM in kinds and (ACT in kinds or CONST in kinds):
        p, x, pc, xc, pb, xb, pfree = (
            (rhs, lhs, rc, lc, rb, lb, rfree) if rhs.kind == PARAM else (lhs, rhs, lc, rc, lb, rb, lfree)
        )
        for a, b in zip(pc, xc):
            w.atoms.unify(x.axes[b], p.axes[a], w.reason())
            w.use(p, p.axes[a], "in")
            if x.kind == CONST:
                for f in w.atoms.factors(x.axes[b]):
                    w.atoms.input[f] = True
        for j, (a, b) in enumerate(zip(pb, xb)):
            # one weight per entry along a batch axis (an ensemble's members, a mixture's experts): each entry
            # is part of the nodes on both sides, the result's its own atoms (`diagonal`)
            w.atoms.unify(x.axes[b], p.axes[a], w.reason())
            out[j] = w.diagonal_ends(p, p.axes[a])
        at = len(pb) + (len(lfree) if p is rhs else 0)  # where p's free axes begin in the result
        cut = pieces.kernel_pieces(w, eqn, p, x, (pc, xc, pb), pfree, out, at) if len(pfree) > 1 else None
        for a in pfree if cut is None else ():
            w.use(p, p.axes[a], "out")
        if x.kind == ACT:
            roles.shared_along(w, x, xc, [k for k in range(len(x.axes)) if k not in xc and k not in xb])
        return [cut or Val(ACT, out)]
    if kinds == (CONST, CONST):
        return [Val(CONST, out)]
    if kinds == (ACT, ACT) and (summed := weighted_sum(w, ins, (lc, rc), (lb, rb), (lfree, rfree))):
        return [summed]
    for v in ins:
        w.mark_other(v, "multiplied by a parameter")
    if ACT in kinds:
        if kinds == (ACT, ACT):
            for v in ins:
                w.pin(v, "product of activations")
        else:  # fixed coefficients (a constant, or parameters that are not an edge): new nodes, pinned
            if lhs.kind == ACT:
                x, xc, c, cfree, first = lhs, lc, rhs, rfree, len(lb) + len(lfree)
            else:
                x, xc, c, cfree, first = rhs, rc, lhs, lfree, len(lb)
            why = w.reason(MIXES_COMPUTED if c.from_params else "mixes nodes with fixed coefficients")
            for b in xc:
                w.atoms.pin(x.axes[b], why)
            mixed = [a for b in xc for a in x.axes[b]]
            for j, k in enumerate(cfree):  # never the coefficients' own atoms (a concatenation's positions)
                out[first + j] = [w.atoms.new(w.size(c.axes[k]))]
                w.defer(out[first + j], mixed, why, fixed=True)
        for a, b in zip(lb, rb):
            w.atoms.unify(lhs.axes[a], rhs.axes[b], w.reason())
        return [Val(ACT, out)]
    return [Val(CONST, out)]


def coefficient_product(w: Walker, ins: Sequence[Val]) -> bool:
    """Whether a product of a parameter and a constant computed from parameters (a power iteration's vector
    times the kernel): a coefficient computed from parameters, not a layer with a fixed input (the parameter is
    no edge)."""
    params = [v for v in ins if v.kind == PARAM]
    if not params or not any(v.kind == CONST and v.from_params for v in ins):
        return False
    for v in params:
        w.mark_other(v, "multiplied by a coefficient computed from parameters")
    return True


def weighted_sum(w: Walker, ins, contracted, batch, free) -> Val | None:
    """A ``dot_general`` of a fully pinned ``a`` and an activation ``x`` that is not (attention's weights times its
    values): a's entries are coefficients that no rescaling changes, so x's units go on through the sum, along
    x's batch axes (the heads) and free axes, and the result scales with them. x's contracted axes (the keys)
    must be positions: where they turn out to be nodes, they are pinned (`roles.settle`). a's free axes (the
    queries) are its own where they are positions or input axes (self-attention's: the sequence's); where they
    are nodes (learned queries, ``nn.MultiHeadDotProductAttention(probe, x)`` with a parameter ``probe``: the
    pinned nodes of fixed coefficients; the units of a pinned layer, in an outer product), the result's are
    positions of their own: each of its entries is x's unit times a coefficient, shared by the entries of that
    axis. None where neither or both are fully pinned (as `gated`)."""
    pinned_rhs = w.fully_pinned(ins[1])
    if w.fully_pinned(ins[0]) == pinned_rhs:
        return None
    j = 0 if pinned_rhs else 1  # the activation's side
    x = ins[j]
    why = w.reason("sums nodes with coefficients computed from pinned values")
    kept = [x.axes[k] for k in (*batch[j], *free[j])]
    for k in contracted[j]:
        w.shared_along.append((list(x.axes[k]), kept))  # (a mixture's experts, nn.vmap'd: their units shared)
        w.defer(list(x.axes[k]), list(x.axes[k]), why)
    out = [list(x.axes[k]) for k in batch[j]]
    for v, fr in zip(ins, free, strict=True):
        for k in fr:
            fs = w.atoms.factors(v.axes[k])
            if v is x or all(w.atoms.input[f] or w.atoms.position[f] for f in fs):
                out.append(list(v.axes[k]))
            else:
                out.append([w.atoms.new(w.size(v.axes[k]), position=True)])
    return Val(ACT, out)


def rule_conv_general_dilated(w: Walker, eqn, ins):
    done, ins = _zero_or_scaled(w, eqn, ins, conv=True)
    if done is not None:
        return done
    lhs, rhs = ins
    dn = jx.param(eqn, "dimension_numbers")
    lspec, rspec, ospec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    out_shape = eqn.outvars[0].aval.shape
    out = [[] for _ in out_shape]
    out[ospec[0]] = list(lhs.axes[lspec[0]])
    for k in ospec[2:]:
        out[k] = [w.atoms.new(out_shape[k], position=True)]
    groups = jx.param(eqn, "feature_group_count")
    grouped = jx.param(eqn, "batch_group_count") != 1
    if coefficient_product(w, ins):
        return [Val(CONST, out)]
    if rhs.kind == PARAM and lhs.kind in (ACT, CONST) and not grouped:
        # G groups: input channel (g, i) feeds output channel (g, o) only, through kernel entry (i, g·O/G + o);
        # g is a batch axis of the channels (depthwise convolutions, an ensemble's under nn.vmap), as in
        # `rule_dot_general`
        (g_in, c_in), (g_out, c_out) = (split(w, ax, groups) for ax in (lhs.axes[lspec[1]], rhs.axes[rspec[0]]))
        w.atoms.unify(c_in, rhs.axes[rspec[1]], w.reason())
        w.use(rhs, rhs.axes[rspec[1]], "in" if c_in else "tap")
        if lhs.kind == CONST:
            for f in w.atoms.factors(lhs.axes[lspec[1]]):
                w.atoms.input[f] = True
        if g_in:
            w.atoms.unify(g_in, g_out, w.reason())
            g_out = w.diagonal_ends(rhs, g_out)
        w.use(rhs, c_out, "out")
        for k in rspec[2:]:
            w.use(rhs, rhs.axes[k], "tap")
            w.atoms.make_positions(rhs.axes[k])
        for k in lspec[2:]:
            w.atoms.make_positions(lhs.axes[k])
        out[ospec[1]] = list(g_out) + list(c_out)
        return [Val(ACT, out)]
    if lhs.kind == CONST and rhs.kind == CONST:
        out[ospec[1]] = [w.atoms.new(out_shape[ospec[1]])]
        return [Val(CONST, out)]
    if lhs.kind == ACT and rhs.kind == CONST and not grouped and selects_taps(w, eqn, rhs, groups):
        # each output feature (c, t) is input channel c at tap t (times a fixed coefficient): the channel's
        # nodes, at other positions (`lax.conv_general_dilated_patches`, behind `nn.ConvLocal`)
        for k in lspec[2:]:
            w.atoms.make_positions(lhs.axes[k])
        taps = out_shape[ospec[1]] // groups
        out[ospec[1]] = list(lhs.axes[lspec[1]]) + [w.atoms.new(taps, position=True)]
        return [Val(ACT, out)]
    why = "batch-grouped convolution" if grouped else "convolution without a parameter kernel"
    if not grouped and rhs.kind == CONST and rhs.from_params:
        why = MIXES_COMPUTED
    for v in ins:
        w.mark_other(v, why)
        if v.kind == ACT:
            w.pin(v, why)
    out[ospec[1]] = [w.atoms.new(out_shape[ospec[1]])]
    val = Val(ACT, out)
    w.pin(val, why)
    return [val]


def selects_taps(w: Walker, eqn, kernel: Val, groups: int) -> bool:
    """Whether a convolution's constant ``kernel`` (a value the trace can compute) has one group per input
    channel and, for each output feature, exactly one non-zero entry: every output is one input entry times
    a fixed coefficient, as ``lax.conv_general_dilated_patches`` makes them."""
    dn = jx.param(eqn, "dimension_numbers")
    if groups != eqn.invars[0].aval.shape[dn.lhs_spec[1]]:
        return False
    k = w.rec.value(kernel.id)
    if k is None:
        return False
    k = np.moveaxis(k, (dn.rhs_spec[0], dn.rhs_spec[1]), (0, 1))
    return k.shape[1] == 1 and bool(np.all(np.count_nonzero(k.reshape(k.shape[0], -1), axis=1) == 1))


def split(w: Walker, axis: list[int], groups: int) -> tuple[list[int], list[int]]:
    """The atoms of ``axis`` as ``groups`` consecutive blocks: (the block's atoms, the atoms within a block),
    either empty where it has one entry (one group, or one entry per group)."""
    if groups == 1:
        return [], list(axis)
    ids, blocks = (
        [i for a in axis for i in rules_shape.atom_ids(w, a)],
        1,
    )  # atom ids: a parameter's roles are kept by id
    for k, a in enumerate(ids):
        if blocks == groups:
            return ids[:k], ids[k:]
        blocks *= w.size([a])
    if blocks == groups:
        return ids, []
    parts = [w.atoms.new(groups), w.atoms.new(w.size(axis) // groups)]
    w.atoms.unify(axis, parts, w.reason())
    return parts[:1], parts[1:]
