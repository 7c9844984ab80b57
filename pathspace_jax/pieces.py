"""A layer's output cut into pieces (a fused kernel's queries, keys and values; a gated MLP's two halves): the
tracing rules of ``split``/``unstack`` and the cutting of a node axis into groups."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from pathspace_jax import jaxpr as jx
from pathspace_jax import rewrites, roles, rules_shape
from pathspace_jax.atoms import ACT, PARAM, Pieces, Val

if TYPE_CHECKING:
    from pathspace_jax.tracer import Walker


def kernel_pieces(w: Walker, eqn, p: Val, x: Val, dims, pfree: Sequence[int], out: list[list[int]], at: int):
    """A kernel with several output axes whose output (plus perhaps a bias) is read only in pieces along the first,
    ``out[at]``: queries, keys and values from ``nn.DenseGeneral(features=(3, heads, d))`` read as ``qkv[:, :,
    0]``, ..., or from Gemma's ``jnp.einsum("BTD,SNDH->SBTNH", x, w)`` unpacked. Its output axes are one node
    axis, flattened in the leaf (`flattened`), cut into a group per piece as a ``Dense``'s output reshaped and
    read in pieces is (`_cut_in_pieces`); or, where the pieces axis is the kernel's first and its output axes are
    not its last, each piece's slice is a leaf of its own (`layer_slice`), as layers stacked in one leaf are.
    Else None."""
    (pc, xc, pb), leaf, shape = dims, p.leaf, eqn.outvars[0].aval.shape
    own = w.leaf_axes[leaf]
    if p.scaled or p.axes != own or pb or any(u[2] != w.step for u in w.uses[leaf]):
        return None  # (read before: its axes have uses of their own)
    var = w.matched(rewrites.THROUGH_A_BIAS, eqn.outvars[0]) or eqn.outvars[0]  # (its bias: `bias_of_pieces`)
    if list(pfree) == list(range(len(own) - len(pfree), len(own))) and at + len(pfree) == len(out):
        flat = w.atoms.new(int(np.prod(shape[at:])))
        if (cut := _cut_in_pieces(w, Val(ACT, [*out[:at], [flat]]), flat, var, at, shape)) is not None:
            w.use(p, [flat], "out")
            w.flattened(leaf, len(pfree), flat)
        return cut
    if pfree[0] != 0 or {width for _, width in _piece_reads(w, var, at, shape)} != {1}:
        return None
    w.uses[leaf] = []  # read by its slices instead
    axes, per, segs = [list(ax) for ax in out], [], []
    for i in range(shape[at]):
        piece = Val(PARAM, [], leaf=w.layer_slice(leaf, i))
        mine = w.leaf_axes[piece.leaf]  # (the leaf's axes but the first)
        for a, b in zip(pc, xc, strict=True):
            w.atoms.unify(x.axes[b], mine[a - 1], w.reason())
            w.use(piece, mine[a - 1], "in")
        units = [a for k in pfree[1:] for a in mine[k - 1]]
        w.use(piece, units, "out")
        segs.append(w.atoms.new(int(np.prod(shape[at + 1 : at + len(pfree)]))))
        w.atoms.set_expand(segs[-1], units)
        piece_axes = [list(mine[k - 1]) for k in pfree[1:]]
        per.append([*out[:at], [w.atoms.new(1)], *piece_axes, *out[at + len(pfree) :]])
    axes[at] = [w.atoms.new(shape[at])]
    w.atoms.alias[axes[at][0]] = segs
    for j in range(at + 1, at + len(pfree)):
        axes[j] = [w.atoms.new(shape[j])]
    return Val(ACT, axes, pieces=Pieces(at, per))


def bias_of_pieces(w: Walker, ins: Sequence[Val]) -> Val | None:
    """A bias added to a kernel's output cut in pieces (`kernel_pieces`), along all of its axes: its axes are
    the kernel's node axis too, flattened (`flattened`). Else None."""
    (x, b), acts = (ins if ins[0].kind == ACT else ins[::-1]), [v for v in ins if v.kind == ACT]
    if len(acts) != 1 or x.pieces is None or x.pieces.first is None:
        return None  # (None: a kernel read in slices, `kernel_pieces`, or its pieces transposed)
    if b.kind != PARAM or b.scaled or w.uses[b.leaf]:
        return None
    n, own = x.pieces.first, w.leaf_axes[b.leaf]
    if len(own) != len(x.axes) - n or b.axes[n:] != own:  # (its other axes: broadcast)
        return None
    w.use(b, [x.pieces.node], "out")
    w.flattened(b.leaf, len(own), x.pieces.node)
    return dataclasses.replace(x, scalars=list(dict.fromkeys(a for v in ins for a in v.scalars)))


