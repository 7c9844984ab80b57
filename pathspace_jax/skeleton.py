"""The skeleton method of G-SGD (Meng et al., ICLR 2019): skeleton edges, the gauge, and basis paths.

For every **hidden** node v the skeleton holds

* one **incoming** skeleton edge ``inskel(v) = parent(v) -> v``: a *weight* entry (never a bias:
  Flax initialises biases to zero, and the incoming chain is a divisor) from a node strictly closer
  to the inputs, by breadth-first depth from the *start* nodes (inputs and pinned nodes), and never
  an edge within one node group (recurrent kernels, residual self-loops);
* one **outgoing** skeleton edge ``outskel(v) = v -> child(v)``: a weight entry to a node strictly
  closer to the outputs, by breadth-first distance to the *end* nodes (outputs and pinned nodes),
  never within one group.

Depth strictly decreases along both chains, so they are acyclic and end at boundary nodes: following
``parent`` from v reaches an input or pinned node, following ``child`` reaches an output or pinned
node. The H outgoing skeleton edges are the **gauge**: they carry no path coordinate. Every other
entry ``e = u -> v`` is the middle edge of its **basis path**

    [incoming skeleton chain of u] + e + [outgoing skeleton chain of v],

whose value is the coordinate of e (`pathspace_jax.coords`). There are m − H of them and their
incidence matrix has rank m − H (order the rows by depth: it is triangular on the non-gauge
columns).

Which admissible edge? Two rules, both commuting with rescaling:

* **by value** (`choose_by_value`; opt-in, ``trace(..., skeleton="values")``, stored in
  ``PathSpace.skeleton_edges``): in
  order of depth, v takes the incoming edge ``u -> v`` with the largest ``|w_{u->v}| · |A_u|`` (A_u:
  the product along u's chosen incoming chain), and in order of distance to the outputs the outgoing
  edge ``v -> y`` with the largest ``|w_{v->y}| · |B_y|``. Under a rescaling all candidates of v scale
  alike, so the choice is the same for every rescaling of the params. The chains then carry the
  largest path values, so G-SGD's divisors ``A_u B_v`` stay away from zero. With the index rule, a
  chain through one small initial weight makes ``A_u B_v`` tiny (10⁻⁵–10⁻⁸ at a standard init), and
  a step ``η g / (A_u B_v)²`` would diverge at any learning rate SGD uses; G-SGD therefore divides by
  the rescaling-invariant `pathspace_jax.coord_scales` instead, and trains with either rule.
* **by index** (``trace``'s default: from the graph alone, so one space serves any params), in the
  spirit of Alg. 1 of the G-SGD-for-RNNs paper (``M[j][j % n_in] = 1``): the k-th hidden node of a group takes the
  ``k mod n``-th admissible neighbour (in node order), and among parallel edges between the same two
  nodes (conv kernel taps) the middle one in flat order — the centre tap of an odd kernel. It also
  decides for nodes whose value candidates are all zero.

Fallbacks, documented because they make a divisor possibly zero: a hidden node that no weight edge
reaches from a start node may take a bias edge as its incoming skeleton edge; a hidden node with no
admissible edge at all raises ``ValueError``.

Everything here is numpy at Python time, computed once per `PathSpace` (``functools.lru_cache`` on
the hashable space).
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np

from pathspace_jax.graph import BIAS_NODE, PathSpace

__all__ = ["Skeleton", "skeleton", "choose_by_value"]


@dataclasses.dataclass(frozen=True, eq=False)
class LeafIndex:
    """Static index arrays of one parameter leaf.

    Attributes:
      kind: the leaf's kind (``weight``, ``bias``, ``other``).
      offset: index of the leaf's first entry in ``ravel_pytree(params)[0]``.
      src_r, dst_r: the leaf's ``src`` / ``dst`` node arrays reduced to the smallest shape that
        broadcasts back to the leaf (a Dense kernel's src is ``(n_in, 1)``, a conv kernel's
        ``(1, 1, c_in, 1)``), so that node vectors are gathered with O(nodes) work, not O(m).
      sum_axes: the axes along which ``src`` is constant (summing over them gives per-src sums);
        ``dst_sum_axes`` likewise for ``dst``.
      gauge_flat, gauge_node: flat indices (in the leaf) of its gauge entries and their source nodes.
      inskel_flat, inskel_node: flat indices of its (incoming) skeleton entries and their target nodes.
    """

    kind: str
    offset: int
    src_r: np.ndarray
    dst_r: np.ndarray
    sum_axes: tuple[int, ...]
    gauge_flat: np.ndarray
    inskel_flat: np.ndarray
    inskel_node: np.ndarray
    dst_sum_axes: tuple[int, ...] = ()
    gauge_key: np.ndarray | None = None
    inskel_key: np.ndarray | None = None
    gauge_node: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))

    def flat_iota(self, shape):
        """``arange(size).reshape(shape)`` as an XLA iota: fuses into elementwise code, no memory."""
        return jnp.arange(int(np.prod(shape, dtype=np.int64)), dtype=jnp.int32).reshape(shape)

    def gauge_mask(self, shape):
        """Bool array of ``shape``, True at the gauge entries (a fused compare, not a scatter), or None."""
        return None if self.gauge_key is None else self.flat_iota(shape) == self.gauge_key

    def inskel_mask(self, shape):
        """Bool array of ``shape``, True at the (non-gauge) in-skeleton entries, or None."""
        return None if self.inskel_key is None else self.flat_iota(shape) == self.inskel_key


@dataclasses.dataclass(frozen=True, eq=False)
class Skeleton:
    """The skeleton of a `PathSpace` (see the module docstring). All arrays are numpy.

    Attributes:
      hidden: bool, per node: True at hidden nodes.
      parent, child: per node, the other end of the incoming / outgoing skeleton edge (the node
        itself at boundary nodes).
      in_leaf, in_flat: per node, the leaf index and flat index of its incoming skeleton edge (-1 at
        boundary nodes); ``out_leaf``, ``out_flat`` likewise for the outgoing one (the gauge).
      in_is_gauge: per node, True when its incoming skeleton edge is also the gauge edge of its parent.
      depth_in, depth_out: number of skeleton edges on the longest incoming / outgoing chain.
      leaves: one `LeafIndex` per parameter leaf.
    """

    hidden: np.ndarray
    parent: np.ndarray
    child: np.ndarray
    in_leaf: np.ndarray
    in_flat: np.ndarray
    out_leaf: np.ndarray
    out_flat: np.ndarray
    in_is_gauge: np.ndarray
    depth_in: int
    depth_out: int
    leaves: tuple[LeafIndex, ...]
    num_nodes: int

    def chain_in_global(self) -> np.ndarray:
        """``(num_nodes, depth_in)``: ravel indices of each node's incoming chain, boundary first, -1 padded."""
        return self._chains(self.parent, self.in_leaf, self.in_flat, self.depth_in, reverse=True)

    def chain_out_global(self) -> np.ndarray:
        """``(num_nodes, depth_out)``: ravel indices of each node's outgoing chain, node first, -1 padded."""
        return self._chains(self.child, self.out_leaf, self.out_flat, self.depth_out, reverse=False)

    def _chains(self, nxt, leaf, flat, depth, reverse):
        offsets = np.array([li.offset for li in self.leaves] + [0], np.int64)
        edge = np.where(leaf >= 0, offsets[leaf] + flat, -1)
        out = np.full((self.num_nodes, max(depth, 0)), -1, np.int64)
        cur = np.arange(self.num_nodes)
        for k in range(depth):
            out[:, k] = edge[cur]
            cur = nxt[cur]
        if reverse:  # boundary first: left-justify the reversed non-padding entries
            out = out[:, ::-1]
            order = np.argsort(out == -1, axis=1, kind="stable")
            out = np.take_along_axis(out, order, axis=1)
        return out


