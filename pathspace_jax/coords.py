"""Path coordinates: to_coords, from_coords, coord_mask, basis_paths, canonicalize.

With the skeleton of `pathspace_jax.skeleton` (one incoming and one outgoing skeleton edge per
hidden node), write

    A_u = product of the weights on u's incoming skeleton chain   (1 at inputs, bias, pinned nodes)
    B_v = product of the weights on v's outgoing skeleton chain   (1 at outputs, pinned nodes).

Under a node-wise rescaling T_α, ``A_u ↦ α_u A_u`` and ``B_v ↦ B_v / α_v``. The **coordinate** of a
non-gauge entry ``e = u -> v`` is the value of its basis path,

    c_e = A_u · w_e · B_v,

which is rescaling invariant. The H **gauge** entries (the outgoing skeleton edges) keep their
weight as "coordinate", so the coordinate pytree has the shape of the params and
``from_coords(space, to_coords(space, w)) == w`` up to rounding: a non-gauge entry comes back as
``(w·f)/f``, f a product of skeleton weights, within a few ulps of w, and bit for bit where the
products are ±1 or powers of two (e.g. after `skeleton_init`). Leaves of kind ``"other"`` (not
edges of the homogeneous part) are their own coordinates. ``coord_mask`` is True at the m − H true
coordinates.

Inverse map (weight allocation): B from the gauge; then ``A_v = c_{inskel(v)} / B_v`` (or
``A_parent(v) · w_{inskel(v)}`` when v's incoming skeleton edge is its parent's gauge edge); then
``w_e = c_e / (A_u B_v)``. The divisors are products of gauge weights and of in-skeleton coordinates
— never biases. A zero divisor gives 0, never NaN (the chart is singular there).

Everything is O(m): A and B are D sequential gathers of node vectors (D = skeleton depth), and each
leaf multiplies by ``A[src]`` and ``B[dst]`` gathered with index arrays reduced to broadcastable
shape (a Dense kernel's ``src`` is an ``(n_in, 1)`` array). Node ranges are contiguous for the usual
layers, so these gathers are static slices and per-node sums are concatenations, which XLA fuses
into a few elementwise kernels per leaf (`_take`, `_node_sum`).

References:
  Meng et al., "G-SGD: Optimizing ReLU neural networks in its positively scale-invariant space",
  ICLR 2019; "Path Space for Recurrent Neural Networks with ReLU Activations" (skeleton method,
  weight allocation).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pathspace_jax.exact import pow2
from pathspace_jax.graph import BIAS_NODE, PathSpace, compute_dtype
from pathspace_jax.skeleton import Skeleton, candidates, skeleton

__all__ = [
    "to_coords",
    "from_coords",
    "coord_mask",
    "coord_scales",
    "check_chart",
    "path_norms",
    "balanced_frame",
    "frame_factors",
    "frame_level",
    "balancing_factors",
    "basis_paths",
    "canonicalize",
    "skeleton_init",
]


# ---------------------------------------------------------------------------- static helpers


@functools.lru_cache(maxsize=64)
def _gather_plan(space: PathSpace, which: str):
    """Static plan to gather each hidden node's in- or out-skeleton weight into a node vector.

    Returns ``(per_leaf, perm)``: ``per_leaf[i]`` the flat indices to read from leaf i, and ``perm``
    the index into ``[1, *concat(reads)]`` giving the node vector (position 0, the 1, at boundary nodes).
    """
    sk = skeleton(space)
    leaf_of = sk.in_leaf if which == "in" else sk.out_leaf
    flat_of = sk.in_flat if which == "in" else sk.out_flat
    per_leaf, nodes = [], []
    for li in range(len(space.leaves)):
        vs = np.flatnonzero(sk.hidden & (leaf_of == li))
        per_leaf.append(flat_of[vs])
        nodes.append(vs)
    allnodes = np.concatenate(nodes) if nodes else np.zeros(0, np.int64)
    perm = np.zeros(space.num_nodes, np.int32)
    perm[allnodes] = 1 + np.arange(allnodes.size, dtype=np.int32)
    return tuple(per_leaf), perm


def _node_gather(space, leaves, which, dtype):
    """Node vector of the in/out skeleton weights (1 at boundary nodes), from a list of leaves."""
    per_leaf, perm = _gather_plan(space, which)
    parts = [jnp.ones((1,), dtype)]
    for leaf, idx in zip(leaves, per_leaf):
        if idx.size:
            parts.append(jnp.reshape(leaf, (-1,))[idx].astype(dtype))
    return jnp.concatenate(parts)[perm]


def _range_start(idx: np.ndarray):
    """``lo`` if the static index array, flattened, is ``lo, lo+1, …`` (a contiguous node range), else None."""
    flat = np.ravel(idx)
    if flat.size and np.array_equal(flat, flat[0] + np.arange(flat.size)):
        return int(flat[0])
    return None


def _take(vec, idx: np.ndarray):
    """``vec[idx]`` for a static index array: a static slice (fused by XLA) when idx is a contiguous range."""
    lo = _range_start(idx)
    if lo is None:
        return vec[idx]
    return jax.lax.slice_in_dim(vec, lo, lo + idx.size).reshape(idx.shape)


def _node_sum(n: int, parts, dtype):
    """Node vector of length n: ``Σ vals`` scattered at ``idx`` over ``parts = [(static idx, vals), …]``.

    Parts on one contiguous node range are summed first and the disjoint ranges concatenated with zero
    gaps (one fused op instead of a scatter per part); anything else is a scatter-add.
    """
    ranges, rest = {}, []
    for idx, vals in parts:
        vals = jnp.broadcast_to(vals, idx.shape).reshape(-1)
        lo = _range_start(idx)
        if lo is None:
            rest.append((np.ravel(idx), vals))
        else:
            key = (lo, idx.size)
            ranges[key] = ranges[key] + vals if key in ranges else vals
    pieces, end = [], 0
    for (lo, size), vals in sorted(ranges.items()):
        if lo < end:  # overlapping ranges: scatter
            rest.append((lo + np.arange(size), vals))
            continue
        pieces += [jnp.zeros((lo - end,), dtype), vals.astype(dtype)]
        end = lo + size
    out = jnp.concatenate([*pieces, jnp.zeros((n - end,), dtype)])
    for idx, vals in rest:
        out = out.at[idx].add(vals.astype(dtype))
    return out


def _finite(x):
    """x where finite, else 0: a product of inverse chain factors beyond the dtype's range is a singular chart."""
    return jnp.where(jnp.isfinite(x), x, 0)


