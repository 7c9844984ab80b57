"""The skeleton method of G-SGD (Meng et al., ICLR 2019): skeleton edges, the gauge, and basis paths.

For every **hidden** node v the skeleton holds

* one **incoming** skeleton edge ``inskel(v) = parent(v) -> v``: a *weight* entry (never a bias:
  Flax initialises biases to zero, and the incoming chain is a divisor) from a node strictly closer
  to the inputs, by breadth-first depth from the *start* nodes (inputs and pinned nodes), and never
  an edge within one node group (recurrent kernels, residual self-loops);
* one **outgoing** skeleton edge ``outskel(v) = v -> child(v)``: a weight entry to a node strictly
  closer to the outputs, by breadth-first distance to the *end* nodes (outputs, pinned nodes, and the
  inputs that edges enter: a residual stream that begins with the input itself, as in an MLP-Mixer),
  never within one group.

Depth strictly decreases along both chains, so they are acyclic and end at boundary nodes (never
rescaled): following ``parent`` from v reaches an input or pinned node, following ``child`` reaches an
output, pinned or input node. The H outgoing skeleton edges are the **gauge**: they carry no path
coordinate. Every other entry ``e = u -> v`` is the middle edge of its **basis path**

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
  ``k mod n``-th of its n admissible neighbours, listed leaf by leaf (in leaf order) and within a leaf by node,
  and among the parallel edges from that neighbour in that leaf (conv kernel taps) the middle one in flat
  order — the centre tap of an odd kernel. It also decides for nodes whose value candidates are all zero.

Fallbacks, documented because they make a divisor possibly zero: a hidden node that no weight edge
reaches from a start node may take a bias edge as its incoming skeleton edge; a hidden node with no
admissible edge at all raises ``ValueError``.

Everything here is numpy at Python time, computed once per `PathSpace` (``functools.lru_cache`` on
the hashable space), in O(nodes) memory and time per leaf for the index rule: a leaf's edges are read as a
`Bundle` (the small node arrays behind its ``src`` and ``dst`` views and the flat offsets of its axes), never
as one array per parameter entry. The value rule reads every entry's magnitude, one leaf at a time.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np

from pathspace_jax.graph import PathSpace, reduced

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


@dataclasses.dataclass(frozen=True, eq=False)
class Bundle:
    """The edges of one edge leaf, by node, in O(nodes) numbers for an O(params) leaf.

    The leaf's axes regrouped into those along which both ends vary (B: e.g. the layer axis of a stacked kernel),
    only the source (S), only the destination (D), and neither (P: parallel edges, a conv kernel's taps): entry
    ``(b, s, d, p)`` goes from ``src[b, s]`` to ``dst[b, d]`` and has flat index ``fb[b] + fs[s] + fd[d] + fp[p]``
    in the leaf; ``perm`` orders the leaf's axes as B, S, D, P.
    """

    leaf: int
    kind: str
    src: np.ndarray
    dst: np.ndarray
    fb: np.ndarray
    fs: np.ndarray
    fd: np.ndarray
    fp: np.ndarray
    perm: tuple[int, ...]

    def ends(self, forward: bool):
        """``(me, them, f_me, f_them)``: the end that chooses an edge on one side, and the other end."""
        return (self.dst, self.src, self.fd, self.fs) if forward else (self.src, self.dst, self.fs, self.fd)


def _bundle(li: int, leaf) -> Bundle:
    src_r, dst_r = reduced(leaf.src)[0], reduced(leaf.dst)[0]
    shape, ndim = leaf.shape, len(leaf.shape)
    strides = [int(np.prod(shape[k + 1 :], dtype=np.int64)) for k in range(ndim)]
    role = [(src_r.shape[k] > 1, dst_r.shape[k] > 1) for k in range(ndim)]
    b, s, d, p = ([k for k in range(ndim) if role[k] == r] for r in ((1, 1), (1, 0), (0, 1), (0, 0)))

    def offsets(axes):  # flat offset of every point of the grid over ``axes``, in C order
        o = np.zeros(1, np.int64)
        for k in axes:
            o = (o[:, None] + np.arange(shape[k], dtype=np.int64) * strides[k]).ravel()
        return o

    fb, fs, fd, fp = offsets(b), offsets(s), offsets(d), offsets(p)
    perm = tuple(b + s + d + p)
    src = src_r.transpose(perm).reshape(fb.size, fs.size).astype(np.int64)
    dst = dst_r.transpose(perm).reshape(fb.size, fd.size).astype(np.int64)
    return Bundle(li, leaf.kind, src, dst, fb, fs, fd, fp, perm)


@functools.lru_cache(maxsize=64)
def bundles(space: PathSpace) -> tuple[Bundle, ...]:
    """The `Bundle` of every non-empty edge leaf, in leaf order (cached per space)."""
    return tuple(_bundle(li, leaf) for li, leaf in enumerate(space.leaves) if leaf.kind != "other" and leaf.size)


def _group_of(space: PathSpace) -> np.ndarray:
    group = np.full(space.num_nodes, -1, np.int64)
    for gi, g in enumerate(space.groups):
        group[g.offset : g.offset + g.size] = gi
    return group


def _relax(num_nodes: int, edges: tuple[Bundle, ...], group, start, forward: bool) -> np.ndarray:
    """Breadth-first distance from the ``start`` nodes along weight edges between different groups (forward:
    from sources to destinations; backward: the reverse), -1 where unreachable. Bellman-Ford on the bundles:
    each sweep relaxes every bundle in O(its nodes), in leaf order (backward: reversed), until nothing changes."""
    far = num_nodes + 1
    level = np.where(start, 0, far)
    changed = True
    while changed:
        changed = False
        for bd in edges if forward else edges[::-1]:
            me, them, _, _ = bd.ends(forward)
            lt, gt, gm = level[them], group[them], group[me]
            cand = np.full(me.shape, far)
            for g in np.unique(gt):  # the nearest end of another group than me
                near = np.minimum(np.where(gt == g, lt, far).min(axis=1, keepdims=True) + 1, far)
                cand = np.where(gm != g, np.minimum(cand, near), cand)
            better = cand < level[me]
            if better.any():
                np.minimum.at(level, me[better], cand[better])
                changed = True
    return np.where(level >= far, -1, level)


@functools.lru_cache(maxsize=64)
def levels(space: PathSpace) -> tuple[np.ndarray, np.ndarray]:
    """``(depth, dist)`` per node: breadth-first depth from the start nodes (inputs and pinned nodes) and distance to
    the end nodes (outputs, pinned nodes, and inputs that edges enter: a residual stream that begins with the input
    itself, as an MLP-Mixer's), along weight edges between different node groups; -1: unreachable. Read-only,
    cached per space."""
    kinds = space.node_kinds()  # 0 bias, 1 input, 2 hidden, 3 output, 4 pinned
    group, edges = _group_of(space), tuple(bd for bd in bundles(space) if bd.kind == "weight")
    entered = np.zeros(space.num_nodes, bool)
    for bd in edges:
        entered[bd.dst.ravel()] = True
    ends = (kinds == 3) | (kinds == 4) | ((kinds == 1) & entered)  # never rescaled, as the outputs
    out = tuple(_relax(space.num_nodes, edges, group, n, fw) for n, fw in (((kinds == 1) | (kinds == 4), 1), (ends, 0)))
    for a in out:
        a.setflags(write=False)
    return out


def _repeats(nodes: np.ndarray) -> np.ndarray:
    """Per row of a bundle's node array: whether some node appears in it more than once."""
    by_node = np.sort(nodes, axis=1)
    return (by_node[:, 1:] == by_node[:, :-1]).any(axis=1)


def _choose(space: PathSpace, chooses, forward: bool, bias: bool = False):
    """Per node where ``chooses``: one edge on one side by the index rule, as ``(leaf, flat, other end)`` (-1: none).

    Forward, node v takes an incoming edge ``u -> v``: the admissible ones (`levels`) listed leaf by leaf in leaf
    order and, within a leaf, by source node; v takes the ``(rank_v mod count)``-th, rank_v its index in its group,
    and of that source's parallel edges the middle one in flat order (the centre tap of an odd kernel). Backward
    likewise with the outgoing edges ``v -> y``. ``bias``: among v's bias edges, whatever the levels.
    """
    n = space.num_nodes
    level = levels(space)[0 if forward else 1]
    group, rank = _group_of(space), np.zeros(n, np.int64)
    for g in space.groups:
        rank[g.offset : g.offset + g.size] = np.arange(g.size)
    found = []  # per bundle with a choosing node: (bundle, rows, cols, counts, cum, which key, order)
    for bd in bundles(space):
        if bd.kind != ("bias" if bias else "weight"):
            continue
        me, them, _, _ = bd.ends(forward)
        rows, cols = np.nonzero(chooses[me])
        if not rows.size:
            continue
        _, once = np.unique(rows * n + me[rows, cols], return_index=True)  # a node repeated along me's axes: once
        rows, cols = rows[np.sort(once)], cols[np.sort(once)]
        order = np.argsort(them, axis=1, kind="stable")
        by_node = np.take_along_axis(them, order, axis=1)
        # one admissibility row per distinct (row, level, group) of the choosing nodes: O(nodes), not O(params)
        keys = np.stack([rows, level[me[rows, cols]], group[me[rows, cols]]], axis=1)
        keys, which = np.unique(keys, axis=0, return_inverse=True)
        lt, gt = level[by_node[keys[:, 0]]], group[by_node[keys[:, 0]]]
        adm = np.ones(lt.shape, bool) if bias else (lt >= 0) & (lt < keys[:, 1:2]) & (gt != keys[:, 2:3])
        adm[:, 1:] &= by_node[keys[:, 0], 1:] != by_node[keys[:, 0], :-1]  # a node repeated along S: count it once
        cum = np.cumsum(adm, axis=1)
        which = which.reshape(-1)
        found.append((bd, rows, cols, cum[which, -1], cum, which, order))
    leaf, flat, other = (np.full(n, -1, np.int64) for _ in range(3))
    if not found:
        return leaf, flat, other
    node = np.concatenate([f[0].ends(forward)[0][f[1], f[2]] for f in found])
    count = np.concatenate([f[3] for f in found])
    o = np.argsort(node, kind="stable")  # by node, then leaf order, then position: each node's candidate list
    before = np.cumsum(count[o]) - count[o]
    first = np.r_[True, node[o][1:] != node[o][:-1]]
    before -= np.maximum.accumulate(np.where(first, before, 0))
    start = np.empty_like(before)
    start[o] = before
    total = np.bincount(node, weights=count, minlength=n).astype(np.int64)
    k = rank[node] % np.maximum(total[node], 1) - start  # the candidate's index within its own instance
    hit = (count > 0) & (k >= 0) & (k < count)
    at = 0
    for bd, rows, cols, _, cum, which, order in found:
        sel = slice(at, at + rows.size)
        at += rows.size
        h = hit[sel]
        r, c, w, kk = rows[h], cols[h], which[h], k[sel][h]
        me, them, f_me, f_them = bd.ends(forward)
        width = cum.shape[1] + 1  # the rows of cum made one increasing sequence, for one vectorised search
        rising = (cum + width * np.arange(len(cum))[:, None]).ravel()
        pos = np.searchsorted(rising, kk + 1 + width * w) - w * (width - 1)
        s = order[r, pos]
        v = me[r, c]
        leaf[v], other[v] = bd.leaf, them[r, s]
        flat[v] = bd.fb[r] + f_them[s] + f_me[c] + bd.fp[bd.fp.size // 2]
        # rare (a flattened pooling): a node repeated along S or D, its parallel edges there too
        for i in np.flatnonzero(_repeats(them)[r] | _repeats(me)[r]):
            b = r[i]
            flats = f_them[them[b] == other[v[i]]][:, None, None] + f_me[me[b] == v[i]][:, None] + bd.fp
            flat[v[i]] = bd.fb[b] + np.sort(flats.ravel())[flats.size // 2]
    return leaf, flat, other


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
    n, group, hidden = space.num_nodes, _group_of(space), space.node_kinds() == 2
    offsets = np.cumsum([0] + [leaf.size for leaf in space.leaves])
    edges = [bd for bd in bundles(space) if bd.kind == "weight"]

    def pick(level, forward):
        chosen, factor = np.full(n, -1, np.int64), np.ones(n)
        for d in range(1, int(level.max(initial=0)) + 1):
            cands = []  # (node, score, ravel index) of each node's best edge in each bundle
            for bd in edges:
                me, them, f_me, f_them = bd.ends(forward)
                at = hidden[me] & (level[me] == d)
                if not at.any():
                    continue
                w = np.abs(np.asarray(leaves[bd.leaf], np.float64)).transpose(bd.perm)
                w = w.reshape(bd.fb.size, bd.fs.size, bd.fd.size, bd.fp.size)
                lt, gt = level[them][:, :, None], group[them][:, :, None]  # (b, them, 1)
                lm, gm = level[me][:, None, :], group[me][:, None, :]  # (b, 1, me)
                adm = at[:, None, :] & (lt >= 0) & (lt < lm) & (gt != gm)  # (b, them, me)
                w = w if forward else w.transpose(0, 2, 1, 3)  # (b, them, me, p)
                score = w * factor[them][:, :, None, None]
                idx = bd.fb[:, None, None, None] + f_them[:, None, None] + f_me[:, None] + bd.fp
                score = np.where(adm[..., None], score, -1.0)
                best = score.max(axis=(1, 3))  # (b, me)
                tie = np.where(score == best[:, None, :, None], idx, np.iinfo(np.int64).max).min(axis=(1, 3))
                ok = adm.any(axis=1)
                cands.append((me[ok], best[ok], offsets[bd.leaf] + tie[ok]))
            if not cands:
                continue
            v, score, idx = (np.concatenate(x) for x in zip(*cands))
            o = np.lexsort((idx, -score, v))
            first = o[np.r_[True, v[o][1:] != v[o][:-1]]]
            factor[v[first]] = score[first]
            chosen[v[first]] = np.where(score[first] > 0, idx[first], -1)
        chosen.setflags(write=False)
        return chosen

    depth, dist = levels(space)
    return pick(depth, True), pick(dist, False)


def off_zeros(space: PathSpace, leaves) -> tuple[np.ndarray, np.ndarray] | None:
    """Skeleton edges that keep the index rule except where it takes a weight that is exactly 0 in ``leaves``.

    A standard recipe zero-initialises some weights (a residual block's last BatchNorm scale, a zeroed branch):
    where the index rule would make such an entry a skeleton edge, the chart is singular (`pathspace_jax.gsgd`'s
    ``check_chart``). There the node takes the edge `choose_by_value` gives it, nonzero wherever a nonzero
    admissible edge exists. Zeros are the same for every rescaling of the params, and only the nodes whose
    index-rule edge is 0 are moved, so the chart still serves any params of the structure (an ensemble, a
    checkpoint) that are nonzero on it. ``(incoming, outgoing)`` as `choose_by_value` gives them (-1: the index
    rule), or None where no skeleton edge is 0.
    """
    try:
        sk = skeleton(space)
    except ValueError:  # a node with no admissible edge: G-SGD says so when asked; trace itself does not need it
        return None

    def zero(leaf, flat):
        found = np.zeros(space.num_nodes, bool)
        for li in np.unique(leaf[sk.hidden & (leaf >= 0)]):
            at = sk.hidden & (leaf == li)
            found[at] = np.asarray(jnp.ravel(leaves[li])[flat[at]]) == 0  # the skeleton's entries only
        return found

    zero_in, zero_out = zero(sk.in_leaf, sk.in_flat), zero(sk.out_leaf, sk.out_flat)
    if not (zero_in.any() or zero_out.any()):
        return None
    by_value_in, by_value_out = choose_by_value(space, leaves)
    return np.where(zero_in, by_value_in, -1), np.where(zero_out, by_value_out, -1)


def _prefer(space: PathSpace, preferred, leaf, flat, other, forward: bool):
    """Replace the index rule's choice by ``preferred`` (ravel indices, -1: keep) where given."""
    if preferred is None or not (preferred >= 0).any():
        return leaf, flat, other
    offsets = np.cumsum([0] + [lf.size for lf in space.leaves])
    v = np.flatnonzero(preferred >= 0)
    lid = np.searchsorted(offsets, preferred[v], side="right") - 1
    leaf, flat, other = leaf.copy(), flat.copy(), other.copy()
    leaf[v], flat[v] = lid, preferred[v] - offsets[lid]
    for li in np.unique(lid):
        e = space.leaves[li]
        at = v[lid == li]
        other[at] = (e.src if forward else e.dst)[np.unravel_index(flat[at], e.shape)]
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


@functools.lru_cache(maxsize=64)
def skeleton(space: PathSpace) -> Skeleton:
    """The skeleton of ``space`` (cached per space). See the module docstring for the rule."""
    n = space.num_nodes
    hidden = space.node_kinds() == 2
    pref_in, pref_out = space.skeleton_edges or (None, None)

    in_leaf, in_flat, parent = _prefer(space, pref_in, *_choose(space, hidden, True), forward=True)
    missing = hidden & (in_leaf < 0)
    if missing.any():  # fallback: a bias edge (documented: the divisor may then be zero)
        bl, bf, bp = _choose(space, missing, True, bias=True)
        in_leaf = np.where(missing, bl, in_leaf)
        in_flat = np.where(missing, bf, in_flat)
        parent = np.where(missing, bp, parent)
    out_leaf, out_flat, child = _prefer(space, pref_out, *_choose(space, hidden, False), forward=False)
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
            src_r, sum_axes = reduced(leaf.src)
            dst_r, dst_sum_axes = reduced(leaf.dst)
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