def _reduce(a: np.ndarray) -> tuple[np.ndarray, tuple[int, ...]]:
    """The smallest array broadcasting back to ``a`` (size-1 axes where ``a`` is constant), and those axes."""
    axes = []
    for k in range(a.ndim):
        first = np.take(a, [0], axis=k) if a.shape[k] else a
        if a.shape[k] > 1 and np.array_equal(np.broadcast_to(first, a.shape), a):
            a = first
            axes.append(k)
        elif a.shape[k] == 1:
            axes.append(k)
    return np.ascontiguousarray(a), tuple(axes)


def _bfs(num_nodes, start, src, dst):
    """Breadth-first distance from ``start`` along edges ``src -> dst`` (int64 arrays); -1 if unreachable."""
    dist = np.full(num_nodes, -1, np.int64)
    dist[start] = 0
    frontier = start.copy()
    d = 0
    if src.size == 0:
        return dist
    order = np.argsort(src, kind="stable")
    s_sorted, d_sorted = src[order], dst[order]
    while frontier.any():
        d += 1
        nodes = np.flatnonzero(frontier)
        lo = np.searchsorted(s_sorted, nodes, "left")
        hi = np.searchsorted(s_sorted, nodes, "right")
        idx = np.concatenate([np.arange(a, b) for a, b in zip(lo, hi)]) if len(nodes) else np.zeros(0, np.int64)
        reached = np.unique(d_sorted[idx]) if idx.size else np.zeros(0, np.int64)
        reached = reached[dist[reached] < 0]
        dist[reached] = d
        frontier = np.zeros(num_nodes, bool)
        frontier[reached] = True
    return dist