def _safe_inv(x):
    """1/x, and 0 where x is 0 or so small that 1/x overflows (the chart is singular there in this dtype)."""
    nz = x != 0
    inv = 1.0 / jnp.where(nz, x, 1)
    return jnp.where(nz & jnp.isfinite(inv), inv, 0)


def _chain_A(sk: Skeleton, w_in):
    """A_v: product of the weights on v's incoming skeleton chain (D_in gathers)."""
    a = jnp.ones_like(w_in)
    for _ in range(sk.depth_in):
        a = a[sk.parent] * w_in
    return a


def _chain_B(sk: Skeleton, w_out):
    """B_v: product of the weights on v's outgoing skeleton chain (D_out gathers)."""
    b = jnp.ones_like(w_out)
    for _ in range(sk.depth_out):
        b = w_out * b[sk.child]
    return b


def _A_from_coords(sk: Skeleton, c_in, b):
    """A from the in-skeleton coordinates: c_in / B, or A_parent · (gauge weight) along gauge in-edges."""
    q = jnp.where(jnp.asarray(sk.in_is_gauge), c_in, c_in * _safe_inv(b))
    q = jnp.where(jnp.asarray(sk.hidden), q, 1)
    if not sk.in_is_gauge.any():
        return q
    a = jnp.ones_like(q)
    for _ in range(sk.depth_in):
        a = jnp.where(jnp.asarray(sk.in_is_gauge), a[sk.parent] * q, q)
    return a


def _get_flat(x, idx):
    return jnp.reshape(x, (-1,))[idx]


def _map_edge_leaves(space: PathSpace, tree, leaves, ct, value, gauge):
    """Per edge leaf x (in ``ct``): ``value(x, leaf_index)``, with ``gauge(x)`` at the gauge entries; back in the
    leaf's dtype and in ``tree``'s structure. Leaves of kind ``"other"`` pass through."""
    out = []
    for x, li in zip(leaves, skeleton(space).leaves):
        if li.kind == "other":
            out.append(x)
            continue
        xc = jnp.asarray(x, ct)
        y = value(xc, li)
        gm = li.gauge_mask(y.shape)
        if gm is not None:
            y = jnp.where(gm, gauge(xc), y)
        out.append(y.astype(jnp.result_type(x)))
    return space.unflatten_like(tree, out)


def _node_factors(space, leaves, dtype):
    """(A, B) node vectors from the params' leaves."""
    sk = skeleton(space)
    a = _chain_A(sk, _node_gather(space, leaves, "in", dtype))
    b = _chain_B(sk, _node_gather(space, leaves, "out", dtype))
    return a, b


def gauge_log2(space: PathSpace, leaves, dtype):
    """Per node, ``l_v = log2|B_v|`` (B_v: the product of the weights on v's outgoing skeleton chain, the gauge).

    Summed as logarithms, so no product overflows or underflows. 0 at non-hidden nodes and where a gauge
    weight on the chain is 0. Under a node-wise rescaling T_β, ``l_v ↦ l_v − log2 β_v``.
    """
    sk = skeleton(space)
    lw = jnp.log2(jnp.abs(_node_gather(space, leaves, "out", dtype)))
    lb = jnp.zeros_like(lw)
    for _ in range(sk.depth_out):
        lb = lw + lb[sk.child]
    return jnp.where(jnp.isfinite(lb), lb, 0)


_MAX_FRAME_EXPONENT = 60  # node factors 2^±60: an edge factor 2^±120 is a normal float32


def _frame_k(lg):
    """Integer frame exponents per node: round(l), clipped so that every factor below is a normal float32."""
    return jnp.clip(jnp.round(lg), -_MAX_FRAME_EXPONENT, _MAX_FRAME_EXPONENT)


def edge_factors(space: PathSpace, lg, sign: float = 1.0):
    """Per leaf, ``2^(sign · (k_dst − k_src))`` (k: `gauge_log2` rounded to integers, |k| ≤ 60), exact powers of
    two broadcastable to the leaf (None for leaves of kind "other").

    Built from two node vectors (one power of two per node, one product per entry), so applying it costs what
    an elementwise product costs. ``sign=1`` takes the params to the canonical frame, ``sign=-1`` back.
    """
    return _edge_products(space, *_pow2_pair(sign * _frame_k(lg)))


def _pow2_pair(k):
    """``(2^k, 2^-k)`` exactly, for an integer-valued node vector k (`pathspace_jax.exact.pow2`)."""
    return pow2(k, k.dtype), pow2(-k, k.dtype)


def _edge_products(space: PathSpace, up, down):
    """Per leaf, ``up_dst · down_src`` from two node vectors: one product per entry.

    The node vectors are materialised first (`_materialize`): XLA:CPU would otherwise recompute their
    powers of two (a clip, a rounding and bit operations) once per entry in every loop that reads them
    (Path-SGD's step on a 784-2048-2048-10 MLP, A/B in one process: 1.23x SGD's step with, 1.17x without).
    """
    up, down = _materialize(up, down)
    return [
        None if li.kind == "other" else _take(up, li.dst_r) * _take(down, li.src_r) for li in skeleton(space).leaves
    ]


def frame_factors(space: PathSpace, alpha):
    """Per leaf, ``α_dst / α_src`` broadcastable to the leaf (None for leaves of kind "other"), from a node vector α.

    The factor that takes an edge's weight to the frame α (a node-wise rescaling, e.g. `balanced_frame`):
    ``w_{u->v} ↦ w_{u->v} α_v / α_u``; κ, which scales like ``(β_u / β_v)²``, is divided by its square. An α that
    is 0 or not finite (a node on no path one way) counts as 1 there.
    """
    a = jnp.where((alpha > 0) & jnp.isfinite(alpha), alpha, 1)
    return _edge_products(space, a, 1 / a)


def to_canonical_frame(space: PathSpace, leaves, dtype):
    """``(leaves in the canonical frame, l)``: every edge ``u -> v`` times ``2^(k_v − k_u)``, in ``dtype``, with
    ``l`` = `gauge_log2` and k its rounding (`edge_factors`); leaves of kind "other" unchanged.

    The canonical frame is the member of the params' rescaling orbit whose gauge weights are ±1 within a
    factor √2 (`canonicalize` up to powers of two). It computes the same function and, since the factors
    are powers of two, is bit for bit the same for every power-of-two rescaling of ``leaves``: quantities
    that scale under rescaling (κ, gradients) are computed there, in range, and mapped back.
    """
    lg = gauge_log2(space, leaves, dtype)
    out = [jnp.asarray(w) if f is None else jnp.asarray(w, dtype) * f for w, f in zip(leaves, edge_factors(space, lg))]
    return out, lg


