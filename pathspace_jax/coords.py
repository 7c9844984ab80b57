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
into a few elementwise kernels per leaf (`pathspace_jax.frames.take`, `pathspace_jax.frames.node_sum`).

G-SGD's chart and weight allocation, built on these maps, are in `pathspace_jax.gsgd`.

References:
  Meng et al., "G-SGD: Optimizing ReLU neural networks in its positively scale-invariant space",
  ICLR 2019; "Path Space for Recurrent Neural Networks with ReLU Activations" (skeleton method,
  weight allocation).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pathspace_jax.frames import jit_when_eager, node_gather, on_params_mesh, safe_inv, take
from pathspace_jax.graph import PathSpace, compute_dtype
from pathspace_jax.skeleton import Skeleton, skeleton

__all__ = ["to_coords", "from_coords", "coord_mask", "basis_paths", "canonicalize", "skeleton_init"]


# ---------------------------------------------------------------------------- chains of skeleton weights


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
    q = jnp.where(jnp.asarray(sk.in_is_gauge), c_in, c_in * safe_inv(b))
    q = jnp.where(jnp.asarray(sk.hidden), q, 1)
    if not sk.in_is_gauge.any():
        return q
    a = jnp.ones_like(q)
    for _ in range(sk.depth_in):
        a = jnp.where(jnp.asarray(sk.in_is_gauge), a[sk.parent] * q, q)
    return a


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


def node_factors(space, leaves, dtype):
    """(A, B) node vectors from the params' leaves."""
    sk = skeleton(space)
    a = _chain_A(sk, node_gather(space, leaves, "in", dtype))
    b = _chain_B(sk, node_gather(space, leaves, "out", dtype))
    return a, b


# ---------------------------------------------------------------------------- public maps


@on_params_mesh
@jit_when_eager()
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
    a, b = node_factors(space, leaves, ct)
    coord = lambda w, li: w * (take(a, li.src_r) * take(b, li.dst_r))  # noqa: E731
    return _map_edge_leaves(space, params, leaves, ct, coord, lambda w: w)


@on_params_mesh
@jit_when_eager()
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
    b = _chain_B(sk, node_gather(space, leaves, "out", ct))
    a = _A_from_coords(sk, node_gather(space, leaves, "in", ct), b)

    def weight(c, li):
        f = take(a, li.src_r) * take(b, li.dst_r)
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


@on_params_mesh
@jit_when_eager()
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
    b = jnp.abs(_chain_B(sk, node_gather(space, leaves, "out", ct)))
    inv_b = safe_inv(b)
    scaled = lambda w, li: w * (take(b, li.dst_r) * take(inv_b, li.src_r))  # noqa: E731
    return _map_edge_leaves(space, params, leaves, ct, scaled, jnp.sign)


@on_params_mesh
@jit_when_eager()
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