def _choose(num_nodes, cand_node, cand_other, cand_leaf, cand_flat, rank_in_group):
    """For each node, one candidate edge: the (rank mod n)-th distinct neighbour, its middle parallel edge.

    ``cand_*`` are parallel arrays over candidate edges (``cand_node`` the node choosing, ``cand_other``
    the neighbour). Returns per-node leaf and flat index and the neighbour (-1 where none).
    """
    leaf = np.full(num_nodes, -1, np.int64)
    flat = np.full(num_nodes, -1, np.int64)
    other = np.full(num_nodes, -1, np.int64)
    if cand_node.size == 0:
        return leaf, flat, other
    order = np.lexsort((cand_flat, cand_leaf, cand_other, cand_node))
    cn, co, cl, cf = cand_node[order], cand_other[order], cand_leaf[order], cand_flat[order]
    starts = np.flatnonzero(np.r_[True, cn[1:] != cn[:-1]])
    ends = np.r_[starts[1:], cn.size]
    for a, b in zip(starts, ends):
        v = cn[a]
        nb = co[a:b]
        firsts = np.flatnonzero(np.r_[True, nb[1:] != nb[:-1]])  # distinct neighbours, sorted
        k = rank_in_group[v] % firsts.size
        lo = a + firsts[k]
        hi = a + (firsts[k + 1] if k + 1 < firsts.size else b - a)
        mid = lo + (hi - lo) // 2  # middle parallel edge: the centre tap of an odd kernel
        leaf[v], flat[v], other[v] = cl[mid], cf[mid], co[mid]
    return leaf, flat, other


def _key(n, nodes, flats, node_r):
    """Per entry of a reduced node array: the flat index of that node's special entry in the leaf (-1 if none)."""
    if nodes.size == 0:
        return None
    per_node = np.full(n, -1, np.int64)
    per_node[nodes] = flats
    key = per_node[node_r].astype(np.int32)
    key.flags.writeable = False
    return key


@dataclasses.dataclass(frozen=True, eq=False)
class Candidates:
    """The edges of a space flattened over its edge leaves, and which may be skeleton edges (numpy)."""

    src: np.ndarray
    dst: np.ndarray
    lid: np.ndarray  # leaf index
    flat: np.ndarray  # flat index in the leaf
    ravel: np.ndarray  # index into ravel_pytree(params)[0] (increasing)
    is_bias: np.ndarray
    incoming: np.ndarray  # bool: admissible incoming skeleton edge of its dst
    outgoing: np.ndarray  # bool: admissible outgoing skeleton edge of its src
    depth: np.ndarray  # per node: BFS depth from the start nodes along weight edges (-1: unreachable)
    dist: np.ndarray  # per node: BFS distance to the end nodes
    hidden: np.ndarray
    rank: np.ndarray  # per node: index within its group