def kappa_from_frame(space: PathSpace, kappa, lg):
    """κ of the params from κ in their canonical frame: ``κ_c · 2^(2(k_v − k_u))`` on each edge ``u -> v``.

    κ_c = 0 stays 0; a value beyond the dtype's range is ``inf`` (never 0, never NaN).
    """
    return [
        k if f is None else jnp.where(k == 0, 0, k * f * f).astype(jnp.result_type(k))
        for k, f in zip(kappa, edge_factors(space, lg))
    ]


# ---------------------------------------------------------------------------- public maps


def to_coords(space: PathSpace, params):
    """Path coordinates of ``params``: the value of each entry's basis path, the weight at gauge entries.

    ``c_e = A_u · w_e · B_v`` for a non-gauge entry ``e = u -> v`` (A, B: products of the weights on
    the incoming skeleton chain of u and the outgoing skeleton chain of v); ``c_e = w_e`` at the H
    gauge entries (outgoing skeleton edges) and on leaves of kind ``"other"``. Invariant under
    node-wise rescaling at every entry where `coord_mask` is True.
    A zero skeleton weight makes the coordinates of the paths through it 0: the chart cannot represent
    the weights after it, and `from_coords` gives 0 there (`check_chart` says where).

    Args:
      space: the `PathSpace` of the network (``pathspace_jax.trace``).
      params: params of the traced structure.

    Returns:
      A pytree with the structure, shapes and dtypes of ``params``.

    Example:
      >>> c = pj.to_coords(space, params)
      >>> c2 = pj.to_coords(space, pj.random_rescale(space, params, key))  # equal where coord_mask

    References:
      "Path Space for Recurrent Neural Networks with ReLU Activations" (basis paths of the reduction
      graph); Meng et al., "G-SGD: Optimizing ReLU neural networks in its positively scale-invariant space", ICLR 2019.
    """
    leaves = space.leaves_of(params)
    ct = compute_dtype(leaves)
    a, b = _node_factors(space, leaves, ct)
    coord = lambda w, li: w * (_take(a, li.src_r) * _take(b, li.dst_r))  # noqa: E731
    return _map_edge_leaves(space, params, leaves, ct, coord, lambda w: w)


def from_coords(space: PathSpace, coords):
    """Weights from path coordinates (weight allocation): the inverse of `to_coords`.

    B from the gauge entries, ``A_v = c_{inskel(v)} / B_v`` (``A_parent · c`` when the incoming
    skeleton edge of v is a gauge entry), then ``w_e = c_e / (A_u B_v)``. A zero divisor (a zero gauge
    weight or in-skeleton coordinate: the chart is singular there) gives 0, never NaN.

    Args:
      space: the `PathSpace` of the network.
      coords: a coordinate pytree (as from `to_coords`).

    Returns:
      Params with the structure, shapes and dtypes of ``coords``.

    Example:
      >>> params2 = pj.from_coords(space, pj.to_coords(space, params))  # == params, up to a few ulps
    """
    leaves = space.leaves_of(coords, "coords")
    sk = skeleton(space)
    ct = compute_dtype(leaves)
    b = _chain_B(sk, _node_gather(space, leaves, "out", ct))
    a = _A_from_coords(sk, _node_gather(space, leaves, "in", ct), b)

    def weight(c, li):
        f = _take(a, li.src_r) * _take(b, li.dst_r)
        return jnp.where(f != 0, c / jnp.where(f != 0, f, 1), 0)

    return _map_edge_leaves(space, coords, leaves, ct, weight, lambda c: c)


def coord_mask(space: PathSpace):
    """Bool pytree like the params: True at the m − H coordinate entries, False at the H gauge entries.

    Example:
      >>> int(sum(m.sum() for m in jax.tree_util.tree_leaves(pj.coord_mask(space)))) == space.num_coords
      True
    """
    sk = skeleton(space)
    out = []
    for leaf, li in zip(space.leaves, sk.leaves):
        m = np.ones(leaf.shape, bool)
        m.reshape(-1)[li.gauge_flat] = False
        out.append(m)
    return jax.tree_util.tree_unflatten(space.treedef, out)


@functools.lru_cache(maxsize=16)
def _basis_paths_np(space: PathSpace):
    sk = skeleton(space)
    cin, cout = sk.chain_in_global(), sk.chain_out_global()
    width = cin.shape[1] + 1 + cout.shape[1]
    out = []
    for leaf, li in zip(space.leaves, sk.leaves):
        gidx = li.offset + np.arange(leaf.size, dtype=np.int64)
        if li.kind == "other":
            rows = np.full((leaf.size, width), -1, np.int64)
            rows[:, 0] = gidx
        else:
            src = np.asarray(leaf.src, np.int64).reshape(-1)
            dst = np.asarray(leaf.dst, np.int64).reshape(-1)
            rows = np.concatenate([cin[src], gidx[:, None], cout[dst]], axis=1)
            order = np.argsort(rows == -1, axis=1, kind="stable")
            rows = np.take_along_axis(rows, order, axis=1)
            rows[li.gauge_flat] = -1
        rows.flags.writeable = False
        out.append(rows.reshape(leaf.shape + (width,)))
    return tuple(out)


def basis_paths(space: PathSpace):
    """The basis path of every coordinate entry, as flat indices into ``ravel_pytree(params)[0]``.

    Each leaf is an int64 numpy array of shape ``leaf.shape + (L,)``: the entries on that entry's
    basis path in order from its start (an input, the bias node, or a pinned node) to its end (an
    output or a pinned node), padded with −1: ``[incoming skeleton chain of u] + [e] +
    [outgoing skeleton chain of v]`` for ``e = u -> v``. Rows of gauge entries are all −1; a leaf of
    kind ``"other"`` holds just the entry itself. The product of the weights on a row equals the
    entry's coordinate in `to_coords`.

    Example:
      >>> import jax.flatten_util
      >>> flat, _ = jax.flatten_util.ravel_pytree(params)
      >>> idx = pj.basis_paths(space)["Dense_0"]["kernel"][i, j]
      >>> value = jnp.prod(flat[idx[idx >= 0]])
      >>> bool(jnp.isclose(value, pj.to_coords(space, params)["Dense_0"]["kernel"][i, j]))
      True
    """
    return jax.tree_util.tree_unflatten(space.treedef, list(_basis_paths_np(space)))


