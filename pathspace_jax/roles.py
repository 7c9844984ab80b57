"""Axis roles decided from the whole walk: which atoms are positions, inputs or pinned once every equation has
run (`settle`), and the facts the rules consult about what a kernel wrote (`split_from_units`, `weighted_along`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pathspace_jax.atoms import Val

if TYPE_CHECKING:
    from pathspace_jax.tracer import Walker


def settle(w: Walker) -> None:
    """Decide, once the whole function has run: the axes a layer shares its weights along (`shared_along`), the
    constants concatenated beside a layer's units (inputs, or pinned where a layer writes into them too:
    `rules_shape.side_by_side`), the input positions (`input_positions`), the `defer`red atoms, in order (a later
    one's source may be an earlier one's result), then the parameters reversed (views where along taps, else
    "other": `rules_shape.rule_rev`)."""
    _shared_positions(w)
    written, atoms = set(), w.atoms
    stack = [f for uses in w.uses for a, role, _, _ in uses if role == "out" for f in atoms.factors([a])]
    while stack:  # (an output axis unified with a concatenation's: the groups side by side in it too)
        r = atoms.find(stack.pop())
        if r not in written:
            written.add(r)
            stack += atoms.factors(atoms.alias[r] or [])
    for a, zero in w.beside:
        fs = atoms.factors([a])
        if any(f in written or atoms.position[f] for f in fs):
            if not zero:  # (zeros added to a layer's units are those units)
                atoms.pin(fs, "a constant concatenated beside a layer's units, and a layer writes into it")
        else:
            for f in fs:
                atoms.input[f] = True
    input_positions(w)
    for new, source, why, fixed in w.deferred:
        if all(w.atoms.position[f] for f in w.atoms.factors(source)):
            w.atoms.make_positions(new)
        elif not all(w.atoms.position[f] for f in w.atoms.factors(new)):
            w.atoms.pin(new, why)
            if fixed:  # the result, and what it was computed from (an input: the same value 1 in κ)
                w.fixed += new + source
    for v, axes, why in w.reversed:  # (along nodes: the entries of other nodes, the parameter no edge)
        if not all(atoms.position[f] for f in atoms.factors(axes)):
            w.other[v.leaf].append(why)
            atoms.pin(w.all_atoms(v), why)
    for axis, why in w.copied_into:  # (along positions and inputs: a bias shared by them, as usual)
        fs = atoms.factors(axis)  # (said only where no other reason pins them: a LayerNorm's mean has one)
        atoms.pin([f for f in fs if not (atoms.position[f] or atoms.input[f] or atoms.reasons[f])], why)


def split_from_units(w: Walker, axis: Sequence[int], kept: Sequence[int]) -> bool:
    """Whether ``axis`` is a factor of a kernel's output axis that a reshape split, whose other factors include
    some of the atoms ``kept`` (`rules_reduce.rule_reduce_max`: maxout's pieces; `pieces.piece_at`: interleaved
    pieces)."""
    reduced = set(w.atoms.factors(axis))
    return any(reduced < (fs := set(w.atoms.factors([r]))) and fs & set(kept) for r in w.layer_outputs())


def weighted_along(w: Walker, axis: Sequence[int]) -> bool:
    """Whether a parameter's entries differ along ``axis``: a kernel's output axis, or the result's side of a
    parameter's batch axis (`diagonal`; nn.ConvLocal's positions). A maximum along it keeps, per entry, the
    piece of one parameter's entries; `pathspace_jax.program.refuse_exclusive_branches` says what that means."""
    written = {f for r in w.layer_outputs() for f in w.atoms.factors([r])}
    written |= {f for ends in w.diagonal.values() for f in w.atoms.factors(ends)}
    return bool(written & set(w.atoms.factors(axis)))


def input_positions(w: Walker) -> None:
    """An input axis that a layer shares its weights along (``nn.Dense`` applied to every row of a ``(B, T, F)``
    input) and that kernels read only together with nodes (a head over the flattened ``T × units``) is a
    position, as an image's rows are for a convolution: the units rescale alike at every entry, and the head
    has one edge per position and unit. One that a kernel reads on its own (a token-mixing layer) stays an
    input axis, and so does the examples' axis, which no kernel reads."""
    atoms, reads = w.atoms, {}
    for uses in w.uses:
        by_use: dict[int, list[int]] = {}  # the factors that one use of a kernel reads, over all its read axes
        for a, role, step, _ in uses:
            if role == "in":  # (a flattened feature map concatenated with other features: its factors)
                by_use.setdefault(step, []).extend(atoms.resolve([a]))
        for fs in by_use.values():
            for f in fs:
                reads.setdefault(f, []).append(fs)
    for r in set(atoms.factors(list(w.shared_inputs))):
        if atoms.position[r] or r not in reads:
            continue
        if all(len(fs) > 1 and not all(atoms.input[f] for f in fs) for fs in reads[r]):
            atoms.make_positions([r])


def shared_along(w: Walker, x: Val, read: Sequence[int], free: Sequence[int]) -> None:
    """A layer reads the axes ``read`` of ``x`` with weights shared along its ``free`` axes. Where a free axis
    and a read one were written by one kernel (its output axes: ``nn.DenseGeneral`` with two feature axes, an
    ``nn.vmap``'d layer's members), the free axis is a position: the nodes are shared along it, as the
    weights are (the units of the read axis rescale alike at every entry of the free one). Noted, and decided
    by `settle` once every kernel has been seen."""
    for k in free:
        shared_input(w, x.axes[k])
        w.shared_along.append((list(x.axes[k]), [list(x.axes[j]) for j in read]))


def _shared_positions(w: Walker) -> None:
    """The axes noted by `shared_along` that one kernel wrote with an axis read beside them (`_written_with`):
    positions. One pass decides: which kernel wrote what is fixed once the walk is over, and an axis made positions
    needs nothing more."""
    atoms = w.atoms
    outs: dict[int, set[int]] = {}  # per leaf, the factors of the axes its kernel writes
    for leaf, uses in enumerate(w.uses):
        for a, role, _, _ in uses:
            if role == "out":
                outs.setdefault(leaf, set()).update(atoms.factors([a]))
    for axis, reads in w.shared_along:
        fs = atoms.factors(axis)  # (the examples' axis and other input axes are no kernel's)
        if not all(atoms.input[f] or atoms.position[f] for f in fs) and _written_with(w, axis, reads, outs.values()):
            atoms.make_positions(axis)


def shared_input(w: Walker, axis: Sequence[int]) -> None:
    """A layer shares its weights along ``axis``: if it is an input axis, perhaps a position (`input_positions`)."""
    fs = w.atoms.factors(axis)
    if w.size(axis) > 1 and all(w.atoms.input[f] and not w.atoms.position[f] for f in fs):
        w.shared_inputs.update(fs)


def _written_with(w: Walker, axis: Sequence[int], others: Sequence[Sequence[int]], outs) -> bool:
    """Whether ``axis`` and one of ``others`` (atom lists) were written by one kernel (``outs``: each kernel's output
    factors), as two of its output axes (``nn.DenseGeneral`` with two feature axes, an ``nn.vmap``'d layer's members
    and units). Axes of one entry say nothing (a batch of one example, a power iteration's row vector)."""
    others = [o for o in others if w.size(o) > 1]
    if w.size(axis) == 1 or not others:
        return False
    f, fs = set(w.atoms.factors(axis)), [set(w.atoms.factors(o)) for o in others]
    return any(f <= own and any(r and r <= own for r in fs) for own in outs)