def candidates(space: PathSpace) -> Candidates:
    n = space.num_nodes
    kinds = space.node_kinds()  # 0 bias, 1 input, 2 hidden, 3 output, 4 pinned
    hidden = kinds == 2
    group = np.full(n, -1, np.int64)
    rank = np.zeros(n, np.int64)
    for gi, g in enumerate(space.groups):
        group[g.offset : g.offset + g.size] = gi
        rank[g.offset : g.offset + g.size] = np.arange(g.size)

    # all edges, flattened (numpy, one pass over m)
    srcs, dsts, lids, flats, ravels = [], [], [], [], []
    offset = 0
    for li, leaf in enumerate(space.leaves):
        if leaf.kind != "other":
            srcs.append(leaf.src.reshape(-1).astype(np.int64))
            dsts.append(leaf.dst.reshape(-1).astype(np.int64))
            lids.append(np.full(leaf.size, li, np.int64))
            flats.append(np.arange(leaf.size, dtype=np.int64))
            ravels.append(offset + flats[-1])
        offset += leaf.size
    cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0, np.int64)  # noqa: E731
    src, dst = cat(srcs), cat(dsts)
    is_bias = src == BIAS_NODE
    ok = (~is_bias) & (group[src] != group[dst])  # weight edges between different groups
    start = (kinds == 1) | (kinds == 4)
    end = (kinds == 3) | (kinds == 4)
    depth = _bfs(n, start, src[ok], dst[ok])
    dist = _bfs(n, end, dst[ok], src[ok])
    return Candidates(
        src=src,
        dst=dst,
        lid=cat(lids),
        flat=cat(flats),
        ravel=cat(ravels),
        is_bias=is_bias,
        # incoming: a weight edge from a strictly shallower node; outgoing: to a node strictly closer to the end
        incoming=ok & hidden[dst] & (depth[src] >= 0) & (depth[dst] >= 0) & (depth[src] < depth[dst]),
        outgoing=ok & hidden[src] & (dist[dst] >= 0) & (dist[src] >= 0) & (dist[dst] < dist[src]),
        depth=depth,
        dist=dist,
        hidden=hidden,
        rank=rank,
    )


def choose_by_value(space: PathSpace, leaves) -> tuple[np.ndarray, np.ndarray]:
    """The skeleton edges of the largest path values: per node, the index into ``ravel_pytree(params)[0]``.

    In order of depth, node v takes the admissible incoming edge ``u -> v`` with the largest
    ``|w_{u->v}| · |A_u|`` (``|A_u|``: the product along u's chosen incoming chain, 1 at start nodes); in
    order of distance to the outputs, the admissible outgoing edge ``v -> y`` with the largest
    ``|w_{v->y}| · |B_y|``. Every candidate of v scales by the same factor (α_v, resp. 1/α_v) under a
    node-wise rescaling, so the choice is the same for every rescaling of the params (ties go to the
    lowest index). ``-1`` where all candidates are zero (the index rule decides there).

    Args:
      space: a `PathSpace`.
      leaves: concrete parameter leaves (numpy-convertible), in the space's leaf order.

    Returns:
      ``(incoming, outgoing)``: int64 arrays of length ``space.num_nodes``.
    """
    c = candidates(space)
    mag = [
        np.abs(np.asarray(w, np.float64)).reshape(-1) for w, leaf in zip(leaves, space.leaves) if leaf.kind != "other"
    ]
    mag = np.concatenate(mag) if mag else np.zeros(0)

    def pick(sel, level, node, other, factor):
        chosen = np.full(space.num_nodes, -1, np.int64)
        for d in range(1, int(level.max(initial=0)) + 1):
            e = np.flatnonzero(sel & (level[node] == d))
            if not e.size:
                continue
            score, v_of = mag[e] * factor[other[e]], node[e]
            best = np.full(space.num_nodes, -1.0)
            np.maximum.at(best, v_of, score)
            top = np.flatnonzero(score == best[v_of])  # increasing: a node's first is its lowest index
            v, first = np.unique(v_of[top], return_index=True)
            factor[v] = best[v]
            chosen[v] = np.where(best[v] > 0, c.ravel[e[top[first]]], -1)
        chosen.setflags(write=False)
        return chosen

    ones = lambda: np.ones(space.num_nodes)  # noqa: E731
    return (
        pick(c.incoming, c.depth, c.dst, c.src, ones()),
        pick(c.outgoing, c.dist, c.src, c.dst, ones()),
    )


def _prefer(c: Candidates, preferred, leaf, flat, other, other_end):
    """Replace the index rule's choice by ``preferred`` (ravel indices, -1: keep) where given."""
    if preferred is None or not (preferred >= 0).any():
        return leaf, flat, other
    v = np.flatnonzero(preferred >= 0)
    k = np.searchsorted(c.ravel, preferred[v])
    leaf, flat, other = leaf.copy(), flat.copy(), other.copy()
    leaf[v], flat[v], other[v] = c.lid[k], c.flat[k], other_end[k]
    return leaf, flat, other