def canonicalize(space: PathSpace, params):
    """The member of ``params``' rescaling orbit whose gauge weights (outgoing skeleton edges) are ±1.

    Rescales by ``α_v = |B_v|`` (B_v: the product of the weights on v's outgoing skeleton chain):
    ``w_{u->v} ↦ w_{u->v} · |B_v| / |B_u|``. The function is unchanged, and every rescaling of
    ``params`` gives the same result (α absorbs it). Needs nonzero gauge weights (a zero one gives 0
    at the entries it divides, never NaN).

    Args:
      space: the `PathSpace` of the network.
      params: params of the traced structure.

    Returns:
      The canonical params, same structure and dtypes.

    Example:
      >>> a = pj.canonicalize(space, pj.random_rescale(space, params, key))
      >>> b = pj.canonicalize(space, params)
      >>> all(bool(jnp.allclose(u, v, rtol=1e-5)) for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
      True
    """
    leaves = space.leaves_of(params)
    sk = skeleton(space)
    ct = compute_dtype(leaves)
    b = jnp.abs(_chain_B(sk, _node_gather(space, leaves, "out", ct)))
    inv_b = _safe_inv(b)
    scaled = lambda w, li: w * (_take(b, li.dst_r) * _take(inv_b, li.src_r))  # noqa: E731
    return _map_edge_leaves(space, params, leaves, ct, scaled, jnp.sign)


def skeleton_init(space: PathSpace, params):
    """An initialisation for G-SGD: every skeleton weight (incoming and outgoing) set to ±1, its sign kept.

    A plain SGD step on the raw path coordinates moves a weight ``e = u -> v`` by ``η ∂L/∂w_e / (A_u B_v)²``
    (A_u, B_v: the products of the
    weights on u's incoming and v's outgoing skeleton chains). With the skeleton chosen by index (from
    the graph alone: ``trace(..., skeleton="index")`` or abstract params), a chain through one small
    initial weight makes the effective step of some weights 10⁴–10⁸ times SGD's in raw coordinates
    (G-SGD itself divides by the rescaling-invariant `coord_scales`, which removes that). With every
    skeleton weight ±1, A = B = ±1: the coordinates
    are the weights up to sign, the coordinate gradient is ±∂L/∂w at the non-skeleton entries, and
    G-SGD trains at SGD's learning rates. This is the initialisation of Meng et al. (ICLR 2019). With
    the skeleton chosen from the params' values (``trace(..., skeleton="values")``) it is not needed.

    It **changes the function** (it is not a rescaling: only the gauge, the outgoing skeleton weights,
    can be set by rescaling — see `canonicalize`). Call it once on freshly initialised params, never on
    trained ones. A zero skeleton weight becomes +1.

    Args:
      space: the `PathSpace` of the network.
      params: freshly initialised params of the traced structure.

    Returns:
      The params with their H incoming and H outgoing skeleton weights set to ±1, same structure and
      dtypes.

    Example:
      >>> p0 = pj.skeleton_init(space, model.init(key, x)["params"])
      >>> tx = pj.g_sgd(space, 0.05, normalize=False)  # raw basis-path values, as Meng et al.

    References:
      Meng et al., "G-SGD: Optimizing ReLU neural networks in its positively scale-invariant space",
      ICLR 2019.
    """
    leaves = space.leaves_of(params)
    out = []
    for w, li in zip(leaves, skeleton(space).leaves):
        w = jnp.asarray(w)
        masks = [m for m in (li.inskel_mask(w.shape), li.gauge_mask(w.shape)) if m is not None]
        if li.kind == "other" or not masks:
            out.append(w)
            continue
        on_skeleton = functools.reduce(jnp.logical_or, masks)
        out.append(jnp.where(on_skeleton, jnp.where(w < 0, -1, 1).astype(w.dtype), w))
    return space.unflatten_like(params, out)


# ---------------------------------------------------------------------------- G-SGD kernels (O(m))


def _from_hidden(sk: Skeleton, li) -> bool:
    """Whether some edge of the leaf starts at a hidden node. The per-source sums of G-SGD's chart (Σ g w, ‖v_x‖²)
    are read at hidden nodes only, so a first layer's (a Dense or Conv on the inputs, an embedding table), one
    reduction over its whole kernel each, would be computed for nothing (about a fifth of G-SGD's update on a
    784-512-512-10 MLP)."""
    return bool(np.any(sk.hidden[np.asarray(li.src_r)]))


def _in_skeleton_correction(space: PathSpace, w_leaves, g_leaves, ct, ia, ib):
    """Per node x, the term ``t_x / (A_x B_x)`` that ∂L/∂c adds at x's incoming skeleton entry.

    ∂L/∂c is the inverse chain rule (the VJP of `from_coords` with the gauge fixed): ``g_e / (A_u B_v)`` at a
    non-gauge entry ``e = u -> v``, plus, at the incoming skeleton entry of a node x, ``t_x / (A_x B_x)`` with
    ``t_x = −Σ_{e non-gauge, src(e)=x} g_e w_e + Σ_y t_y`` over the children y whose incoming skeleton edge is
    x's gauge edge; 0 at the gauge entries.
    """
    sk = skeleton(space)
    parts = []
    for w, g, li in zip(w_leaves, g_leaves, sk.leaves):
        if li.kind != "weight" or not _from_hidden(sk, li):
            continue
        w, g = jnp.asarray(w, ct), jnp.asarray(g, ct)
        parts.append((li.src_r, jnp.sum(g * w, axis=li.sum_axes, keepdims=True)))
        if li.gauge_flat.size:  # less the gauge entries: a gather, so that XLA fuses the sum with its product
            parts.append((li.gauge_node, -_get_flat(g, li.gauge_flat) * _get_flat(w, li.gauge_flat)))
    p = _node_sum(space.num_nodes, parts, ct)  # Σ g_e w_e over the non-gauge entries leaving each node
    t = -p
    if sk.in_is_gauge.any():
        gate = jnp.asarray(sk.in_is_gauge)
        for _ in range(sk.depth_in):
            t = -p + jnp.zeros_like(p).at[sk.parent].add(jnp.where(gate, t, 0))
    return t * _finite(ia * ib)


def _skeleton_share(space: PathSpace, w_leaves, factors, ct):
    """Per node x: |c_{inskel(x)}| / s_x, s_x the norm of the coordinates of all edges into x (invariant)."""
    sk = skeleton(space)
    a, b, ia, ib = factors
    parts = [
        (li.dst_r, jnp.sum(jnp.square(jnp.asarray(w, ct) * _take(a, li.src_r)), axis=li.dst_sum_axes, keepdims=True))
        for w, li in zip(w_leaves, sk.leaves)
        if li.kind != "other"
    ]
    s2 = _node_sum(space.num_nodes, parts, ct)
    # |c_x| / s_x = |A_x B_x| / (|B_x| sqrt(s2_x)) = |A_x| / sqrt(s2_x)
    return jnp.where(jnp.asarray(sk.hidden & ~sk.in_is_gauge), jnp.abs(a) * _safe_inv(jnp.sqrt(s2)), 0)


