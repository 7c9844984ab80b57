"""The tracing rules of the primitives that rearrange entries: reshapes, transposes, broadcasts, slices, padding,
concatenation."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pathspace_jax import jaxpr as jx
from pathspace_jax import pieces, rewrites, rules_elementwise
from pathspace_jax.atoms import ACT, CONST, PARAM, Pieces, Val

if TYPE_CHECKING:
    from pathspace_jax.tracer import Walker


def rule_reshape(w: Walker, eqn, ins):
    """Factors are matched right to left (numpy's broadcasting convention), so
    ``(C,) -> (1, C)`` keeps the parameter's atom on the last axis."""
    v = ins[0]
    if (cut := pieces.reshaped_pieces(w, eqn, v)) is not None:
        return [cut]
    new_sizes = jx.param(eqn, "new_sizes")
    if (order := jx.param(eqn, "dimensions", None)) is not None:  # a transpose first (JAX's batching of conv)
        v = dataclasses.replace(v, axes=[v.axes[p] for p in order])
    flat = [x for ax in v.axes for a in ax for x in atom_ids(w, a)]
    scalars = list(v.scalars)
    # a new unit axis of a function input (x.reshape(b, 8, 8, 1) of a (b, 64) input, the channel axis
    # of a conv) holds input nodes
    from_input = bool(flat) and all(w.atoms.input[w.atoms.find(a)] for a in flat)
    out: list[list[int]] = []
    k = len(flat) - 1
    for d in reversed(new_sizes):
        if d == 1:
            if k >= 0 and w.size([flat[k]]) == 1:
                out.append([flat[k]])
                k -= 1
            else:
                out.append([scalars.pop()] if scalars else [w.atoms.new(1, input=from_input)])
            continue
        cur: list[int] = []
        p = 1
        while p < d and k >= 0:
            f = flat[k]
            s = w.size([f])
            if s == 1:
                scalars.append(f)
                k -= 1
            elif p * s <= d:
                cur.insert(0, f)
                p *= s
                k -= 1
            elif d % p == 0 and s % (d // p) == 0 and w.atoms.alias[w.atoms.find(f)] is None:
                need = d // p
                first, rest = w.atoms.new(s // need), w.atoms.new(need)
                w.atoms.set_expand(w.atoms.find(f), [first, rest])
                flat[k : k + 1] = [first, rest]
                k += 1
            else:
                return rules_elementwise.unknown(w, eqn, ins)
        if p != d:
            return rules_elementwise.unknown(w, eqn, ins)
        out.append(cur)
    scalars.extend(flat[: k + 1])
    return [dataclasses.replace(v, axes=out[::-1], scalars=scalars)]


def atom_ids(w: Walker, a: int) -> list[int]:
    """Like `Atoms.factors` but keeps atom ids where there is no product structure."""
    r = w.atoms.find(a)
    if w.atoms.expand[r] is None:
        return [a]
    return [x for c in w.atoms.expand[r] for x in atom_ids(w, c)]


def rule_squeeze(w: Walker, eqn, ins):
    return [squeezed(ins[0], jx.param(eqn, "dimensions"))]


def squeezed(v: Val, dimensions) -> Val:
    """``v`` without its axes ``dimensions`` (each of one entry): their atoms become scalars."""
    dims = {d % len(v.axes) for d in dimensions}
    gone = [a for k in sorted(dims) for a in v.axes[k]]
    return dataclasses.replace(v, axes=[ax for k, ax in enumerate(v.axes) if k not in dims], scalars=v.scalars + gone)


def rule_transpose(w: Walker, eqn, ins):
    v, perm = ins[0], jx.param(eqn, "permutation")
    if v.pieces is not None:  # (`pathspace_jax.pieces`)
        per = [[axes[p] for p in perm] for axes in v.pieces.per]  # (its node axes no longer from one axis on:
        v = dataclasses.replace(v, pieces=Pieces(list(perm).index(v.pieces.axis), per, v.pieces.node))  # no bias)
    return [dataclasses.replace(v, axes=[v.axes[p] for p in perm])]


def rule_broadcast_in_dim(w: Walker, eqn, ins):
    v = ins[0]
    shape = jx.param(eqn, "shape")
    out = w.fresh(shape)
    in_shape = eqn.invars[0].aval.shape
    fresh = [a for ax in out for a in ax]
    for k, d in enumerate(jx.param(eqn, "broadcast_dimensions")):
        if in_shape[k] == shape[d]:
            out[d] = list(v.axes[k])
    if v.kind != CONST:  # copies along the new axes: units there rescale alike (`rules_elementwise.rule_add`)
        w.copies.update(a for a in fresh if w.atoms.size[a] > 1 and any(a in ax for ax in out))
    if v.kind == ACT and w.fully_pinned(v):  # copies of a pinned value, along new axes: pinned too
        w.atoms.pin([a for ax in out for a in ax if a in fresh], w.reason("a pinned value broadcast"))
    elif _of_inputs(w, v):
        for a in fresh:  # an input given an axis of one entry (``t[:, None]``: one input feature per example)
            if w.atoms.size[a] == 1:
                w.atoms.input[a] = True
    return [dataclasses.replace(v, axes=out)]


def _of_inputs(w: Walker, v: Val) -> bool:
    """Whether ``v`` is an activation whose atoms are all the inputs' (an input, or a view of one)."""
    return v.kind == ACT and all(w.atoms.input[f] for ax in v.axes for f in w.atoms.factors(ax))


def reslice(w: Walker, eqn, v: Val, keep: Sequence[bool], out_shape, why: str) -> Val:
    """Axes that are not kept get fresh atoms; the old atoms are pinned (a node group may not be cut), which
    does nothing to positions (time, space). The part of an axis that turns out not to be positions is new
    nodes, pinned too (`Walker.defer`): a layer that reads it is an edge from a pinned group (an LSTM's
    gates sliced out of one product), never a bias."""
    out = []
    for k, d in enumerate(out_shape):
        if keep[k] or w.size(v.axes[k]) == d == 1:
            out.append(list(v.axes[k]))
        else:
            if v.kind == PARAM:
                w.mark_other(v, why)
            w.atoms.pin(v.axes[k], w.reason(why))
            out.append([w.atoms.new(d)])
            w.defer(out[-1], v.axes[k], w.reason(why))
    return dataclasses.replace(v, axes=out)


def layer_of(w: Walker, v: Val, in_shape, out_shape, axis: int, start: int) -> Val | None:
    """Entry ``start`` of the first axis of a whole params leaf, sliced out statically (layers stacked in one
    leaf and read in a loop: ``ws[i]``, ``for w in ws``, ``jnp.split(ws, n)``): that layer's slice as a leaf of
    its own (`Walker.layer_slice`), as ``nn.scan`` over the layers reads it; else None."""
    whole = v.kind == PARAM and not v.scaled and v.axes == w.leaf_axes[v.leaf]
    if not whole or axis != 0 or in_shape[0] == 1 or out_shape != (1, *in_shape[1:]):
        return None
    leaf = w.layer_slice(v.leaf, int(start))
    return Val(PARAM, [[w.atoms.new(1)], *[list(ax) for ax in w.leaf_axes[leaf]]], leaf=leaf)


def rule_slice(w: Walker, eqn, ins):
    return [_slice(w, eqn, ins[0], jx.param(eqn, "start_indices"))]


def _slice(w: Walker, eqn, v: Val, start) -> Val:
    in_shape, out_shape = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
    keep = [a == b for a, b in zip(in_shape, out_shape)]
    cut = [k for k, same in enumerate(keep) if not same]
    strides = jx.param(eqn, "strides", None) or ()
    if start is not None and len(cut) == 1 and (out_shape[cut[0]] == 1 or all(s in (None, 1) for s in strides)):
        return pieces.piece_at(w, eqn, v, cut[0], start[cut[0]], out_shape, "slices part of an axis")
    return reslice(w, eqn, v, keep, out_shape, "slices part of an axis")


def rule_rev(w: Walker, eqn, ins):
    """Reversed axes are new atoms (a group's nodes reversed are pinned, positions stay positions: `reslice`),
    but a parameter reversed along axes that turn out to be a convolution's taps (``nn.ConvTranspose(...,
    transpose_kernel=True)``, a transposed convolution written with the flipped kernel) is the same kernel, its
    taps in the other order (`roles.settle` checks)."""
    v, dims = ins[0], jx.param(eqn, "dimensions")
    if v.kind == PARAM:
        w.reversed.append((v, [a for k in dims for a in v.axes[k]], w.reason("reverses a parameter")))
        return [dataclasses.replace(v)]
    keep = [k not in dims for k in range(len(v.axes))]
    return [reslice(w, eqn, v, keep, eqn.outvars[0].aval.shape, "reverses the nodes of a group")]


def rule_dynamic_slice(w: Walker, eqn, ins):
    """A dynamic slice at starts that are all known (``ws[i]`` in a loop over layers unrolled by its counter,
    `rules_control.rule_scan`) is recorded as the static slice it is there; else its starts are unknown."""
    starts = [v.id[1] if isinstance(v.id, tuple) else None for v in ins[1:]]
    if None in starts:
        return [_slice(w, eqn, ins[0], None)]
    as_ = jx.static_slice(eqn, starts)
    return w.record(eqn, ins[:1], [_slice(w, eqn, ins[0], as_[1]["start_indices"])], as_=as_)


def rule_pad(w: Walker, eqn, ins):
    """Padding keeps the atoms of the axes it does not pad; a padded axis is positions where the original is
    (`reslice`). Zeros padded at either end of the last axis of a layer's output, a single group (channels
    padded: a CIFAR ResNet's parameter-free shortcut, ``jnp.pad(x, (..., (0, 0), (c, c)))``), are the zeros
    concatenated beside its units (`side_by_side`)."""
    v, pad = ins
    if v.kind == ACT and not pad.zero:
        w.pin(v, "pads with a non-zero value")
    out_shape = eqn.outvars[0].aval.shape
    config = jx.param(eqn, "padding_config")
    keep = [cfg == (0, 0, 0) for cfg in config]
    if v.kind == ACT and pad.zero and all(keep[:-1]) and not keep[-1]:
        if (axes := _zero_channels(w, v, config[-1], out_shape[-1])) is not None:
            return [dataclasses.replace(v, axes=axes)]
    return [reslice(w, eqn, v, keep, out_shape, "pads an axis")]


def _zero_channels(w: Walker, v: Val, config, size: int) -> list[list[int]] | None:
    """``v``'s axes with its last padded by zeros (``config``: ``(lo, hi, interior)``) into ``size`` entries, as the
    zeros concatenated beside its units (`side_by_side`); None where that axis is not one group of a layer's
    units or the padding is not at its ends."""
    (lo, hi, interior), fs = config, w.atoms.factors(v.axes[-1])
    if interior or lo < 0 or hi < 0 or len(fs) != 1 or w.atoms.input[fs[0]] or w.atoms.position[fs[0]]:
        return None
    segs = []
    for d in (lo, None, hi):
        if d is None:
            segs.append(fs[0])
        elif d > 0:
            segs.append(w.atoms.new(d))
            w.beside.append((segs[-1], True))
    new = w.atoms.new(size)
    w.atoms.alias[new] = segs
    return [*v.axes[:-1], [new]]


def rule_dynamic_update_slice(w: Walker, eqn, ins):
    op, upd = ins[0], ins[1]
    shape = eqn.outvars[0].aval.shape
    kind = ACT if ACT in (op.kind, upd.kind) else CONST
    for v in (op, upd):
        w.mark_other(v, "updated in place")
    if kind == ACT and not (op.kind == CONST and op.zero) and op.kind != ACT:
        w.pin(upd, "written into a non-zero constant")
    out = []
    for k, d in enumerate(shape):
        if eqn.invars[1].aval.shape[k] == d:
            w.atoms.unify(op.axes[k], upd.axes[k], w.reason())
            out.append(list(op.axes[k]))
        else:
            w.atoms.pin(op.axes[k] + upd.axes[k], w.reason("partial update of an axis"))
            out.append(list(op.axes[k]))
    return [Val(kind, out)]


def rule_concatenate(w: Walker, eqn, ins):
    shapes = [var.aval.shape for var in eqn.invars]
    return [_concatenate(w, ins, shapes, jx.param(eqn, "dimension"), eqn.outvars[0].aval.shape)]


def rule_stack(w: Walker, eqn, ins):
    """``jnp.stack`` (a primitive of its own in the JAX versions supported): the operands side by side along a new
    axis of positions, as a scan stacks its steps (a Python loop's states: the same units at every step). Whole
    params leaves of one shape stacked along a new first axis and read only by scans over it (per-layer params
    stacked for ``lax.scan``) are held as those leaves (`Val.layers`): each layer of the scan reads its own."""
    axis = jx.param(eqn, "axis")
    if (
        axis == 0
        and w.matched(rewrites.SCANNED_OVER, eqn.outvars[0])
        and all(v.kind == PARAM and not v.scaled and v.axes == w.leaf_axes[v.leaf] for v in ins)
    ):
        axes = [[w.atoms.new(len(ins))], *[[w.atoms.new(w.size(ax))] for ax in ins[0].axes]]
        return [Val(CONST, axes, from_params=True, layers=tuple(ins))]
    parts = [dataclasses.replace(v, axes=[*v.axes[:axis], [], *v.axes[axis:]]) for v in ins]
    return [_concatenate(w, parts, None, axis, eqn.outvars[0].aval.shape)]


def rule_tile(w: Walker, eqn, ins):
    """``jnp.tile`` (a primitive of its own, as ``stack``): the operand concatenated with itself ``reps[k]``
    times along each axis k."""
    v, shape = ins[0], tuple(eqn.invars[0].aval.shape)
    for k, r in enumerate(jx.param(eqn, "reps")):
        out = (*shape[:k], shape[k] * r, *shape[k + 1 :])
        if r != 1 and shape[k] == 1 and v.kind != ACT:  # copies of one entry: a broadcast (a class token's)
            axes = [*v.axes[:k], [w.atoms.new(r)], *v.axes[k + 1 :]]
            v = dataclasses.replace(v, axes=axes, scalars=v.scalars + list(v.axes[k]))
        elif r != 1:
            v = _concatenate(w, [v] * r, [shape] * r, k, out)
        shape = out
    return [v]


def _concatenate(w: Walker, ins: Sequence[Val], in_shapes, dim: int, shape) -> Val:
    """``ins`` (of ``in_shapes``) concatenated along axis ``dim`` into ``shape``: the other axes are tied; the
    result's axis ``dim`` is the operands' groups side by side (an alias), or positions where one of them has
    no single group (pinned), or, where ``in_shapes`` is None, positions of one entry per operand (a stack). A
    parameter concatenated with activations is a bias at its entries of the result (a ViT's class token put
    before the patches: a bias into their units at the first position)."""
    acts = [v for v in ins if v.kind == ACT]
    biases = [v for v in ins if v.kind == PARAM and not v.scaled] if _along_positions(w, acts, dim) else []
    for v in ins:
        if not any(v is b for b in biases):
            w.mark_other(v, "concatenated")
    kind = ACT if acts else CONST
    out = []
    for k, d in enumerate(shape):
        if k != dim:
            lists = [v.axes[k] for v in ins]
            for other in lists[1:]:
                w.atoms.unify(lists[0], other, w.reason())
            out.append(list(lists[0]))
            continue
        new = w.atoms.new(d)
        segs = None if in_shapes is None else side_by_side(w, ins, in_shapes, k)
        if segs is not None:
            w.atoms.alias[new] = segs
        elif in_shapes is None and all(_of_inputs(w, v) for v in ins):  # inputs stacked: ``jnp.stack([x, y], -1)``
            w.atoms.input[new] = True  # an input axis (positions where layers share weights along it)
        else:
            w.atoms.position[new] = True
            for v in ins if in_shapes is not None else ():  # (a stack's operands have no such axis)
                w.atoms.pin(v.axes[k], w.reason("concatenates along an axis of mixed structure"))
        out.append([new])
    for v in biases:
        w.use(v, w.all_atoms(v), "out")
    zero = kind == CONST and all(v.zero for v in ins)
    return Val(kind, out, zero=zero)


def _along_positions(w: Walker, acts: Sequence[Val], dim: int) -> bool:
    """Whether axis ``dim`` of the activations ``acts`` (some) is positions, or input entries that a layer has
    shared its weights along (`roles.shared_along`): never the nodes of a layer."""
    shared = set(w.atoms.factors(list(w.shared_inputs)))
    fs = [f for v in acts for f in w.atoms.factors(v.axes[dim])]
    return bool(fs) and all(w.atoms.position[f] or f in shared for f in fs)


def side_by_side(w: Walker, ins: Sequence[Val], in_shapes, k: int) -> list[int] | None:
    """The groups of the operands' axis ``k``, one atom each (empty operands left out; an operand's axis of several
    factors, a convolution's output flattened with its positions, one atom made of them), else None. A constant
    beside activations (CoordConv's coordinate channels, a constant feature) is a group of inputs of its own:
    the layers reading the result read it with edges from inputs (`roles.settle` decides: where a layer
    writes into them too, a residual added, they are pinned, or, zeros, that layer's units)."""
    segs, atoms = [], w.atoms
    for v, in_shape in zip(ins, in_shapes, strict=True):
        fs = atoms.factors(v.axes[k])
        nodes = [f for f in fs if not atoms.position[f]]  # (one group side by side of several: one of them)
        if len(fs) == 1 and v.kind == ACT:
            segs.append(fs[0])
        elif v.kind == ACT and nodes and (len(nodes) == 1 or all(atoms.alias[f] is None for f in nodes)):
            # a feature map flattened with its positions: its channels at every position (`Atoms.segments`)
            segs.append(atoms.new(in_shape[k]))
            atoms.set_expand(segs[-1], fs)
        elif v.kind == CONST and not v.from_params and in_shape[k] > 0:
            segs.append(atoms.new(in_shape[k]))
            w.beside.append((segs[-1], v.zero))
        elif in_shape[k] > 0:
            return None
    return segs
