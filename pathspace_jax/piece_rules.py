"""The tracer's rules for a layer's output read in pieces (a mixin of `pathspace_jax.tracer.Interpreter`, beside
`pathspace_jax.shape_rules`): a fused kernel's output split, sliced, unstacked or reshaped first is one node group
per piece, side by side in an alias (`PieceRules._cut_in_pieces`), or interleaved in blocks where axes come before
the pieces' (GPT-NeoX's layout).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pathspace_jax import jaxpr as jx
from pathspace_jax.atoms import ACT, Val


class PieceRules:
    """``rule_split``, ``rule_unstack`` and the cutting of a layer's node axis into pieces (module docstring)."""

    def _reshaped_pieces(self, eqn, v: Val) -> Val | None:
        """A layer's output whose last axis is reshaped into ``(k, ...)`` and then read only in pieces of ``w`` entries
        of the k axis (``q, k, v = qkv.reshape(b, t, 3, h, d)[:, :, 0], ...``, or ``jnp.split`` along it): each piece
        is a group of its own, as where the last axis is cut before the reshape (`_piece_of_layer`), and the result
        carries the pieces' axes for the slices that read them (``Val.pieces``, `_cut_in_pieces`). Else None."""
        in_shape, shape, n = eqn.invars[0].aval.shape, tuple(jx.param(eqn, "new_sizes")), len(v.axes) - 1
        if v.kind != ACT or n < 0 or jx.param(eqn, "dimensions", None) is not None:
            return None
        if shape[:n] != tuple(in_shape[:n]) or len(shape) < n + 2:
            return None
        fs = self.atoms.factors(v.axes[n])
        if len(fs) != 1 or self.atoms.position[fs[0]] or not self._written_by_a_layer(fs[0]):
            return None
        return self._cut_in_pieces(v, fs[0], eqn.outvars[0], n, shape)

    def _cut_in_pieces(self, v: Val, flat: int, var, n: int, shape) -> Val | None:
        """``v`` with its node axis ``flat`` (one atom, a layer's output) seen as the axes ``n`` on of ``shape``, as
        the jaxpr variable ``var`` holds it, where every reader of ``var`` takes pieces of ``w`` entries of one axis
        ``c`` (`_piece_reads`): ``flat`` cut into a group per piece, each the product of the pieces' axes, and ``v``
        with axes ``shape``: its axis c stands for the groups side by side (an alias of them, for the flags of
        `pathspace_jax.trace.record`), and ``Val.pieces`` carries each piece's axes. Where c is axis n, the pieces are
        ranges of ``flat`` (`_cut`); where axes come before it (GPT-NeoX's ``qkv.reshape(b, t, heads, 3 * d)`` split
        on its last axis, ``nn.DenseGeneral((heads, 3, d))`` read along its middle axis), their entries interleave
        (`pathspace_jax.atoms.Atoms.blocks`), and each piece has axes of its own for them. Else None."""
        for c in range(n, len(shape)):
            reads = self._piece_reads(var, c, shape)
            w = next(iter(reads))[1] if len({w for _, w in reads}) == 1 else None  # (one width, else None)
            if w is not None and w < shape[c] and not any(a % w for a, _ in reads):
                break
        else:
            return None
        lead, k, rest = tuple(shape[n:c]), shape[c], tuple(shape[c + 1 :])
        if k < 2 or min(lead + rest, default=0) < 2 or not lead and not rest:
            return None
        blocks, m = int(np.prod(lead)), int(np.prod(rest))
        want = lead + ((w,) if w > 1 else ()) + rest
        if lead:  # interleaved: each piece its own atom (as an earlier reshape of the same output cut it, if one did)
            segs = self.atoms.alias[flat]
            if segs is None:
                segs = [self.atoms.new(blocks * w * m) for _ in range(k // w)]
                self.atoms.set_alias(flat, segs, blocks)
            elif self.atoms.blocks[flat] != blocks or len(segs) != k // w:
                return None
        else:  # ranges of ``flat`` (cut as an earlier reshape of the same output was, if it was)
            segs = [self._cut(flat, i * w * m, (i + 1) * w * m) for i in range(k // w)]
            if any(seg is None for seg in segs):
                return None
        segs, per = [self.atoms.find(seg) for seg in segs], []
        for seg in segs:
            if self.atoms.alias[seg] is not None:
                return None
            if len(want) > 1 and self.atoms.expand[seg] is None:
                self.atoms.set_expand(seg, [self.atoms.new(d) for d in want])
            axes = self.atoms.factors([seg])
            if [self.atoms.size[a] for a in axes] != list(want):
                return None
            if w == 1:  # (the piece's entry of axis c: one, squeezed by its reader)
                axes = [*axes[: len(lead)], self.atoms.new(1), *axes[len(lead) :]]
            per += [[*v.axes[:n], *[[a] for a in axes]]] * w  # (indexed by the entry a piece starts at)
        ks = self.atoms.new(k)
        self.atoms.alias[ks] = segs
        axes = [*v.axes[:n], *[[self.atoms.new(d)] for d in lead], [ks], *[[self.atoms.new(d)] for d in rest]]
        return dataclasses.replace(v, axes=axes, pieces=(c, per, flat, n))

    def _piece_reads(self, var, axis: int, shape) -> set[tuple[int, int | None]]:
        """``(start, width)`` of the entries of ``axis`` that each reader of the jaxpr variable ``var`` (of ``shape``)
        takes, whole elsewhere: a unit-stride slice, a split into equal parts or an unstack (start 0), or the same
        through a transpose (``qkv.transpose(2, 0, 3, 1, 4)[0]``); width None for anything else."""
        out = set()
        for u in self.consumers[-1].get(var, [None]):
            name = None if u is None else u.primitive.name
            if name == "transpose":
                perm = tuple(jx.param(u, "permutation"))
                out |= self._piece_reads(u.outvars[0], perm.index(axis), tuple(shape[p] for p in perm))
            elif name == "split" and jx.param(u, "axis") == axis:
                sizes = set(jx.param(u, "sizes"))
                out.add((0, sizes.pop()) if len(sizes) == 1 else (0, None))
            elif name == "unstack" and jx.param(u, "axis") % len(shape) == axis:
                out.add((0, 1))
            else:
                box = None if u is None else jx.slice_box(name, u.params)
                whole = box is not None and all((a, b) == (0, d) for j, ((a, b), d) in enumerate(zip(box, shape))
                                                if j != axis)  # fmt: skip
                out.add((box[axis][0], box[axis][1] - box[axis][0]) if whole else (0, None))
        return out

    @staticmethod
    def _piece(v: Val, start: int) -> Val:
        """The piece from entry ``start`` of a value seen in pieces (`_cut_in_pieces`, `kernel_pieces`)."""
        return dataclasses.replace(v, axes=[list(ax) for ax in v.pieces[1][start]], pieces=None)

    def _pieces(self, eqn, v: Val, axis: int, shapes) -> list[Val]:
        """``v`` cut along ``axis`` into consecutive pieces of ``shapes`` (`_piece_at`)."""
        starts = np.cumsum([0] + [shape[axis] for shape in shapes[:-1]]).tolist()
        return [self._piece_at(eqn, v, axis, a, shape, "splits an axis") for a, shape in zip(starts, shapes)]

    def _piece_at(self, eqn, v: Val, axis: int, start: int, shape, why: str) -> Val:
        """The piece of ``v`` of ``shape`` from entry ``start`` of ``axis``: a reshaped value's piece (`_piece`), a
        stacked leaf's layer (`_layer`), a group of a layer's output (`_piece_of_layer`), else resliced (the cut axis
        pinned unless it is positions)."""
        if v.pieces is not None and axis == v.pieces[0]:
            return self._piece(v, start)
        in_shape = eqn.invars[0].aval.shape
        piece = self._layer(v, in_shape, shape, axis, start) or self._piece_of_layer(v, axis, start, shape)
        if piece is not None:
            return piece
        others = [f for k, ax in enumerate(v.axes) if k != axis for f in self.atoms.factors(ax)]
        if v.kind == ACT and self.split_from_units(v.axes[axis], others):  # (GPT-NeoX's fused q, k, v)
            why = "cuts a layer's output along an axis that a reshape split off it, its pieces interleaved"
        return self._reslice(eqn, v, [k != axis for k in range(len(in_shape))], shape, why)

    def _piece_of_layer(self, v: Val, axis: int, start: int, shape) -> Val | None:
        """Entries ``start`` on of the node axis ``axis`` of an activation, a layer's output (a fused kernel's:
        ``q, k, v = jnp.split(x @ w + b, 3, -1)``, a gated unit's two halves): the piece as a group of its own, the
        layer's output axis those groups side by side, as a concatenation's is (`Atoms.set_alias`); or operands of a
        concatenation read back (`_bounds`); else None."""
        fs, end = self.atoms.factors(v.axes[axis]), start + shape[axis]
        if v.kind != ACT or len(fs) != 1 or self.atoms.position[fs[0]]:
            return None
        if not self._written_by_a_layer(fs[0]) and not {start, end} <= self._bounds(fs[0]):
            return None  # (a concatenation's operands are read back whole, never cut)
        if (piece := self._cut(fs[0], start, end)) is None:
            return None
        return dataclasses.replace(v, axes=[[piece] if k == axis else list(ax) for k, ax in enumerate(v.axes)])

    def _bounds(self, r: int) -> set[int]:
        """Where the groups side by side in the axis ``r`` (a concatenation's) begin and end; none where it is one."""
        if self.atoms.alias[r] is None or self.atoms.blocks[r] > 1:
            return set()
        sizes = [self.atoms.size[self.atoms.find(s)] for s in self.atoms.alias[r]]
        return set(np.cumsum([0, *sizes]).tolist())

    def _written_by_a_layer(self, r: int) -> bool:
        """Whether the root ``r`` is the output axis of a parameter's edges."""
        return r in self.layer_outputs()

    def layer_outputs(self) -> set[int]:
        """The roots of the axes that parameters' edges write (their output axes, role ``"out"``)."""
        return {self.atoms.find(a) for uses in self.uses for a, role, _, _ in uses if role == "out"}

    def _cut(self, a: int, lo: int, hi: int) -> int | None:
        """The atom of entries ``lo:hi`` of node axis ``a``, cutting ``a`` (or the groups side by side in it) where
        the range starts and ends; None where its groups interleave (`_cut_in_pieces`)."""
        r = self.atoms.find(a)
        n = self.atoms.size[r]
        if (lo, hi) == (0, n):
            return r
        if self.atoms.blocks[r] > 1:
            return None  # (its groups interleave: no range of its entries is one)
        if self.atoms.alias[r] is None:
            self.atoms.set_alias(r, [self.atoms.new(d) for d in (lo, hi - lo, n - hi) if d > 0])
        out, at = [], 0
        for s in self.atoms.alias[r]:
            d = self.atoms.size[self.atoms.find(s)]
            if max(lo, at) < min(hi, at + d):
                if (piece := self._cut(s, max(lo, at) - at, min(hi, at + d) - at)) is None:
                    return None
                out.append(piece)
            at += d
        if len(out) == 1:
            return out[0]
        whole = self.atoms.new(hi - lo)
        self.atoms.alias[whole] = out
        return whole

    def rule_split(self, eqn, ins):
        return self._pieces(eqn, ins[0], jx.param(eqn, "axis"), [var.aval.shape for var in eqn.outvars])

    def rule_unstack(self, eqn, ins):
        """``unstack`` (JAX 0.12+ iterates over an array with it: ``for w in ws``): a split into entries of one
        along the axis, each squeezed."""
        in_shape = eqn.invars[0].aval.shape
        axis = jx.param(eqn, "axis") % len(in_shape)
        one = tuple(1 if k == axis else d for k, d in enumerate(in_shape))
        parts = self._pieces(eqn, ins[0], axis, [one] * len(eqn.outvars))
        return [
            dataclasses.replace(
                p, axes=[ax for k, ax in enumerate(p.axes) if k != axis], scalars=p.scalars + p.axes[axis]
            )
            for p in parts
        ]