@functools.lru_cache(maxsize=64)
def skeleton(space: PathSpace) -> Skeleton:
    """The skeleton of ``space`` (cached per space). See the module docstring for the rule."""
    n = space.num_nodes
    c = candidates(space)
    src, dst, lid, flat, hidden, rank, is_bias = c.src, c.dst, c.lid, c.flat, c.hidden, c.rank, c.is_bias
    pref_in, pref_out = space.skeleton_edges or (None, None)

    sel = c.incoming
    in_leaf, in_flat, parent = _choose(n, dst[sel], src[sel], lid[sel], flat[sel], rank)
    in_leaf, in_flat, parent = _prefer(c, pref_in, in_leaf, in_flat, parent, src)
    missing = hidden & (in_leaf < 0)
    if missing.any():  # fallback: a bias edge (documented: the divisor may then be zero)
        selb = is_bias & missing[dst]
        bl, bf, bp = _choose(n, dst[selb], src[selb], lid[selb], flat[selb], rank)
        in_leaf = np.where(missing, bl, in_leaf)
        in_flat = np.where(missing, bf, in_flat)
        parent = np.where(missing, bp, parent)
    sel = c.outgoing
    out_leaf, out_flat, child = _choose(n, src[sel], dst[sel], lid[sel], flat[sel], rank)
    out_leaf, out_flat, child = _prefer(c, pref_out, out_leaf, out_flat, child, dst)
    for name, arr in (("incoming", in_leaf), ("outgoing", out_leaf)):
        bad = np.flatnonzero(hidden & (arr < 0))
        if bad.size:
            raise ValueError(
                f"no admissible {name} skeleton edge for hidden node(s) {bad[:10].tolist()}: the node is not "
                f"connected to the {'inputs' if name == 'incoming' else 'outputs'} by weight edges"
            )

    nodes = np.arange(n)
    parent = np.where(hidden, parent, nodes)
    child = np.where(hidden, child, nodes)
    in_is_gauge = hidden & hidden[parent] & (in_leaf == out_leaf[parent]) & (in_flat == out_flat[parent])

    def chain_len(nxt):
        length = np.zeros(n, np.int64)
        cur = nodes.copy()
        for _ in range(n + 1):
            active = hidden[cur]
            if not active.any():
                return int(length.max()) if n else 0
            length += active
            cur = nxt[cur]
        raise AssertionError("skeleton chain has a cycle")  # cannot happen: depth strictly decreases

    depth_in, depth_out = chain_len(parent), chain_len(child)

    leaf_idx = []
    offset = 0
    for li, leaf in enumerate(space.leaves):
        if leaf.kind == "other":
            z = np.zeros(0, np.int64)
            li_obj = LeafIndex("other", offset, z, z, (), z, z, z)
        else:
            src_r, sum_axes = _reduce(np.asarray(leaf.src, np.int64))
            dst_r, dst_sum_axes = _reduce(np.asarray(leaf.dst, np.int64))
            g_nodes = np.flatnonzero(hidden & (out_leaf == li))
            i_nodes = np.flatnonzero(hidden & (in_leaf == li) & ~in_is_gauge)
            li_obj = LeafIndex(
                leaf.kind,
                offset,
                src_r,
                dst_r,
                sum_axes,
                out_flat[g_nodes],
                in_flat[i_nodes],
                i_nodes,
                dst_sum_axes,
                _key(n, g_nodes, out_flat[g_nodes], src_r),
                _key(n, i_nodes, in_flat[i_nodes], dst_r),
                g_nodes,
            )
        leaf_idx.append(li_obj)
        offset += leaf.size

    return Skeleton(
        hidden=hidden,
        parent=parent,
        child=child,
        in_leaf=np.where(hidden, in_leaf, -1),
        in_flat=np.where(hidden, in_flat, -1),
        out_leaf=np.where(hidden, out_leaf, -1),
        out_flat=np.where(hidden, out_flat, -1),
        in_is_gauge=in_is_gauge,
        depth_in=depth_in,
        depth_out=depth_out,
        leaves=tuple(leaf_idx),
        num_nodes=n,
    )
