"""Each params leaf's role in the traced network (a weight, a bias, or "other": no edge tensor) and the batch axes
that stay nodes of their own, decided from the whole walk (`resolve`, run by `pathspace_jax.trace`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pathspace_jax.atoms import Atoms

if TYPE_CHECKING:
    from pathspace_jax.tracer import Walker


def resolve(interp: Walker, leaves, paths) -> list[tuple]:
    """Per leaf ``(kind, factor roots, node_in, node_out, note, first_step, ends)`` (`_roles`), once the batch
    axes of `Walker.diagonal` that cannot be nodes of their own are positions (`_shared_diagonals`).

    Those are found by a fixpoint: the roles are computed without changing the atoms, the batch axes they show
    shared become positions (the only change made), and so on until none is; then the roles' pins and positions
    are applied once. Nothing is undone, and the result depends on the whole walk, not on the order of its
    equations."""
    atoms = interp.atoms
    _match_diagonals(atoms, interp.diagonal)
    outputs_shared: set = set()  # batch axes whose output side alone is positions
    while True:
        leaf_info, pins = _roles(interp, leaves, paths)
        leaf_info, positions = _bias_positions(atoms, leaf_info)
        shared = _shared_diagonals(interp, leaf_info, outputs_shared, positions)
        if not shared:
            break
        for axis, both in shared:
            if both:
                atoms.unify(list(axis[1]), interp.diagonal.pop(axis), "a batch axis shared by a layer")
                atoms.make_positions(list(axis[1]))
            else:  # (the members summed after the layer: its inputs' members stay nodes of their own)
                atoms.make_positions(interp.diagonal[axis])
                outputs_shared.add(axis)
    for axes, why in pins:
        atoms.pin(axes, why)
    for r in positions:
        atoms.position[r] = True
    return leaf_info


def _roles(interp: Walker, leaves, paths) -> tuple[list[tuple], list[tuple[list[int], str]]]:
    """Per leaf ``(kind, factor roots, node_in, node_out, note, first_step, ends)``: the role of every factor of
    every axis; a leaf that is not an edge tensor is "other" (its atoms pinned, ``note`` says why). ``ends``: the
    roots on the output side, the factor roots but for a batch axis (`Walker.diagonal`), whose entries are
    input nodes by the one and output nodes by the other. With the pins that says (applied by `resolve`)."""
    atoms = interp.atoms
    find = atoms.find

    # Roles are kept per atom id (not per root): a recurrent kernel's two axes share a root but not an id.
    def expand_roles(a: int, role: str | None, roles: dict[int, str]) -> list[tuple[int, str | None]]:
        role = roles.get(a, role)
        r = find(a)
        if atoms.expand[r] is None:
            return [(r, role)]
        return [x for c in atoms.expand[r] for x in expand_roles(c, role, roles)]

    stacked = {leaf for leaf, _ in interp.slices}
    diagonal: dict[int, dict[int, int]] = {}  # leaf -> {input-side root: output-side root} of its batch axes
    for (leaf, ins), outs in interp.diagonal.items():
        diagonal.setdefault(leaf, {}).update(zip(atoms.factors(list(ins)), atoms.factors(outs)))
    leaf_info, pins = [], []  # (kind, factors, node_in, node_out, note, first_step, ends); (atoms, reason)
    for i in range(len(leaves)):
        if i in stacked:  # its layers' slices are the leaves (`pathspace_jax.edge_leaves.stack_layers`)
            leaf_info.append(("other", [], None, None, "", 0, []))
            continue
        note = "; ".join(dict.fromkeys(interp.other[i]))
        roles: dict[int, str] = {}
        sites: dict[int, tuple] = {}
        for a, role, _, site in interp.uses[i]:
            if roles.get(a, role) != role and not note:
                before, now = interp.line(sites[a]), interp.line(site)
                note = f"one axis used with two roles ({roles[a]} at {before}, {role} at {now})"
            roles[a], sites[a] = role, site
            if a in interp.apart.get(i, ()) and not note:  # (`Walker.flattened`)
                note = f"read as one node axis cut into pieces and again with its axes apart, at {interp.line(site)}"
        first_step = min((s for _, _, s, _ in interp.uses[i]), default=0)
        factors = [f for ax in interp.leaf_axes[i] for a in ax for f in expand_roles(a, None, roles)]
        kind = "other"
        if not note and any(role is None for _, role in factors):
            note = "some axes are neither contracted nor produced by an edge"
        roots = [r for r, _ in factors]
        ends = [diagonal[i].get(r, r) if role == "diag" else r for r, role in factors] if i in diagonal else roots
        if not note:
            # positions of the factors that are nodes (the others are taps)
            node_in = [k for k, (r, role) in enumerate(factors) if role in ("in", "diag") and not atoms.position[r]]
            node_out = [k for k, (_, role) in enumerate(factors) if role in ("out", "diag")]
            node_out = [k for k in node_out if not atoms.position[ends[k]]]  # a batch axis: its output side
            kind = "weight" if node_in else "bias"
            if not node_out:
                note = "no output node axis"
            elif len(node_out) > 1 and any(atoms.alias[factors[k][0]] is not None for k in node_out):
                note = "its output axes are cut into groups along an output axis that is not the first"
        if note and interp.uses[i] and " at " not in note:  # where the leaf is first used as an edge
            note += f", used at {interp.line(interp.uses[i][0][3])}"
        if note:
            pins.append((roots + ends, f"{paths[i]} is not an edge tensor ({note})"))
            leaf_info.append(("other", roots, None, None, note, first_step, ends))
        else:
            leaf_info.append((kind, roots, node_in, node_out, "", first_step, ends))
    for leaf in sorted(stacked, reverse=True):  # deepest stacks first: a layer's slice may itself be stacked
        _unstackable(interp, leaves, paths, leaf, leaf_info, pins)
    return leaf_info, pins


def _unstackable(interp: Walker, leaves, paths, leaf: int, leaf_info: list, pins: list) -> None:
    """A stacked leaf is one edge bundle per layer only where every layer is read, each in the same role, and the
    leaf is not also read whole: otherwise its layers' slices are "other" too (their units pinned), and so is the
    leaf (`pathspace_jax.edge_leaves.stack_layers`)."""

    def slices(parent):  # the leaves that hold the parent's entries: its layers' slices, theirs if stacked again
        kids = [j for (p, _), j in interp.slices.items() if p == parent]
        return [k for j in kids for k in slices(j)] if kids else [parent]

    read, parts = sum(parent == leaf for parent, _ in interp.slices), slices(leaf)
    kinds = {leaf_info[j][0] for j in parts}
    if read < leaves[leaf].shape[0]:
        note = f"reads {read} of its {leaves[leaf].shape[0]} layers"
    elif interp.uses[leaf] or interp.other[leaf]:
        note = "read whole as well as layer by layer"
    elif len(kinds) > 1:  # a weight and a bias, or an edge and "other"
        note = "its layers have different roles"
    else:
        return
    for j in parts:
        kind, roots, _, _, _, first_step, ends = leaf_info[j]
        if kind != "other":
            pins.append((roots + ends, f"{paths[leaf]} is not an edge tensor ({note})"))
            leaf_info[j] = ("other", roots, None, None, note, first_step, ends)


def _bias_positions(atoms: Atoms, leaf_info: list[tuple]) -> tuple[list[tuple], set[int]]:
    """A bias that varies along more axes than the nodes a weight enters (a learned per-position bias
    ``h + pos[None]``) is one bias per node and position: its other axes are positions, as a convolution's are
    (returned, applied by `resolve`)."""
    weight_keys = [frozenset(e[k] for k in out) for kind, _, _, out, _, _, e in leaf_info if kind == "weight"]
    out, positions = [], set()
    for kind, factors, node_in, node_out, note, step, ends in leaf_info:
        if kind == "bias":
            mine = frozenset(factors[k] for k in node_out)
            nodes = max((key for key in weight_keys if key < mine), key=len, default=mine)
            for k in node_out:
                if factors[k] not in nodes:
                    positions.add(factors[k])
            node_out = [k for k in node_out if factors[k] in nodes]
        out.append((kind, factors, node_in, node_out, note, step, ends))
    return out, positions


def _match_diagonals(atoms: Atoms, diagonal: dict) -> None:
    """Split the two sides of each batch axis alike, where a later layer split one of them (a grouped convolution
    after a depthwise one: its groups are blocks of the depthwise channels)."""
    for _ in range(len(diagonal)):  # a split may unmatch another axis that shares the atom
        unmatched = 0
        for (_, ins), outs in diagonal.items():
            a, b = atoms.factors(list(ins)), atoms.factors(outs)
            if [atoms.size[r] for r in a] != [atoms.size[r] for r in b]:
                unmatched += 1
                why = "a batch axis split by a later layer"
                atoms.unify(a, [atoms.new(atoms.size[r]) for r in b], why)  # a split where b is
                atoms.unify(b, [atoms.new(atoms.size[r]) for r in atoms.factors(a)], why)  # and b where a is
        if not unmatched:
            return


def _shared_diagonals(interp: Walker, leaf_info: list[tuple], outputs_shared: set, positions: set) -> list[tuple]:
    """The batch axes of `Walker.diagonal` whose entries cannot be nodes of their own, each with whether on
    both sides (False: on the output side alone, the layer's input side's members staying nodes of their own).

    A parameter's batch axis in a ``dot_general`` (an ensemble's members under ``nn.vmap``, a mixture's experts:
    one weight matrix per entry) or a grouped convolution's groups make each entry part of the nodes on both
    sides: node (member, unit) feeds node (member, unit') only. That holds while every layer keeps the members
    apart; where one does not (a bias or a weight shared by all members, a layer that contracts the members
    alone, or the axis turns out to be space or time), the axis is a position instead, the nodes shared by all
    its entries: still a symmetry, a smaller one. Where only the output side's groups clash (the members summed
    after the layer, as a mixture of experts sums them), only that side is positions: each member's units before
    the layer stay nodes of their own (node (member, unit) feeds unit' shared by the members, at the member's
    position). A per-unit scale's axis (`Walker.scales`) is no batch axis: where the group it reads clashes
    with another, `_node_groups` pins that group, and the scale stays an edge.
    """
    atoms = interp.atoms
    both: dict = {}  # axis -> shared on both sides (True where any reason says so)
    roots = {}
    for axis, ends in interp.diagonal.items():
        ins, outs = atoms.factors(list(axis[1])), atoms.factors(ends)
        same = [atoms.size[r] for r in ins] == [atoms.size[r] for r in outs]
        if not same or axis not in outputs_shared and any(atoms.position[r] or r in positions for r in outs):
            both[axis] = True
        roots.update((r, (axis, True)) for r in ins)
        roots.update((r, (axis, False)) for r in outs if r not in roots)
    keys = {frozenset(f[k] for k in node_in) for _, f, node_in, _, _, _, _ in leaf_info if node_in}
    keys |= {frozenset(e[k] for k in node_out) for _, _, _, node_out, _, _, e in leaf_info if node_out}
    for key, other in clashes(keys):  # `_node_groups` would pin both; a member axis among them is shared instead
        for axis, side in (roots[t] for t in key | other if t in roots and roots[t][0] not in interp.scales):
            both[axis] = both.get(axis, False) or side or axis in outputs_shared  # (side: its input side clashes)
    return list(both.items())


def clashes(keys):
    """The pairs of node-group keys that share a root: a layer reads or writes a group only in part, along with
    other axes, so neither can be rescaled consistently."""
    seen: dict[int, Any] = {}
    for key in keys:
        for r in key:
            if r in seen:
                yield key, seen[r]
            seen[r] = key
