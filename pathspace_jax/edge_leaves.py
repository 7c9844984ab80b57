"""The edge leaves of a `PathSpace` (`leaf_edges`): every parameter leaf with the source and destination node of
each of its entries, as broadcast views of per-node arrays; a leaf stacked over layers (``nn.scan``) from its
layers' slices (`stack_layers`)."""

from __future__ import annotations

import numpy as np

from pathspace_jax.atoms import Atoms
from pathspace_jax.graph import BIAS_NODE, EdgeLeaf, node_view, reduced


def stack_nodes(per_layer: list[np.ndarray], shape) -> np.ndarray:
    """The node arrays of a leaf's layers stacked along a first axis, as a view of their small arrays."""
    small = [reduced(a)[0] for a in per_layer]
    common = np.broadcast_shapes(*(a.shape for a in small))
    return node_view(np.stack([np.broadcast_to(a, common) for a in small]), shape, shape)


def stack_layers(slices, leaves: list[EdgeLeaf]) -> list[EdgeLeaf]:
    """Each stacked params leaf from its layers' slices (``slices``: `Walker.layer_slice`'s, (leaf, layer) ->
    the slice's leaf): their source and destination nodes stacked along the first axis (deepest stacks first: a slice
    may itself be stacked)."""
    out = list(leaves)
    children: dict[int, list[int]] = {}
    for (leaf, _), j in sorted(slices.items()):  # by layer
        children.setdefault(leaf, []).append(j)
    for leaf in sorted(children, reverse=True):
        parts = [out[j] for j in children[leaf]]
        old, kinds = out[leaf], {p.kind for p in parts}
        if kinds == {"other"}:  # (`pathspace_jax.trace`: a leaf whose layers are not edges alike)
            neg = node_view(-1, old.shape, old.shape)
            note = "; ".join(dict.fromkeys(p.note for p in parts if p.note))
            out[leaf] = EdgeLeaf(old.path, old.shape, old.dtype, "other", (), (), neg, neg, note)
            continue
        src, dst = (stack_nodes([getattr(p, side) for p in parts], old.shape) for side in ("src", "dst"))
        groups = [tuple(sorted({g for p in parts for g in getattr(p, side)})) for side in ("src_groups", "dst_groups")]
        recurrent = any(p.recurrent for p in parts)
        out[leaf] = EdgeLeaf(old.path, old.shape, old.dtype, parts[0].kind, *groups, src, dst, "", recurrent)
    return out


def leaf_edges(atoms: Atoms, leaves, paths, leaf_info, groups, key_index) -> list[EdgeLeaf]:
    """Every leaf as an `EdgeLeaf`: the source and destination node of each entry."""
    offsets = np.array([g.offset for g in groups])

    def node_ids(root: int) -> np.ndarray:
        """Global node ids of the nodes along one (single-atom) group axis: of its groups side by side, in order (in
        blocks where they interleave, `Atoms.blocks`), each numbered row-major in its factors sorted by root (as
        `side` numbers a group of several factors)."""
        if atoms.alias[root] is None:
            return group_ids([root])
        ids = []
        for s in atoms.alias[root]:
            fs = atoms.factors([s])
            ids.append(node_ids(fs[0]) if len(fs) == 1 and atoms.alias[fs[0]] is not None else group_ids(fs))
        return np.concatenate([i.reshape(atoms.blocks[root], -1) for i in ids], axis=1).ravel()

    def group_ids(seg: list[int]) -> np.ndarray:
        """Global node ids of the entries of the group of factor roots ``seg``, laid out row-major in ``seg``'s order
        and numbered row-major in the roots' sorted order, positions left out."""
        sizes, local = [atoms.size[r] for r in seg], np.zeros((), np.int64)
        grids = np.meshgrid(*[np.arange(n) for n in sizes], indexing="ij")
        nodes = sorted((k for k in range(len(seg)) if not atoms.position[seg[k]]), key=lambda k: seg[k])
        if len(nodes) == 1 and atoms.alias[seg[nodes[0]]] is not None:  # groups side by side, at every position
            ids = node_ids(seg[nodes[0]]).reshape([-1 if k == nodes[0] else 1 for k in range(len(seg))])
            return np.broadcast_to(ids, sizes).ravel()
        for k in nodes:  # (the same nodes at every position of a flattened feature map)
            local = local * sizes[k] + grids[k]
        return groups[key_index[tuple(seg[k] for k in nodes)]].offset + np.broadcast_to(local, sizes).ravel()

    edge_leaves = []
    for i, (leaf, (kind, factors, node_in, node_out, note, _, ends)) in enumerate(zip(leaves, leaf_info)):
        shape = tuple(int(d) for d in leaf.shape)
        if kind == "other":
            neg = node_view(-1, shape, shape)
            edge_leaves.append(EdgeLeaf(paths[i], shape, str(leaf.dtype), "other", (), (), neg, neg, note))
            continue
        sizes = [atoms.size[r] for r in factors]

        def side(nodes: list[int], factors: list[int], shape=shape, sizes=sizes) -> tuple[np.ndarray, tuple[int, ...]]:
            """Global node of every entry on one side of the edge; nodes = positions of node factors."""

            def grid(k: int) -> np.ndarray:
                return np.arange(sizes[k]).reshape([-1 if j == k else 1 for j in range(len(sizes))])

            if not nodes:
                return node_view(BIAS_NODE, shape, shape), ()
            if len(nodes) == 1:
                ids = node_ids(factors[nodes[0]])
                gidx = np.searchsorted(offsets, np.unique(ids), side="right") - 1
                return node_view(ids[grid(nodes[0])], sizes, shape), tuple(sorted(set(gidx.tolist())))
            order = sorted(nodes, key=lambda k: factors[k])
            g = key_index[tuple(factors[k] for k in order)]
            local = np.zeros([1] * len(sizes), np.int64)
            for k in order:
                local = local * sizes[k] + grid(k)
            return node_view(groups[g].offset + local, sizes, shape), (g,)

        src, sg = side(node_in, factors)
        dst, dg = side(node_out, ends)
        edge_leaves.append(EdgeLeaf(paths[i], shape, str(leaf.dtype), kind, sg, dg, src, dst))
    return edge_leaves