# Recurrent kernels (edges within one node group) count in the path norms along every path through up to
# this many of them: the path norm of the network unrolled over that many steps plus one. Kept short: the
# longer the unroll, the more the frame depends on powers of the recurrent kernels (exponentially in their
# spectral radii); with 16, G-Adam diverged on a stacked ReLU RNN that it trains with 2 (and with none).
RECURRENT_STEPS = 2


@functools.lru_cache(maxsize=64)
def _sweep_plan(space: PathSpace, forward: bool):
    """Static plan of `path_norms`: per level d, ``(nodes at d, parts, lateral)``, each of ``parts`` and
    ``lateral`` a tuple of ``(leaf index, mask or None)``.

    Forward (levels: BFS depth from the inputs): the edges into a hidden node v at depth d in ``parts`` are
    its bias edge and its weight edges from nodes of smaller depth. Backward (levels: BFS distance to the
    outputs): the weight edges out of v to nodes closer to the outputs. These are the admissible skeleton
    edges (`pathspace_jax.skeleton`): never an edge within one node group. ``lateral`` holds the edges
    between hidden nodes of level d themselves (recurrent kernels). ``mask`` selects a part's edges where
    a leaf holds other edges too.
    """
    c = candidates(space)
    level, hidden = (c.depth if forward else c.dist), c.hidden
    levels = []
    for d in range(1, int(level[hidden].max(initial=0)) + 1):
        at = hidden & (level == d)
        parts, lateral = [], []
        for li, leaf in enumerate(space.leaves):
            if leaf.kind == "other":
                continue
            src, dst = np.asarray(leaf.src, np.int64), np.asarray(leaf.dst, np.int64)
            if forward:
                ok = at[dst] & ((src == BIAS_NODE) | ((level[src] >= 0) & (level[src] < d)))
            else:
                ok = at[src] & (level[dst] >= 0) & (level[dst] < d)
            lat = at[src] & at[dst] if leaf.kind == "weight" else np.zeros(leaf.shape, bool)
            for out, sel in ((parts, ok), (lateral, lat)):
                if sel.any():
                    out.append((li, None if sel.all() else sel))
        if parts or lateral:
            levels.append((at, tuple(parts), tuple(lateral)))
    return tuple(levels)


def path_norms(space: PathSpace, leaves, dtype):
    """Per node, ``(q_in, q_out)``: the squared path norms of the paths into and out of each hidden node.

    ``q_in,v = Σ_u w²_{u->v} q_in,u`` over v's bias edge and its weight edges from shallower nodes, and
    ``q_out,v = Σ_y w²_{v->y} q_out,y`` over its weight edges to nodes closer to the outputs (see
    `_sweep_plan`); both are 1 at non-hidden nodes. A recurrent kernel U (edges within one node group)
    adds the paths through it, as the path norm of the unrolled network does (Neyshabur, Wu, Salakhutdinov
    and Srebro, "Path-Normalized Optimization of Recurrent Neural Networks with ReLU Activations", NeurIPS
    2016): ``q_in ← q_in⁰ + (U∘U)ᵀ q_in`` (and ``q_out ← q_out⁰ + (U∘U) q_out``) iterated `RECURRENT_STEPS`
    times, every path through up to that many recurrent edges. Without it a ReLU RNN's frame would
    ignore its recurrent weights, and SGD in that frame (G-SGD's normalised chart) distorts the recurrence
    on long sequences.

    Under a node-wise rescaling β, ``q_in ↦ β² q_in`` and ``q_out ↦ q_out / β²`` exactly (for powers of
    two, bit for bit). One pass over each edge leaf per direction (per level it feeds), and
    `RECURRENT_STEPS` passes over each recurrent kernel.
    """
    sk = skeleton(space)

    def terms(parts, q, forward):
        vals = []
        for li, mask in parts:
            idx = sk.leaves[li]
            read, write, axes = (
                (idx.src_r, idx.dst_r, idx.dst_sum_axes) if forward else (idx.dst_r, idx.src_r, idx.sum_axes)
            )
            w = jnp.asarray(leaves[li], dtype)
            t = w * (w * _take(q, read))  # not square(w) · q: a W² shared by both sweeps would be materialised
            if mask is None:
                vals.append((write, jnp.sum(t, axis=axes, keepdims=True)))
            else:
                leaf = space.leaves[li]
                vals.append((np.asarray(leaf.dst if forward else leaf.src), jnp.where(mask, t, 0)))
        return _node_sum(space.num_nodes, vals, dtype)

    out = []
    for forward in (True, False):
        q = jnp.ones((space.num_nodes,), dtype)
        for at, parts, lateral in _sweep_plan(space, forward):
            at = jnp.asarray(at)
            base = terms(parts, q, forward)
            q = jnp.where(at, base, q)
            for _ in range(RECURRENT_STEPS if lateral else 0):  # unrolled: a GPU loop costs a launch per step
                q = jnp.where(at, base + terms(lateral, q, forward), q)
        out.append(q)
    return tuple(out)


