"""Nodes whose groups are pinned in part, cut into their groups where they are computed (`cut_nodes`), for the flat
program (`pathspace_jax.program`): the program's flags are per value, so such a value is cut by slices (or a
reshape and transpose before them, for nodes interleaved in blocks) into one value per group."""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from pathspace_jax import jaxpr as jx
from pathspace_jax.ir import Eqn, Program
from pathspace_jax.rules import Op

# ids of the values `cut_nodes` adds to a program: apart from the recorded ones (counted from 0 per recording)
_NEW_IDS = itertools.count(1 << 48)


def cut_nodes(prog: Program, fresh: set[int]) -> dict[int, list[int]] | None:
    """Each node whose groups are pinned in part (a `pathspace_jax.trace.Cut`: a fused kernel's output, of which a
    gate is pinned and a linear half not, read through slices or after a ReLU) cut into its groups right where it
    is computed: ``split`` into pieces, which are the nodes (`_find_nodes`: a split is the only use of the value),
    the pinned ones sinks. Slices that are pieces (``z[:, :h]``, ``z[:, h:]``) become them; where something else
    reads the node, it reads the pieces ``concatenate``d back instead. An output that is no pre-activation is cut
    where it is a concatenation of its groups (a ReLU head and a tanh head side by side), else a boundary as a whole.
    Returns the outputs cut, with their pieces (None where nothing was cut)."""
    cuts = {n: prog.cut[n] for n in prog.nodes if n in prog.cut}
    if not cuts:
        return None
    outs, uses = {x for x in prog.out_ids if not isinstance(x, tuple)}, prog.uses
    eqns, renamed, dropped, joined = [], {}, set(), {}
    for e in prog.eqns:
        if id(e) in dropped:
            continue
        eqns.append(dataclasses.replace(e, ins=[renamed.get(x, x) if not isinstance(x, tuple) else x for x in e.ins]))
        for n in (n for n in e.outs if n in cuts):
            cut, aval = cuts[n], jx.result_avals(e.source)[e.outs.index(n)]
            if n not in fresh:  # an output computed from nodes
                side_by_side = e.rule.op is Op.CONCAT and jx.param(e, "dimension") == cut.axis
                side_by_side &= cut.blocks == 1
                ins = eqns[-1].ins  # (renamed)
                if side_by_side and len(ins) == len(cut.sizes) and not any(isinstance(x, tuple) for x in ins):
                    joined[n] = list(ins)
                else:
                    prog.pinned.add(n)
                continue
            starts = np.cumsum((0,) + cut.sizes[:-1]).tolist()
            boxes = [tuple((a, a + d) if k == cut.axis else (0, m) for k, m in enumerate(aval.shape))
                     for a, d in zip(starts, cut.sizes, strict=True)]  # fmt: skip
            shapes = tuple(tuple(b - a for a, b in box) for box in boxes)
            found, pieces = jx.equations(_cut_into(aval.shape, aval.dtype, cut.axis, cut.sizes, cut.blocks), [n],
                                         lambda: next(_NEW_IDS))  # fmt: skip
            eqns += [Eqn(*f[:4], e.source, e.callers) for f in found]
            prog.kinds.update(dict.fromkeys((o for f in found for o in f[3]), "act"))
            prog.pinned.update(x for x, pinned in zip(pieces, cut.pinned, strict=True) if pinned)
            us, along = uses.get(n, []), cut.blocks == 1  # (pieces that interleave are no slices)
            slices = {id(u): boxes.index(box) for u in us if (box := jx.slice_box(u.prim.name, u.params)) in boxes
                      and along}  # fmt: skip
            unstacks = [u for u in us if u.rule.op is Op.UNSTACK and set(cut.sizes) == {1} and along
                        and jx.param(u, "axis") % len(aval.shape) == cut.axis]  # fmt: skip
            if len(slices) + len(unstacks) == len(us) and n not in outs:  # read in pieces alone: they are the pieces
                for u in us:
                    dropped.add(id(u))
                    if id(u) in slices:
                        renamed[u.outs[0]] = pieces[slices[id(u)]]
                        continue
                    # an unstack (JAX 0.12's `list(z)`): each result is its piece, squeezed
                    for o, piece, pinned in zip(u.outs, pieces, cut.pinned, strict=True):
                        found, [renamed[o]] = jx.equations(_squeezed(shapes[0], aval.dtype, cut.axis), [piece],
                                                           lambda: next(_NEW_IDS))  # fmt: skip
                        eqns += [Eqn(*f[:4], e.source, e.callers) for f in found]
                        prog.kinds[renamed[o]] = "act"
                        if pinned:
                            prog.pinned.add(renamed[o])
                continue
            # something reads the node whole: it reads the pieces concatenated back
            found, [whole] = jx.equations(_joined(shapes, aval.dtype, cut.axis, cut.blocks), pieces,
                                          lambda: next(_NEW_IDS))  # fmt: skip
            eqns += [Eqn(*f[:4], e.source, e.callers) for f in found]
            joins = [o for f in found for o in f[3]]  # (the pieces side by side, then interleaved)
            prog.kinds.update(dict.fromkeys(joins, "act"))
            prog.cut.update(dict.fromkeys(joins) | {whole: cut})
            prog.joins.update(joins)
            renamed[n] = whole
            if n in outs:
                joined[whole] = pieces
    prog.eqns = eqns
    prog.out_ids = [renamed.get(x, x) if not isinstance(x, tuple) else x for x in prog.out_ids]
    return joined


@functools.lru_cache(maxsize=64)
def _cut_into(shape: tuple, dtype, axis: int, sizes: tuple, blocks: int):
    """The jaxpr of ``split`` along ``axis`` into ``sizes`` (`cut_nodes`); with ``blocks`` > 1, of pieces of equal
    sizes that interleave in that many blocks, laid out side by side first (`_swapped`)."""
    z = jax.ShapeDtypeStruct(shape, dtype)
    return jax.make_jaxpr(lambda z: jax.lax.split(_swapped(z, axis, blocks, len(sizes)), sizes, axis))(z)


@functools.lru_cache(maxsize=64)
def _joined(shapes: tuple, dtype, axis: int, blocks: int):
    """The jaxpr of ``concatenate`` along ``axis`` (`cut_nodes`), interleaved in ``blocks`` (`_swapped`)."""
    zs = [jax.ShapeDtypeStruct(s, dtype) for s in shapes]
    return jax.make_jaxpr(lambda *z: _swapped(jax.lax.concatenate(z, axis), axis, len(z), blocks))(*zs)


def _swapped(z, axis: int, outer: int, inner: int):
    """``z`` with axis ``axis`` read as (outer, inner, rest) and written as (inner, outer, rest): ``outer`` blocks
    of ``inner`` equal pieces each become the pieces side by side, each its blocks (and back, the counts swapped)."""
    if 1 in (outer, inner):
        return z
    shape = z.shape
    split = (*shape[:axis], outer, inner, shape[axis] // (outer * inner), *shape[axis + 1 :])
    return jnp.swapaxes(z.reshape(split), axis, axis + 1).reshape(shape)


@functools.lru_cache(maxsize=64)
def _squeezed(shape: tuple, dtype, axis: int):
    """The jaxpr of ``squeeze`` of ``axis`` (`cut_nodes`)."""
    return jax.make_jaxpr(lambda z: jax.lax.squeeze(z, (axis,)))(jax.ShapeDtypeStruct(shape, dtype))