def reshaped_pieces(w: Walker, eqn, v: Val) -> Val | None:
    """A layer's output whose last axis is reshaped into ``(k, ...)`` and then read only in pieces of ``w`` entries
    of the k axis (``q, k, v = qkv.reshape(b, t, 3, h, d)[:, :, 0], ...``, or ``jnp.split`` along it): each piece
    is a group of its own, as where the last axis is cut before the reshape (`_piece_of_layer`), and the result
    carries the pieces' axes for the slices that read them (``Val.pieces``, `_cut_in_pieces`). Else None."""
    in_shape, shape, n = eqn.invars[0].aval.shape, tuple(jx.param(eqn, "new_sizes")), len(v.axes) - 1
    if v.kind != ACT or n < 0 or jx.param(eqn, "dimensions", None) is not None:
        return None
    if shape[:n] != tuple(in_shape[:n]) or len(shape) < n + 2:
        return None
    fs = w.atoms.factors(v.axes[n])
    if len(fs) != 1 or w.atoms.position[fs[0]] or not _written_by_a_layer(w, fs[0]):
        return None
    return _cut_in_pieces(w, v, fs[0], eqn.outvars[0], n, shape)


def _cut_in_pieces(w: Walker, v: Val, flat: int, var, n: int, shape) -> Val | None:
    """``v`` with its node axis ``flat`` (one atom, a layer's output) seen as the axes ``n`` on of ``shape``, as
    the jaxpr variable ``var`` holds it, where every reader of ``var`` takes pieces of ``width`` entries of one axis
    ``c`` (`_piece_reads`): ``flat`` cut into a group per piece, each the product of the pieces' axes, and ``v``
    with axes ``shape``: its axis c stands for the groups side by side (an alias of them, for the flags of
    `pathspace_jax.trace.record`), and ``Val.pieces`` carries each piece's axes. Where c is axis n, the pieces are
    ranges of ``flat`` (`_cut`); where axes come before it (GPT-NeoX's ``qkv.reshape(b, t, heads, 3 * d)`` split
    on its last axis, ``nn.DenseGeneral((heads, 3, d))`` read along its middle axis), their entries interleave
    (`pathspace_jax.atoms.Atoms.blocks`), and each piece has axes of its own for them. Else None."""
    for c in range(n, len(shape)):
        reads = _piece_reads(w, var, c, shape)
        width = next(iter(reads))[1] if len({r for _, r in reads}) == 1 else None  # (one width, else None)
        if width is not None and width < shape[c] and not any(a % width for a, _ in reads):
            break
    else:
        return None
    lead, k, rest = tuple(shape[n:c]), shape[c], tuple(shape[c + 1 :])
    if k < 2 or min(lead + rest, default=0) < 2 or not lead and not rest:
        return None
    blocks, m = int(np.prod(lead)), int(np.prod(rest))
    want = lead + ((width,) if width > 1 else ()) + rest
    if lead:  # interleaved: each piece its own atom (as an earlier reshape of the same output cut it, if one did)
        segs = w.atoms.alias[flat]
        if segs is None:
            segs = [w.atoms.new(blocks * width * m) for _ in range(k // width)]
            w.atoms.set_alias(flat, segs, blocks)
        elif w.atoms.blocks[flat] != blocks or len(segs) != k // width:
            return None
    else:  # ranges of ``flat`` (cut as an earlier reshape of the same output was, if it was)
        segs = [_cut(w, flat, i * width * m, (i + 1) * width * m) for i in range(k // width)]
        if any(seg is None for seg in segs):
            return None
    segs, per = [w.atoms.find(seg) for seg in segs], []
    for seg in segs:
        if w.atoms.alias[seg] is not None:
            return None
        if len(want) > 1 and w.atoms.expand[seg] is None:
            w.atoms.set_expand(seg, [w.atoms.new(d) for d in want])
        axes = w.atoms.factors([seg])
        if [w.atoms.size[a] for a in axes] != list(want):
            return None
        if width == 1:  # (the piece's entry of axis c: one, squeezed by its reader)
            axes = [*axes[: len(lead)], w.atoms.new(1), *axes[len(lead) :]]
        per += [[*v.axes[:n], *[[a] for a in axes]]] * width  # (indexed by the entry a piece starts at)
    ks = w.atoms.new(k)
    w.atoms.alias[ks] = segs
    axes = [*v.axes[:n], *[[w.atoms.new(d)] for d in lead], [ks], *[[w.atoms.new(d)] for d in rest]]
    return dataclasses.replace(v, axes=axes, pieces=Pieces(c, per, flat, n))


def _piece_reads(w: Walker, var, axis: int, shape) -> set[tuple[int, int | None]]:
    """``(start, width)`` of the entries of ``axis`` that each reader of the jaxpr variable ``var`` (of ``shape``)
    takes, whole elsewhere: a unit-stride slice, a split into equal parts or an unstack (start 0), or the same
    through a transpose (``qkv.transpose(2, 0, 3, 1, 4)[0]``); width None for anything else."""
    out = set()
    for perm, u, trace in w.matched(rewrites.READS_THROUGH_TRANSPOSES, var):
        k, s = (axis, shape) if perm is None else (perm.index(axis), tuple(shape[p] for p in perm))
        if trace is rule_split and jx.param(u, "axis") == k:
            sizes = set(jx.param(u, "sizes"))
            out.add((0, sizes.pop()) if len(sizes) == 1 else (0, None))
        elif trace is rule_unstack and jx.param(u, "axis") % len(s) == k:
            out.add((0, 1))
        else:
            box = None if u is None else jx.slice_box(u.primitive.name, u.params)
            whole = box is not None and all((a, b) == (0, d) for j, ((a, b), d) in enumerate(zip(box, s)) if j != k)
            out.add((box[k][0], box[k][1] - box[k][0]) if whole else (0, None))
    return out


def _piece(v: Val, start: int) -> Val:
    """The piece from entry ``start`` of a value seen in pieces (`_cut_in_pieces`, `kernel_pieces`)."""
    return dataclasses.replace(v, axes=[list(ax) for ax in v.pieces.per[start]], pieces=None)


def _pieces(w: Walker, eqn, v: Val, axis: int, shapes) -> list[Val]:
    """``v`` cut along ``axis`` into consecutive pieces of ``shapes`` (`piece_at`)."""
    starts = np.cumsum([0] + [shape[axis] for shape in shapes[:-1]]).tolist()
    return [piece_at(w, eqn, v, axis, a, shape, "splits an axis") for a, shape in zip(starts, shapes)]


def piece_at(w: Walker, eqn, v: Val, axis: int, start: int, shape, why: str) -> Val:
    """The piece of ``v`` of ``shape`` from entry ``start`` of ``axis``: a reshaped value's piece (`_piece`), a
    stacked leaf's layer (`rules_shape.layer_of`), a group of a layer's output (`_piece_of_layer`), else
    resliced (the cut axis pinned unless it is positions)."""
    if v.pieces is not None and axis == v.pieces.axis:
        return _piece(v, start)
    in_shape = eqn.invars[0].aval.shape
    piece = rules_shape.layer_of(w, v, in_shape, shape, axis, start) or _piece_of_layer(w, v, axis, start, shape)
    if piece is not None:
        return piece
    others = [f for k, ax in enumerate(v.axes) if k != axis for f in w.atoms.factors(ax)]
    if v.kind == ACT and roles.split_from_units(w, v.axes[axis], others):  # (GPT-NeoX's fused q, k, v)
        why = "cuts a layer's output along an axis that a reshape split off it, its pieces interleaved"
    return rules_shape.reslice(w, eqn, v, [k != axis for k in range(len(in_shape))], shape, why)


def _piece_of_layer(w: Walker, v: Val, axis: int, start: int, shape) -> Val | None:
    """Entries ``start`` on of the node axis ``axis`` of an activation, a layer's output (a fused kernel's:
    ``q, k, v = jnp.split(x @ w + b, 3, -1)``, a gated unit's two halves): the piece as a group of its own, the
    layer's output axis those groups side by side, as a concatenation's is (`Atoms.set_alias`); or operands of a
    concatenation read back (`_bounds`); else None."""
    fs, end = w.atoms.factors(v.axes[axis]), start + shape[axis]
    if v.kind != ACT or len(fs) != 1 or w.atoms.position[fs[0]]:
        return None
    if not _written_by_a_layer(w, fs[0]) and not {start, end} <= _bounds(w, fs[0]):
        return None  # (a concatenation's operands are read back whole, never cut)
    if (piece := _cut(w, fs[0], start, end)) is None:
        return None
    return dataclasses.replace(v, axes=[[piece] if k == axis else list(ax) for k, ax in enumerate(v.axes)])


def _bounds(w: Walker, r: int) -> set[int]:
    """Where the groups side by side in the axis ``r`` (a concatenation's) begin and end; none where it is one."""
    if w.atoms.alias[r] is None or w.atoms.blocks[r] > 1:
        return set()
    sizes = [w.atoms.size[w.atoms.find(s)] for s in w.atoms.alias[r]]
    return set(np.cumsum([0, *sizes]).tolist())


def _written_by_a_layer(w: Walker, r: int) -> bool:
    """Whether the root ``r`` is the output axis of a parameter's edges."""
    return r in w.layer_outputs()


def _cut(w: Walker, a: int, lo: int, hi: int) -> int | None:
    """The atom of entries ``lo:hi`` of node axis ``a``, cutting ``a`` (or the groups side by side in it) where
    the range starts and ends; None where its groups interleave (`_cut_in_pieces`)."""
    r = w.atoms.find(a)
    n = w.atoms.size[r]
    if (lo, hi) == (0, n):
        return r
    if w.atoms.blocks[r] > 1:
        return None  # (its groups interleave: no range of its entries is one)
    if w.atoms.alias[r] is None:
        w.atoms.set_alias(r, [w.atoms.new(d) for d in (lo, hi - lo, n - hi) if d > 0])
    out, at = [], 0
    for s in w.atoms.alias[r]:
        d = w.atoms.size[w.atoms.find(s)]
        if max(lo, at) < min(hi, at + d):
            if (piece := _cut(w, s, max(lo, at) - at, min(hi, at + d) - at)) is None:
                return None
            out.append(piece)
        at += d
    if len(out) == 1:
        return out[0]
    whole = w.atoms.new(hi - lo)
    w.atoms.alias[whole] = out
    return whole


def rule_split(w: Walker, eqn, ins):
    return _pieces(w, eqn, ins[0], jx.param(eqn, "axis"), [var.aval.shape for var in eqn.outvars])


def rule_unstack(w: Walker, eqn, ins):
    """``unstack`` (JAX 0.12+ iterates over an array with it: ``for w in ws``): a split into entries of one
    along the axis, each squeezed."""
    in_shape = eqn.invars[0].aval.shape
    axis = jx.param(eqn, "axis") % len(in_shape)
    one = tuple(1 if k == axis else d for k, d in enumerate(in_shape))
    parts = _pieces(w, eqn, ins[0], axis, [one] * len(eqn.outvars))
    return [
        dataclasses.replace(p, axes=[ax for k, ax in enumerate(p.axes) if k != axis], scalars=p.scalars + p.axes[axis])
        for p in parts
    ]