@functools.lru_cache(maxsize=64)
def frame_level(space: PathSpace) -> np.ndarray:
    """Per node, the level λ_v of the balanced frame (`balanced_frame`), a constant of the structure.

    The balance condition fixes the α of a group of hidden nodes (a layer's units or channels) only up to
    one common factor. λ is chosen so that a network at a standard initialisation is, on average over
    each hidden group, its own balanced frame: ``log2 λ_v = mean_u ¼ log2(q̄_in,u / q̄_out,u)`` over the
    nodes u of v's group, with q̄ the path norms (`path_norms`) of the network whose squared weights are
    their expectation under LeCun's initialisation (the default of Flax's ``Dense``, ``Conv`` and
    ``SimpleCell`` kernels; an orthogonal recurrent kernel has the same row norms): ``w² = 1 / fan_in``
    per entry, fan_in the number of the leaf's edges into the entry's destination node, and biases 0.
    An embedding table counts as a dense kernel from its one-hot inputs. 1 at non-hidden nodes.

    Without it (λ = 1) every hidden node's incoming path norm equals its outgoing one, while at a
    standard initialisation the outgoing ones are smaller wherever the layers narrow towards the outputs:
    on a ReLU RNN with 64 units and 10 classes the balanced α averages 2^-0.68, so G-SGD's steps were 2.6
    times SGD's on the input kernel and the biases and 0.38 times on the readout, and at SGD's largest
    stable learning rate it diverged where SGD trains. Per group, because layers differ: on a two-layer
    ReLU RNN the levels are 2^0.27 and 2^1.07. λ depends on the space only, so the frame stays a
    function of the params' rescaling orbit (and exact under power-of-two rescalings). Computed once per
    space (cached, read-only), outside any trace, in float32 whatever the params' dtype and JAX's x64
    setting, so that it is the same constant in every process.
    """
    ref = []
    for leaf in space.leaves:
        if leaf.kind != "weight":
            ref.append(np.zeros(leaf.shape, np.float32))
            continue
        dst = np.broadcast_to(np.asarray(leaf.dst), leaf.shape).reshape(-1)
        fan_in = np.bincount(dst, minlength=space.num_nodes)[dst]
        ref.append(np.reshape(1 / np.sqrt(fan_in), leaf.shape).astype(np.float32))
    with jax.ensure_compile_time_eval():
        q_in, q_out = (np.asarray(q, np.float64) for q in path_norms(space, ref, jnp.float32))
    ok = (q_in > 0) & (q_out > 0) & np.isfinite(q_in) & np.isfinite(q_out)  # nodes on at least one path each way
    level = np.ones(space.num_nodes, np.float32)
    for g in (space.groups[i] for i in space.hidden_groups):
        units = np.arange(g.offset, g.offset + g.size)[ok[g.offset : g.offset + g.size]]
        if units.size:
            level[g.offset : g.offset + g.size] = 2 ** (np.mean(np.log2(q_in[units] / q_out[units])) / 4)
    level.setflags(write=False)
    return level


def balanced_frame(space: PathSpace, leaves, dtype):
    """Per node, ``α_v = λ_v (q_out,v / q_in,v)^¼`` (`path_norms`; 1 at non-hidden nodes).

    Rescaling every hidden node v by ``(q_out,v / q_in,v)^¼`` makes its incoming and outgoing path norms
    equal; the constant level λ (`frame_level`, one per hidden group) then rescales each group's nodes
    alike, so that a network at a standard initialisation is, on average over each group, its own frame.
    In the frame every node of a group has ``q_out / q_in = λ^-4``. Two square roots and a constant, so
    α scales exactly (``α ↦ α / β``) under power-of-two rescalings β; 0 or ``inf`` where a path norm is 0.
    """
    q_in, q_out = path_norms(space, leaves, dtype)
    # fourth roots taken apart: the ratio of the path norms of a network far from balance leaves the dtype's range
    return jnp.sqrt(jnp.sqrt(q_out)) / jnp.sqrt(jnp.sqrt(q_in)) * jnp.asarray(frame_level(space), dtype)


def _inv_v_norms(space: PathSpace, w_leaves, ct, alpha):
    """Per node x, ``1 / ‖v_x‖`` in the balanced frame ``alpha`` (0 where ‖v_x‖ = 0).

    v_x is the direction in which x's incoming skeleton coordinate moves the weights: its own incoming
    skeleton weight up, x's outgoing non-gauge weights down; ``‖v_x‖²`` is the sum of their squares.
    """
    sk = skeleton(space)
    rows, own = [], []
    for w, li in zip(w_leaves, sk.leaves):
        if li.kind != "weight":
            continue
        w = jnp.asarray(w, ct)
        if _from_hidden(sk, li):
            wf = w * (_take(alpha, li.dst_r) / _take(alpha, li.src_r))
            rows.append((li.src_r, jnp.sum(jnp.square(wf), li.sum_axes, keepdims=True)))
        if li.gauge_flat.size:  # less the gauge entries (a gather, as in `_in_skeleton_correction`)
            node = li.gauge_node
            rows.append((node, -jnp.square(_get_flat(w, li.gauge_flat) * (alpha[sk.child[node]] / alpha[node]))))
        if li.inskel_flat.size:  # x's own incoming skeleton weight: a gather, not a pass over the leaf
            node = li.inskel_node
            own.append((node, jnp.square(_get_flat(w, li.inskel_flat) * (alpha[node] / alpha[sk.parent[node]]))))
    # ≥ 0 although the gauge entry is subtracted from its row's sum (rounding could leave it below 0)
    v2 = jnp.maximum(_node_sum(space.num_nodes, rows, ct), 0) + _node_sum(space.num_nodes, own, ct)
    return _finite(jax.lax.rsqrt(v2))


def _scales(space: PathSpace, w_leaves, c_leaves, factors, ct, alpha):
    """Per leaf, σ of `coord_scales` (None for leaves of kind "other"); ``alpha``: `balanced_frame`."""
    a, b = factors[:2]
    s_src = _finite(jnp.abs(a) * alpha)  # |A_u| in the balanced frame
    s_dst = _finite(jnp.abs(b) / alpha)  # |B_v| in the balanced frame
    inv_v = _inv_v_norms(space, w_leaves, ct, alpha)
    out = []
    for w, c, li in zip(w_leaves, c_leaves, skeleton(space).leaves):
        if li.kind == "other":
            out.append(None)
            continue
        shape = jnp.shape(w)
        s = jnp.broadcast_to(_take(s_src, li.src_r) * _take(s_dst, li.dst_r), shape)
        im, gm = li.inskel_mask(shape), li.gauge_mask(shape)
        if im is not None:
            s = jnp.where(im, jnp.abs(c) * _take(inv_v, li.dst_r), s)
        if gm is not None:
            s = jnp.where(gm, 1, s)
        out.append(s)
    return out


