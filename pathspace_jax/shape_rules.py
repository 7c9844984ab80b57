"""The tracer's rules for primitives that move entries between axes: reshapes, transposes, broadcasts,
slices, pads, concatenations, splits, gathers and scatter-adds (a mixin of `pathspace_jax.tracer.Interpreter`).

Each rule maps the atoms of its operands' axes to the atoms of its results' axes: kept, merged into one
axis (a product structure in `pathspace_jax.atoms.Atoms`), split, or fresh where the result's entries are
positions (a slice of positions, a padding) rather than nodes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from pathspace_jax import jaxpr as jx
from pathspace_jax.atoms import ACT, CONST, PARAM, Val


class ShapeRules:
    """``rule_<primitive>`` methods for the primitives that rearrange entries (see the module docstring)."""

    # -- structure ---------------------------------------------------------------
    def rule_reshape(self, eqn, ins):
        """Factors are matched right to left (numpy's broadcasting convention), so
        ``(C,) -> (1, C)`` keeps the parameter's atom on the last axis."""
        v = ins[0]
        if (pieces := self._reshaped_pieces(eqn, v)) is not None:
            return [pieces]
        new_sizes = jx.param(eqn, "new_sizes")
        if (order := jx.param(eqn, "dimensions", None)) is not None:  # a transpose first (JAX's batching of conv)
            v = dataclasses.replace(v, axes=[v.axes[p] for p in order])
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
                    self.atoms.set_expand(self.atoms.find(f), [first, rest])
                    flat[k : k + 1] = [first, rest]
                    k += 1
                else:
                    return self.unknown(eqn, ins)
            if p != d:
                return self.unknown(eqn, ins)
            out.append(cur)
        scalars.extend(flat[: k + 1])
        return [dataclasses.replace(v, axes=out[::-1], scalars=scalars)]

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

    def _ids(self, a: int) -> list[int]:
        """Like `Atoms.factors` but keeps atom ids where there is no product structure."""
        r = self.atoms.find(a)
        if self.atoms.expand[r] is None:
            return [a]
        return [x for c in self.atoms.expand[r] for x in self._ids(c)]

    def rule_squeeze(self, eqn, ins):
        return [self._squeezed(ins[0], jx.param(eqn, "dimensions"))]

    @staticmethod
    def _squeezed(v: Val, dimensions) -> Val:
        """``v`` without its axes ``dimensions`` (each of one entry): their atoms become scalars."""
        dims = {d % len(v.axes) for d in dimensions}
        gone = [a for k in sorted(dims) for a in v.axes[k]]
        return dataclasses.replace(
            v, axes=[ax for k, ax in enumerate(v.axes) if k not in dims], scalars=v.scalars + gone
        )

    def rule_transpose(self, eqn, ins):
        v, perm = ins[0], jx.param(eqn, "permutation")
        if v.pieces is not None:  # (`_cut_in_pieces`)
            k, per, flat, _ = v.pieces  # (its node axes no longer from one axis on: no bias of pieces after it)
            per = [[axes[p] for p in perm] for axes in per]
            v = dataclasses.replace(v, pieces=(list(perm).index(k), per, flat, None))
        return [dataclasses.replace(v, axes=[v.axes[p] for p in perm])]

    def rule_broadcast_in_dim(self, eqn, ins):
        v = ins[0]
        shape = jx.param(eqn, "shape")
        out = self.fresh(shape)
        in_shape = eqn.invars[0].aval.shape
        fresh = [a for ax in out for a in ax]
        for k, d in enumerate(jx.param(eqn, "broadcast_dimensions")):
            if in_shape[k] == shape[d]:
                out[d] = list(v.axes[k])
        if v.kind != CONST:  # copies along the new axes: units there rescale alike (`Interpreter.rule_add`)
            self.copies.update(a for a in fresh if self.atoms.size[a] > 1 and any(a in ax for ax in out))
        if v.kind == ACT and self.fully_pinned(v):  # copies of a pinned value, along new axes: pinned too
            self.atoms.pin([a for ax in out for a in ax if a in fresh], self.reason("a pinned value broadcast"))
        elif self._of_inputs(v):
            for a in fresh:  # an input given an axis of one entry (``t[:, None]``: one input feature per example)
                if self.atoms.size[a] == 1:
                    self.atoms.input[a] = True
        return [dataclasses.replace(v, axes=out)]

    def _of_inputs(self, v: Val) -> bool:
        """Whether ``v`` is an activation whose atoms are all the inputs' (an input, or a view of one)."""
        return v.kind == ACT and all(self.atoms.input[f] for ax in v.axes for f in self.atoms.factors(ax))

    def _reslice(self, eqn, v: Val, keep: Sequence[bool], out_shape, why: str) -> Val:
        """Axes that are not kept get fresh atoms; the old atoms are pinned (a node group may not be cut), which
        does nothing to positions (time, space). The part of an axis that turns out not to be positions is new
        nodes, pinned too (`Interpreter.defer`): a layer that reads it is an edge from a pinned group (an LSTM's
        gates sliced out of one product), never a bias."""
        out = []
        for k, d in enumerate(out_shape):
            if keep[k] or self.size(v.axes[k]) == d == 1:
                out.append(list(v.axes[k]))
            else:
                if v.kind == PARAM:
                    self.mark_other(v, why)
                self.atoms.pin(v.axes[k], self.reason(why))
                out.append([self.atoms.new(d)])
                self.defer(out[-1], v.axes[k], self.reason(why))
        return dataclasses.replace(v, axes=out)

    def _layer(self, v: Val, in_shape, out_shape, axis: int, start: int) -> Val | None:
        """Entry ``start`` of the first axis of a whole params leaf, sliced out statically (layers stacked in one
        leaf and read in a loop: ``ws[i]``, ``for w in ws``, ``jnp.split(ws, n)``): that layer's slice as a leaf of
        its own (`Interpreter.layer_slice`), as ``nn.scan`` over the layers reads it; else None."""
        whole = v.kind == PARAM and not v.scaled and v.axes == self.leaf_axes[v.leaf]
        if not whole or axis != 0 or in_shape[0] == 1 or out_shape != (1, *in_shape[1:]):
            return None
        leaf = self.layer_slice(v.leaf, int(start))
        return Val(PARAM, [[self.atoms.new(1)], *[list(ax) for ax in self.leaf_axes[leaf]]], leaf=leaf)

    def rule_slice(self, eqn, ins):
        return [self._slice(eqn, ins[0], jx.param(eqn, "start_indices"))]

    def _slice(self, eqn, v: Val, start) -> Val:
        in_shape, out_shape = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
        keep = [a == b for a, b in zip(in_shape, out_shape)]
        cut = [k for k, same in enumerate(keep) if not same]
        strides = jx.param(eqn, "strides", None) or ()
        if start is not None and len(cut) == 1 and (out_shape[cut[0]] == 1 or all(s in (None, 1) for s in strides)):
            return self._piece_at(eqn, v, cut[0], start[cut[0]], out_shape, "slices part of an axis")
        return self._reslice(eqn, v, keep, out_shape, "slices part of an axis")

    def rule_rev(self, eqn, ins):
        """Reversed axes are new atoms (a group's nodes reversed are pinned, positions stay positions: `_reslice`),
        but a parameter reversed along axes that turn out to be a convolution's taps (``nn.ConvTranspose(...,
        transpose_kernel=True)``, a transposed convolution written with the flipped kernel) is the same kernel, its
        taps in the other order (`pathspace_jax.tracer.Interpreter.settle` checks)."""
        v, dims = ins[0], jx.param(eqn, "dimensions")
        if v.kind == PARAM:
            self.reversed.append((v, [a for k in dims for a in v.axes[k]], self.reason("reverses a parameter")))
            return [dataclasses.replace(v)]
        keep = [k not in dims for k in range(len(v.axes))]
        return [self._reslice(eqn, v, keep, eqn.outvars[0].aval.shape, "reverses the nodes of a group")]

    def rule_dynamic_slice(self, eqn, ins):
        """A dynamic slice at starts that are all known (``ws[i]`` in a loop over layers unrolled by its counter,
        `Interpreter.rule_scan`) is recorded as the static slice it is there; else its starts are unknown."""
        starts = [v.id[1] if isinstance(v.id, tuple) else None for v in ins[1:]]
        if None in starts:
            return [self._slice(eqn, ins[0], None)]
        as_ = jx.static_slice(eqn, starts)
        return self.record(eqn, ins[:1], [self._slice(eqn, ins[0], as_[1]["start_indices"])], as_=as_)

    def rule_pad(self, eqn, ins):
        """Padding keeps the atoms of the axes it does not pad; a padded axis is positions where the original is
        (`_reslice`). Zeros padded at either end of the last axis of a layer's output, a single group (channels
        padded: a CIFAR ResNet's parameter-free shortcut, ``jnp.pad(x, (..., (0, 0), (c, c)))``), are the zeros
        concatenated beside its units (`side_by_side`)."""
        v, pad = ins
        if v.kind == ACT and not pad.zero:
            self.pin(v, "pads with a non-zero value")
        out_shape = eqn.outvars[0].aval.shape
        config = jx.param(eqn, "padding_config")
        keep = [cfg == (0, 0, 0) for cfg in config]
        if v.kind == ACT and pad.zero and all(keep[:-1]) and not keep[-1]:
            if (axes := self._zero_channels(v, config[-1], out_shape[-1])) is not None:
                return [dataclasses.replace(v, axes=axes)]
        return [self._reslice(eqn, v, keep, out_shape, "pads an axis")]

    def _zero_channels(self, v: Val, config, size: int) -> list[list[int]] | None:
        """``v``'s axes with its last padded by zeros (``config``: ``(lo, hi, interior)``) into ``size`` entries, as the
        zeros concatenated beside its units (`side_by_side`); None where that axis is not one group of a layer's
        units or the padding is not at its ends."""
        (lo, hi, interior), fs = config, self.atoms.factors(v.axes[-1])
        if interior or lo < 0 or hi < 0 or len(fs) != 1 or self.atoms.input[fs[0]] or self.atoms.position[fs[0]]:
            return None
        segs = []
        for d in (lo, None, hi):
            if d is None:
                segs.append(fs[0])
            elif d > 0:
                segs.append(self.atoms.new(d))
                self.beside.append((segs[-1], True))
        new = self.atoms.new(size)
        self.atoms.alias[new] = segs
        return [*v.axes[:-1], [new]]

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
        return [Val(kind, out)]

    def rule_concatenate(self, eqn, ins):
        shapes = [var.aval.shape for var in eqn.invars]
        return [self._concatenate(ins, shapes, jx.param(eqn, "dimension"), eqn.outvars[0].aval.shape)]

    def rule_stack(self, eqn, ins):
        """``jnp.stack`` (a primitive of its own in the JAX versions supported): the operands side by side along a new
        axis of positions, as a scan stacks its steps (a Python loop's states: the same units at every step). Whole
        params leaves of one shape stacked along a new first axis and read only by scans over it (per-layer params
        stacked for ``lax.scan``) are held as those leaves (`Val.layers`): each layer of the scan reads its own."""
        axis = jx.param(eqn, "axis")
        if (
            axis == 0
            and self._scanned_over(eqn.outvars[0])
            and all(v.kind == PARAM and not v.scaled and v.axes == self.leaf_axes[v.leaf] for v in ins)
        ):
            axes = [[self.atoms.new(len(ins))], *[[self.atoms.new(self.size(ax))] for ax in ins[0].axes]]
            return [Val(CONST, axes, from_params=True, layers=tuple(ins))]
        parts = [dataclasses.replace(v, axes=[*v.axes[:axis], [], *v.axes[axis:]]) for v in ins]
        return [self._concatenate(parts, None, axis, eqn.outvars[0].aval.shape)]

    def _scanned_over(self, var) -> bool:
        """Whether the jaxpr variable ``var`` is read only as the scanned operand (xs) of scans."""
        uses = self.consumers[-1].get(var, [])
        for u in uses:
            if u is None or u.primitive.name != "scan":
                return False
            sc = jx.scan(u)
            if any(x is var for x in u.invars[: sc.num_consts + sc.num_carry]):
                return False
        return bool(uses)

    def rule_tile(self, eqn, ins):
        """``jnp.tile`` (a primitive of its own, as ``stack``): the operand concatenated with itself ``reps[k]``
        times along each axis k."""
        v, shape = ins[0], tuple(eqn.invars[0].aval.shape)
        for k, r in enumerate(jx.param(eqn, "reps")):
            out = (*shape[:k], shape[k] * r, *shape[k + 1 :])
            if r != 1 and shape[k] == 1 and v.kind != ACT:  # copies of one entry: a broadcast (a class token's)
                axes = [*v.axes[:k], [self.atoms.new(r)], *v.axes[k + 1 :]]
                v = dataclasses.replace(v, axes=axes, scalars=v.scalars + list(v.axes[k]))
            elif r != 1:
                v = self._concatenate([v] * r, [shape] * r, k, out)
            shape = out
        return [v]

    def _concatenate(self, ins: Sequence[Val], in_shapes, dim: int, shape) -> Val:
        """``ins`` (of ``in_shapes``) concatenated along axis ``dim`` into ``shape``: the other axes are tied; the
        result's axis ``dim`` is the operands' groups side by side (an alias), or positions where one of them has
        no single group (pinned), or, where ``in_shapes`` is None, positions of one entry per operand (a stack). A
        parameter concatenated with activations is a bias at its entries of the result (a ViT's class token put
        before the patches: a bias into their units at the first position)."""
        acts = [v for v in ins if v.kind == ACT]
        biases = [v for v in ins if v.kind == PARAM and not v.scaled] if self._along_positions(acts, dim) else []
        for v in ins:
            if not any(v is b for b in biases):
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
            segs = None if in_shapes is None else self.side_by_side(ins, in_shapes, k)
            if segs is not None:
                self.atoms.alias[new] = segs
            elif in_shapes is None and all(map(self._of_inputs, ins)):  # inputs stacked: ``jnp.stack([x, y], -1)``
                self.atoms.input[new] = True  # an input axis (positions where layers share weights along it)
            else:
                self.atoms.position[new] = True
                for v in ins if in_shapes is not None else ():  # (a stack's operands have no such axis)
                    self.atoms.pin(v.axes[k], self.reason("concatenates along an axis of mixed structure"))
            out.append([new])
        for v in biases:
            self.use(v, self.all_atoms(v), "out")
        zero = kind == CONST and all(v.zero for v in ins)
        return Val(kind, out, zero=zero)

    def _along_positions(self, acts: Sequence[Val], dim: int) -> bool:
        """Whether axis ``dim`` of the activations ``acts`` (some) is positions, or input entries that a layer has
        shared its weights along (`pathspace_jax.tracer.Interpreter.shared_along`): never the nodes of a layer."""
        shared = set(self.atoms.factors(list(self.shared_inputs)))
        fs = [f for v in acts for f in self.atoms.factors(v.axes[dim])]
        return bool(fs) and all(self.atoms.position[f] or f in shared for f in fs)

    def side_by_side(self, ins: Sequence[Val], in_shapes, k: int) -> list[int] | None:
        """The groups of the operands' axis ``k``, one atom each (empty operands left out; an operand's axis of several
        factors, a convolution's output flattened with its positions, one atom made of them), else None. A constant
        beside activations (CoordConv's coordinate channels, a constant feature) is a group of inputs of its own:
        the layers reading the result read it with edges from inputs (`Interpreter.settle` decides: where a layer
        writes into them too, a residual added, they are pinned, or, zeros, that layer's units)."""
        segs, atoms = [], self.atoms
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
                self.beside.append((segs[-1], v.zero))
            elif in_shape[k] > 0:
                return None
        return segs

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

    def rule_scatter_add(self, eqn, ins):
        """``operand.at[ids].add(updates)`` with constant ``ids``: a segment sum (a graph network's messages summed
        into its nodes). The window axes of the updates are the operand's (same nodes); the axes the ids index
        and the updates' other axes are summed over, which pins them unless they are positions (graph nodes,
        edges), as a reduction does. A non-zero operand is an offset unless it is an activation itself."""
        return self._scatter(eqn, ins, identity=False)

    def rule_scatter_max(self, eqn, ins):
        """``operand.at[ids].max(updates)`` with constant ``ids``: a segment max (``jax.ops.segment_max``, a graph
        network's max aggregation), read as `rule_scatter_add`; its operand is −∞ (what ``segment_max`` leaves in
        a segment no update reaches), 0, or an activation: a constant other than those is an offset."""
        return self._scatter(eqn, ins, identity=self._all_neg_inf(ins[0]))

    def rule_scatter(self, eqn, ins):
        """``x.at[ids].set(0)`` with constant ``ids`` on an activation: some entries set to zero, the others x's (the
        same nodes; a zero scales with any factor). Setting other values, or by computed ids, is not known to be
        positively homogeneous."""
        op, idx, upd = ins
        if op.kind == ACT and idx.kind == CONST and upd.kind == CONST and upd.zero:
            return [Val(ACT, [list(ax) for ax in op.axes], scalars=list(op.scalars))]
        return self.unknown(eqn, ins)

    def _all_neg_inf(self, v) -> bool:
        """Whether a constant is −∞ everywhere (the identity of ``max``), as far as the trace can compute it."""
        c = self.rec.value(v.id) if v.kind == CONST else None
        return c is not None and c.size > 0 and bool(np.all(np.isneginf(c)))

    def _scatter(self, eqn, ins, identity: bool):
        op, idx, upd = ins
        dn = jx.param(eqn, "dimension_numbers")
        window = [k for k in range(len(op.axes)) if k not in dn.inserted_window_dims]
        whole = all(self.size(upd.axes[w]) == self.size(op.axes[k]) for w, k in zip(dn.update_window_dims, window))
        if idx.kind != CONST or PARAM in (op.kind, upd.kind) or dn.operand_batching_dims or not whole:
            return self.unknown(eqn, ins)
        for w, k in zip(dn.update_window_dims, window, strict=True):
            self.atoms.unify(upd.axes[w], op.axes[k], self.reason())
        for k in dn.scatter_dims_to_operand_dims:
            self.atoms.pin(op.axes[k], self.reason("scatters into an axis"))
        for k in range(len(upd.axes)):
            if k not in dn.update_window_dims:
                self.atoms.pin(upd.axes[k], self.reason("sums over the nodes of a group"))
        if upd.kind == ACT and op.kind == CONST and not op.zero and not identity:
            self.pin(upd, "adds a constant offset")
        kind = ACT if ACT in (op.kind, upd.kind) else CONST
        return [Val(kind, [list(ax) for ax in op.axes], zero=op.zero and upd.zero)]

    def _known_row(self, eqn, op: Val, idx: Val):
        """A gather of one known row of a whole params leaf (``jnp.take(ws, i, axis=0)`` with a Python ``i``): layer
        i of a leaf of stacked layers, recorded as the static slice and squeeze that ``ws[i]`` is; else None."""
        in_shape, out_shape = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
        rows = idx.id[1] if isinstance(idx.id, tuple) else None
        if rows is None or np.shape(rows) != (1,) or not 0 <= int(rows[0]) < in_shape[0] or out_shape != in_shape[1:]:
            return None
        if not jx.is_row_lookup(eqn.params, len(in_shape), tuple(in_shape[1:]), len(out_shape)):
            return None
        i = int(rows[0])
        layer = self._layer(op, in_shape, (1, *in_shape[1:]), 0, i)
        if layer is None:
            return None
        as_slice, as_squeeze = jx.static_row(eqn, i)
        [sliced] = self.record(eqn, [op], [layer], as_=as_slice)
        return self.record(eqn, [sliced], [self._squeezed(sliced, (0,))], as_=as_squeeze)

    def rule_gather(self, eqn, ins):
        op, idx = ins[0], ins[1]
        dn = jx.param(eqn, "dimension_numbers")
        slice_sizes = jx.param(eqn, "slice_sizes")
        in_shape = eqn.invars[0].aval.shape
        out_shape = eqn.outvars[0].aval.shape
        if (row := self._known_row(eqn, op, idx)) is not None:
            return row
        if idx.kind != CONST:
            return self.unknown(eqn, ins)
        # an index axis batched with an operand axis (take_along_axis: one index per example) keeps its entries
        batched = dict(zip(dn.start_indices_batching_dims, dn.operand_batching_dims, strict=True))
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
            elif b in batched:
                out.append(list(op.axes[batched[b]]))
                b += 1
            else:
                ax = batch_axes[b] if b < len(batch_axes) else []
                b += 1
                out.append(list(ax) if self.size(ax) == out_shape[k] else [self.atoms.new(out_shape[k], position=True)])
                if op.kind == PARAM:  # a table looked up along the ids' axes: shared along them, as a layer's weights
                    self.shared_input(out[-1])
        for k in dn.start_index_map:
            if op.kind == PARAM:
                # an embedding lookup: rows of the table are edges from one-hot inputs
                for a in self.atoms.factors(op.axes[k]):
                    self.atoms.input[a] = True
                self.use(op, op.axes[k], "in")
            elif op.axes[k]:
                self.atoms.pin(op.axes[k], self.reason("indexes into an axis"))
        return [Val(ACT if op.kind in (ACT, PARAM) else CONST, out)]