def coord_scales(space: PathSpace, params):
    """The scales σ of G-SGD's normalised coordinates ``φ = c / σ`` (``in_path_space(normalize=True)``).

    A path coordinate ``c_e = A_u w_e B_v`` is a product of weights along a whole path, so its size is
    that of many weights multiplied: SGD on raw coordinates moves ``w_e`` by ``η g_e / (A_u B_v)²``,
    10²–10⁴ times SGD's step at a standard initialisation. The normalised coordinates divide each one by
    a rescaling-invariant scale taken at the current params, in the **balanced frame**: every hidden
    node v rescaled by ``α_v = λ_v (q_out,v / q_in,v)^¼`` (`balanced_frame`), so that the ratio of its
    outgoing to its incoming path norm is the same for all nodes of its group (a layer's units), at the
    level λ (`frame_level`) where a network at a standard initialisation is, on average, its own frame.
    That frame is a function of the params' rescaling orbit and grows with the network as SGD's iterates
    do.

    * a coordinate entry ``e = u -> v``: ``σ_e = |A_u B_v|`` in the balanced frame, ``|A_u B_v| α_u / α_v``.
      Then ``φ_e`` is ±(the weight in the balanced frame), and SGD on φ moves it as SGD would there;
    * the incoming skeleton entry of a node x: ``σ_x = |c_x| / ‖v_x‖``, so SGD on φ moves ``log |c_x|``
      by ``−η ∂L/∂log|c_x| / ‖v_x‖²``: a multiplicative step on the coordinate that sets the node's scale,
      as SGD in the balanced frame would move along v_x, the direction in which that coordinate moves the
      weights (x's incoming skeleton weight up, its outgoing non-gauge weights down; ``‖v_x‖²`` the sum of
      their squares in the balanced frame);
    * gauge entries and leaves of kind "other": 1.

    Every σ is a function of path values only, so it is the same for every node-wise rescaling of
    ``params`` (bit for bit for powers of two). σ is 0 where the chart is singular (a zero skeleton weight).

    Args:
      space: the `PathSpace` of the network.
      params: params of the traced structure.

    Returns:
      A pytree like ``params``, in the params' dtypes.

    Example:
      >>> phi = jax.tree.map(lambda c, s: c / s, pj.to_coords(space, params), pj.coord_scales(space, params))
    """
    leaves = space.leaves_of(params)
    ct = compute_dtype(leaves)
    factors = _node_factors(space, leaves, ct)
    cs = [jnp.asarray(c, ct) for c in space.leaves_of(to_coords(space, params))]
    s = _scales(space, leaves, cs, factors, ct, balanced_frame(space, leaves, ct))
    out = [jnp.ones_like(w) if x is None else x.astype(jnp.result_type(w)) for w, x in zip(leaves, s)]
    return space.unflatten_like(params, out)


def check_chart(space: PathSpace, params, who: str = "check_chart") -> None:
    """Raise ``ValueError`` if a skeleton weight of ``params`` is exactly 0 (the chart is singular there).

    The basis paths through a zero skeleton weight have value 0, so the weights after it (the outgoing
    weights of a node whose incoming skeleton weight is 0, the incoming ones of a node whose gauge chain
    holds a 0) cannot be represented in path coordinates: ``from_coords(to_coords(p))`` sets them to 0 and
    G-SGD leaves them unchanged (update 0). Called by ``in_path_space``'s ``init`` on concrete params;
    skipped for abstract ones (inside ``jit`` / ``vmap``).
    """
    bad = []
    for w, leaf, li in zip(space.leaves_of(params), space.leaves, skeleton(space).leaves):
        if isinstance(w, jax.core.Tracer) or li.kind == "other":
            continue
        flat = np.asarray(w).reshape(-1)
        for what, idx in (("incoming skeleton", li.inskel_flat), ("gauge (outgoing skeleton)", li.gauge_flat)):
            for k in idx[flat[idx] == 0]:
                bad.append(f"'{leaf.path}' entry {tuple(int(i) for i in np.unravel_index(k, leaf.shape))} ({what})")
    if bad:
        shown = "; ".join(bad[:8]) + (f"; and {len(bad) - 8} more" if len(bad) > 8 else "")
        raise ValueError(
            f"{who}: {len(bad)} skeleton weight(s) are exactly 0: {shown}. The basis paths through a zero skeleton "
            "weight have value 0, so the weights after it cannot be represented in path coordinates and G-SGD "
            "would never move them. Give those entries a small nonzero value, or trace with skeleton='values' "
            "to choose skeleton edges among the nonzero weights of these params."
        )


class _Chart(NamedTuple):
    """Node vectors of G-SGD's chart at one point (`chart`), in the compute dtype.

    On a coordinate entry ``e = u -> v`` (neither gauge nor incoming skeleton), ``∂L/∂φ_e = g_e k_src[u] k_dst[v]``,
    ``φ_e = w_e p_src[u] p_dst[v]`` and a coordinate update ``dφ_e`` moves ``w_e`` by ``dφ_e k_src[u] k_dst[v]``
    before the in-skeleton ratios: ``k = σ / (A_u B_v)`` and ``p = 1 / k``, products of two node factors, so that
    every per-entry quantity is one elementwise product of broadcast node vectors, fused by XLA into the
    passes over the weights that read g and w anyway. The incoming skeleton entry of x has σ = ``s_in[x]``.
    """

    factors: tuple  # (A, B, 1/A, 1/B)
    k: tuple  # (k_src, k_dst)
    p: tuple  # (p_src, p_dst)
    guard: bool  # the raw chart (σ = 1): k and p are products that can overflow, so each entry is made finite
    s_in: jax.Array  # σ at each node's incoming skeleton entry
    corr: jax.Array  # σ times the in-skeleton correction of ∂L/∂c (`_in_skeleton_correction`)


def _materialize(*vecs):
    """The node vectors ``vecs`` as computed arrays, through one gather.

    XLA:CPU fuses a node vector's whole expression (frexp, powers of two, square roots) into every per-entry
    loop that reads it, so it is recomputed once per entry, in each of those loops; a gather is never fused
    there (an optimization barrier is removed before fusion). On the 784-512-512-10 MLP this took 0.15 ms of
    G-SGD's 1.1 ms update. The vectors are stacked as columns and the gather takes whole rows: gathering along
    the second axis of a row-wise stack made XLA:CPU transpose the stack first, one more kernel per call.
    """
    stack = jnp.stack(vecs, axis=1)
    rows = jnp.take(stack, np.arange(stack.shape[0], dtype=np.int32), axis=0, mode="clip")
    return tuple(rows[:, i] for i in range(len(vecs)))


def _pair(vecs, li, guard):
    f = _take(vecs[0], li.src_r) * _take(vecs[1], li.dst_r)
    return _finite(f) if guard else f


def chart(space: PathSpace, w_leaves, g_leaves, ct, alpha):
    """G-SGD's view of one point: ``(∂L/∂φ, φ, chart)`` with ``φ = c / σ`` (`coord_scales`), leaves in ``ct``.

    ``alpha``: `balanced_frame` of the point, or None for the raw coordinates (σ = 1). On a coordinate entry
    ``σ_e / (A_u B_v) = sgn(A_u B_v) α_u / α_v``, so ∂L/∂φ = σ ∂L/∂c is the gradient in the balanced frame, up to
    sign. An entry with ``σ = 0`` (a singular chart) has ``φ = 0`` and ``∂L/∂φ = 0``.
    """
    sk = skeleton(space)
    a, b = _node_factors(space, w_leaves, ct)
    ia, ib = _safe_inv(a), _safe_inv(b)
    if alpha is None:
        k, p, s_in = (ia, ib), (a, b), jnp.ones_like(a)
    else:
        sa, sb = jnp.sign(a), jnp.sign(b)
        k = (_finite(sa * alpha), _finite(sb / alpha))
        p = (_finite(sa / alpha), _finite(sb * alpha))
        s_in = _finite(jnp.abs(a * b)) * _inv_v_norms(space, w_leaves, ct, alpha)  # |c_x| / ‖v_x‖
    corr = _in_skeleton_correction(space, w_leaves, g_leaves, ct, ia, ib) * s_in
    k_in = (ia, ib * s_in)  # at x's incoming skeleton entry, ∂L/∂φ = g s_in / (A_parent B_x) + corr
    phi_in = _finite(a * b) * _safe_inv(s_in)  # φ there: c_x / σ_x
    k0, k1, p0, p1, kin0, kin1, phi_in, corr = _materialize(*k, *p, *k_in, phi_in, corr)
    k, p, k_in = (k0, k1), (p0, p1), (kin0, kin1)
    chart = _Chart((a, b, ia, ib), k, p, alpha is None, s_in, corr)
    gphis, phis = [], []
    for w, g, li in zip(w_leaves, g_leaves, sk.leaves):
        w, g = jnp.asarray(w, ct), jnp.asarray(g, ct)
        if li.kind == "other":
            gphis.append(g)
            phis.append(w)
            continue
        shape = jnp.shape(w)
        gphi = g * _pair(k, li, chart.guard)
        phi = w * _pair(p, li, chart.guard)
        im, gm = li.inskel_mask(shape), li.gauge_mask(shape)
        if im is not None:
            gphi = jnp.where(im, g * _pair(k_in, li, True) + _take(corr, li.dst_r), gphi)
            phi = jnp.where(im, _take(phi_in, li.dst_r), phi)
        if gm is not None:
            gphi = jnp.where(gm, 0, gphi)
            phi = jnp.where(gm, w, phi)
        gphis.append(gphi)
        phis.append(phi)
    return gphis, phis, chart


def balancing_factors(space: PathSpace, alpha):
    """Per leaf, the powers of two ``2^(k_v − k_u)`` that take params towards their balanced frame.

    ``k_v = round(log2 α_v)`` with ``alpha`` = `balanced_frame` (0 where α is 0 or not finite, |k| ≤ 60).
    Multiplying every edge ``u -> v`` by it is a node-wise rescaling by powers of two: the function and every
    path value are bit for bit unchanged, and afterwards each hidden node is within a factor √2 of its place
    in the balanced frame (α within [2^-½, 2^½]). None for leaves of kind "other".
    """
    return _edge_products(space, *_balancing_pow2(alpha))


def _balancing_pow2(alpha):
    """The node vectors ``(2^k, 2^-k)`` of `balancing_factors`."""
    m, e = jnp.frexp(alpha)  # α = m 2^e, m in [½, 1): exact, so k shifts exactly under power-of-two rescalings
    k = jnp.where(m < 2**-0.5, e - 1, e).astype(alpha.dtype)
    ok = jnp.isfinite(alpha) & (alpha > 0)
    return _pow2_pair(_frame_k(jnp.where(ok, k, 0)))


def allocate(
    space: PathSpace, w_leaves, dphi_leaves, chart: _Chart, ct, min_ratio: float, min_share: float = 0.0, alpha=None
):
    """Weight updates realising coordinates ``c + σ dφ`` with the gauge fixed (weight allocation).

    The in-skeleton rule (see `pathspace_jax.in_path_space`): each incoming skeleton coordinate
    ``c_x = A_x B_x`` moves by the ratio ``ρ_x = max(1 + dc_x / c_x, lo_x)`` with
    ``lo_x = max(min_ratio, min(1, min_share / share_x))`` (ρ = 1 where c_x = 0); it depends on
    coordinates and their updates only, so it commutes with rescaling. Then ``A'_x = ρ_x A_x``
    (inherited along gauge in-edges), ``w'_e = (c_e + dc_e) / (A'_u B_v)``; the gauge does not move.
    With ``alpha`` (`balanced_frame`), the new weights are also rescaled by `balancing_factors` (exact powers of
    two, multiplied into the node vectors: no pass of their own).
    """
    sk = skeleton(space)
    a, b, ia, ib = chart.factors
    n = space.num_nodes
    parts = [
        (li.inskel_node, _get_flat(jnp.asarray(d, ct), li.inskel_flat))
        for d, li in zip(dphi_leaves, sk.leaves)
        if li.inskel_flat.size
    ]
    d_in = _node_sum(n, parts, ct) * chart.s_in  # the update of each node's incoming skeleton coordinate
    free = jnp.asarray(sk.hidden & ~sk.in_is_gauge)
    lo = jnp.full((n,), min_ratio, ct)
    # the share |c_x| / s_x may not drop below min_share (nor shrink at all if already below); min_share
    # may be a tracer (optax.inject_hyperparams)
    if isinstance(min_share, jax.core.Tracer) or min_share > 0:
        share = _skeleton_share(space, w_leaves, chart.factors, ct)
        lo = jnp.maximum(lo, jnp.minimum(min_share * _safe_inv(share), 1))
    rho = jnp.maximum(1 + d_in * _finite(ia * ib), lo)
    r0 = jnp.where(free, rho, 1)
    r = r0
    if sk.in_is_gauge.any():
        gate = jnp.asarray(sk.in_is_gauge)
        for _ in range(sk.depth_in):
            r = jnp.where(gate, r[sk.parent], r0)
    ir = 1 / r
    # at the in-skeleton entry of x (from its parent): w' = w · ρ_x / R_parent(x)
    ratio_in = rho * ir[sk.parent]
    up, down = (jnp.ones((n,), ct),) * 2 if alpha is None else _balancing_pow2(alpha)
    ir_down = ir * down
    up, down, ir_down, up_in = _materialize(up, down, ir_down, ratio_in * up)
    out = []
    for w, d, li in zip(w_leaves, dphi_leaves, sk.leaves):
        d = jnp.asarray(d, ct)
        if li.kind == "other":
            out.append(d)
            continue
        w = jnp.asarray(w, ct)
        shape = jnp.shape(w)
        f_dst, f_src = _take(up, li.dst_r), _take(down, li.src_r)
        u = (w + d * _pair(chart.k, li, chart.guard)) * _take(ir_down, li.src_r) * f_dst - w
        im, gm = li.inskel_mask(shape), li.gauge_mask(shape)
        if im is not None:
            u = jnp.where(im, w * (_take(up_in, li.dst_r) * f_src) - w, u)
        if gm is not None:
            u = jnp.where(gm, w * (f_dst * f_src) - w, u)
        out.append(u)
    return out
