"""G-SGD's engine: the normalised chart of the path coordinates and the weight allocation, in O(m).

`chart` views one point of the params in path space: ``φ = c / σ``, the coordinates c of
`pathspace_jax.coords` divided by rescaling-invariant scales σ (`coord_scales`, from the path norms
of the balanced frame, `balanced_frame`), with ∂L/∂φ by the inverse chain rule. `allocate` takes a step
in φ back to weights (the weight allocation of Meng et al.), with the rebalancing that keeps the
params near their balanced frame. `pathspace_jax.in_path_space` runs any optax optimizer on φ with these two.

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

from pathspace_jax.coords import node_factors, to_coords
from pathspace_jax.frames import (
    edge_products,
    finite,
    frame_k,
    get_flat,
    jit_when_eager,
    materialize,
    node_sum,
    on_params_mesh,
    pow2_pair,
    safe_inv,
    take,
    xla_options,
)
from pathspace_jax.graph import BIAS_NODE, PathSpace, compute_dtype
from pathspace_jax.skeleton import Skeleton, levels, skeleton

__all__ = ["coord_scales", "check_chart", "path_norms", "balanced_frame", "frame_level", "balancing_factors",
           "chart", "chart_at", "allocate"]  # fmt: skip


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
            parts.append((li.gauge_node, -get_flat(g, li.gauge_flat) * get_flat(w, li.gauge_flat)))
    p = node_sum(space.num_nodes, parts, ct)  # Σ g_e w_e over the non-gauge entries leaving each node
    t = -p
    if sk.in_is_gauge.any():
        gate = jnp.asarray(sk.in_is_gauge)
        for _ in range(sk.depth_in):
            t = -p + jnp.zeros_like(p).at[sk.parent].add(jnp.where(gate, t, 0))
    return t * finite(ia * ib)


def _skeleton_share(space: PathSpace, w_leaves, factors, ct):
    """Per node x: |c_{inskel(x)}| / s_x, s_x the norm of the coordinates of all edges into x (invariant)."""
    sk = skeleton(space)
    a, b, ia, ib = factors
    parts = [
        (li.dst_r, jnp.sum(jnp.square(jnp.asarray(w, ct) * take(a, li.src_r)), axis=li.dst_sum_axes, keepdims=True))
        for w, li in zip(w_leaves, sk.leaves)
        if li.kind != "other"
    ]
    s2 = node_sum(space.num_nodes, parts, ct)
    # |c_x| / s_x = |A_x B_x| / (|B_x| sqrt(s2_x)) = |A_x| / sqrt(s2_x)
    return jnp.where(jnp.asarray(sk.hidden & ~sk.in_is_gauge), jnp.abs(a) * safe_inv(jnp.sqrt(s2)), 0)


# Recurrent kernels (edges within one node group) count in the path norms along every path through up to
# this many of them: the path norm of the network unrolled over that many steps plus one. Kept short: the
# longer the unroll, the more the frame depends on powers of the recurrent kernels (exponentially in their
# spectral radii); with 16, G-Adam diverged on a stacked ReLU RNN that it trains with 2 (and with none).
RECURRENT_STEPS = 2


@functools.lru_cache(maxsize=64)
def _sweep_plan(space: PathSpace, forward: bool):
    """Static plan of `path_norms`: per level d, ``(nodes at d, parts, lateral)``, each of ``parts`` and
    ``lateral`` a tuple of ``(leaf index, far-end node mask or None)``.

    Forward (levels: BFS depth from the inputs): the edges into a hidden node v at depth d in ``parts`` are
    its bias edge and its weight edges from nodes of smaller depth. Backward (levels: BFS distance to the
    outputs): the weight edges out of v to nodes closer to the outputs. These are the admissible skeleton
    edges (`pathspace_jax.skeleton`): never an edge within one node group. ``lateral`` holds the edges
    between hidden nodes of level d themselves (recurrent kernels). The mask selects the far ends (sources
    forward, destinations backward) where a leaf's far ends are not all admissible; the near end is v itself,
    which `path_norms` selects by level. O(nodes) per leaf and level: no array per parameter entry.
    """
    level, hidden, idx = levels(space)[0 if forward else 1], space.node_kinds() == 2, skeleton(space).leaves
    far_ok = (level >= 0)[None, :] & (level[None, :] < np.arange(1, int(level[hidden].max(initial=0)) + 1)[:, None])
    if forward:
        far_ok[:, BIAS_NODE] = True
    plan = []
    for d, ok in enumerate(far_ok, start=1):
        at = hidden & (level == d)
        parts, lateral = [], []
        for li, leaf in enumerate(space.leaves):
            if leaf.kind == "other" or not leaf.size:
                continue
            near, far = (idx[li].dst_r, idx[li].src_r)[:: 1 if forward else -1]
            if not at[near].any():
                continue
            for out, mask, use in ((parts, ok, True), (lateral, at, leaf.kind == "weight")):
                if use and mask[far].any():
                    out.append((li, None if mask[far].all() else np.array(mask)))
        if parts or lateral:
            plan.append((at, tuple(parts), tuple(lateral)))
    return tuple(plan)


def _separate_sums() -> bool:
    """Whether `path_norms` keeps each dense kernel's sums out of the fusions that consume them: on a GPU.

    XLA:GPU fuses a dense kernel's column sum into the elementwise op over every node that consumes it, one
    thread per node summing its column alone, a sizeable part of a small step's device time. An optimisation
    barrier keeps each such sum a reduction of its own, which is faster there (also for Path-SGD's κ⁽¹⁾, whose
    frame takes the same path norms). XLA:CPU fuses the sweeps well.
    """
    return jax.default_backend() == "gpu"


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
    separate = _separate_sums()

    def terms(parts, q, forward):
        vals = []
        for li, mask in parts:
            idx = sk.leaves[li]
            read, write, axes = (
                (idx.src_r, idx.dst_r, idx.dst_sum_axes) if forward else (idx.dst_r, idx.src_r, idx.sum_axes)
            )
            w = jnp.asarray(leaves[li], dtype)
            q_far = q if mask is None else jnp.where(mask, q, 0)
            t = w * (w * take(q_far, read))  # not square(w) · q: a W² shared by both sweeps would be materialised
            # a leaf given as its small array (`frame_level`): the axes it broadcasts along count their size
            times = np.prod([space.leaves[li].shape[k] for k in axes if t.shape[k] == 1], dtype=np.int64)
            s = jnp.sum(t, axis=axes, keepdims=True) * times
            vals.append((write, jax.lax.optimization_barrier(s) if separate and t.ndim == 2 else s))
        return node_sum(space.num_nodes, vals, dtype)

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
    per entry, fan_in the number of the leaf's edges into the entry's destination node (of its layer's slice, for a
    leaf stacked over layers), and biases 0.
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
    ref = []  # 1 / sqrt(fan_in) as a small array broadcasting to the leaf: O(nodes), not O(params)
    for leaf, li in zip(space.leaves, skeleton(space).leaves, strict=True):
        if leaf.kind != "weight":
            ref.append(np.zeros((1,) * len(leaf.shape), np.float32))
            continue
        # per layer for a leaf stacked over layers (``nn.scan``): each slice is initialised as its own kernel
        dst, axes = li.dst_r, li.dst_sum_axes
        stacked = leaf.stacked is not None
        per_node = np.prod([leaf.shape[k] for k in axes if k > 0 or not stacked], dtype=np.int64)
        fan_in = np.stack([np.bincount(d.ravel(), minlength=space.num_nodes)[d] for d in (dst if stacked else [dst])])
        ref.append(np.reshape(1 / np.sqrt(fan_in * per_node), dst.shape).astype(np.float32))
    # compiled ahead of time and called with numpy arrays: concrete inside a trace too, and one program (op by op,
    # seconds for a U-Net)
    norms = jax.jit(path_norms, static_argnums=(0, 2)).lower(space, ref, "float32").compile(xla_options())
    q_in, q_out = (np.asarray(q, np.float64) for q in norms(ref))
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
            wf = w * (take(alpha, li.dst_r) / take(alpha, li.src_r))
            rows.append((li.src_r, jnp.sum(jnp.square(wf), li.sum_axes, keepdims=True)))
        if li.gauge_flat.size:  # less the gauge entries (a gather, as in `_in_skeleton_correction`)
            node = li.gauge_node
            rows.append((node, -jnp.square(get_flat(w, li.gauge_flat) * (alpha[sk.child[node]] / alpha[node]))))
        if li.inskel_flat.size:  # x's own incoming skeleton weight: a gather, not a pass over the leaf
            node = li.inskel_node
            own.append((node, jnp.square(get_flat(w, li.inskel_flat) * (alpha[node] / alpha[sk.parent[node]]))))
    # ≥ 0 although the gauge entry is subtracted from its row's sum (rounding could leave it below 0)
    v2 = jnp.maximum(node_sum(space.num_nodes, rows, ct), 0) + node_sum(space.num_nodes, own, ct)
    return finite(jax.lax.rsqrt(v2))


def _scales(space: PathSpace, w_leaves, c_leaves, factors, ct, alpha):
    """Per leaf, σ of `coord_scales` (None for leaves of kind "other"); ``alpha``: `balanced_frame`."""
    a, b = factors[:2]
    s_src = finite(jnp.abs(a) * alpha)  # |A_u| in the balanced frame
    s_dst = finite(jnp.abs(b) / alpha)  # |B_v| in the balanced frame
    inv_v = _inv_v_norms(space, w_leaves, ct, alpha)
    out = []
    for w, c, li in zip(w_leaves, c_leaves, skeleton(space).leaves):
        if li.kind == "other":
            out.append(None)
            continue
        shape = jnp.shape(w)
        s = jnp.broadcast_to(take(s_src, li.src_r) * take(s_dst, li.dst_r), shape)
        im, gm = li.inskel_mask(shape), li.gauge_mask(shape)
        if im is not None:
            s = jnp.where(im, jnp.abs(c) * take(inv_v, li.dst_r), s)
        if gm is not None:
            s = jnp.where(gm, 1, s)
        out.append(s)
    return out


@on_params_mesh
@jit_when_eager()
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
    factors = node_factors(space, leaves, ct)
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
        if isinstance(w, jax.core.Tracer) or li.kind == "other" or not getattr(w, "is_fully_addressable", True):
            continue  # abstract, or spread over other processes: checked where the values are (or not at all)
        for what, idx in (("incoming skeleton", li.inskel_flat), ("gauge (outgoing skeleton)", li.gauge_flat)):
            with jax.ensure_compile_time_eval():  # concrete params closed over by the caller's jit: read them now
                at = np.asarray(jnp.ravel(w)[idx]) if idx.size else idx  # the skeleton's entries only, on device
            for k in idx[at == 0]:
                bad.append(f"'{leaf.path}' entry {tuple(int(i) for i in np.unravel_index(k, leaf.shape))} ({what})")
    if bad:
        shown = "; ".join(bad[:2]) + (f"; {len(bad) - 2} more" if len(bad) > 2 else "")
        raise ValueError(
            f"{who}: {len(bad)} skeleton weight(s) are exactly 0 ({shown}): G-SGD could never move the weights "
            "behind them. Fix: trace with these params (trace then avoids zero weights where it can), or give "
            "those entries a nonzero value."
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


def _pair(vecs, li, guard):
    f = take(vecs[0], li.src_r) * take(vecs[1], li.dst_r)
    return finite(f) if guard else f


def chart(space: PathSpace, w_leaves, g_leaves, ct, alpha):
    """G-SGD's view of one point: ``(∂L/∂φ, φ, chart)`` with ``φ = c / σ`` (`coord_scales`), leaves in ``ct``.

    ``alpha``: `balanced_frame` of the point, or None for the raw coordinates (σ = 1). On a coordinate entry
    ``σ_e / (A_u B_v) = sgn(A_u B_v) α_u / α_v``, so ∂L/∂φ = σ ∂L/∂c is the gradient in the balanced frame, up to
    sign. An entry with ``σ = 0`` (a singular chart) has ``φ = 0`` and ``∂L/∂φ = 0``.
    """
    sk = skeleton(space)
    a, b = node_factors(space, w_leaves, ct)
    ia, ib = safe_inv(a), safe_inv(b)
    if alpha is None:
        k, p, s_in = (ia, ib), (a, b), jnp.ones_like(a)
    else:
        sa, sb = jnp.sign(a), jnp.sign(b)
        k = (finite(sa * alpha), finite(sb / alpha))
        p = (finite(sa / alpha), finite(sb * alpha))
        s_in = finite(jnp.abs(a * b)) * _inv_v_norms(space, w_leaves, ct, alpha)  # |c_x| / ‖v_x‖
    corr = _in_skeleton_correction(space, w_leaves, g_leaves, ct, ia, ib) * s_in
    k_in = (ia, ib * s_in)  # at x's incoming skeleton entry, ∂L/∂φ = g s_in / (A_parent B_x) + corr
    phi_in = finite(a * b) * safe_inv(s_in)  # φ there: c_x / σ_x
    k0, k1, p0, p1, kin0, kin1, phi_in, corr = materialize(*k, *p, *k_in, phi_in, corr)
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
            gphi = jnp.where(im, g * _pair(k_in, li, True) + take(corr, li.dst_r), gphi)
            phi = jnp.where(im, take(phi_in, li.dst_r), phi)
        if gm is not None:
            gphi = jnp.where(gm, 0, gphi)
            phi = jnp.where(gm, w, phi)
        gphis.append(gphi)
        phis.append(phi)
    return gphis, phis, chart


def chart_at(space: PathSpace, params, grads, normalize: bool, rebalance: bool):
    """`chart` at a params tree for a gradient tree: ``(w, g, compute dtype, ∂L/∂φ, φ as a tree like params, the
    chart's node vectors, the balanced frame α)`` (α None unless ``normalize`` or ``rebalance``; the chart is
    the raw one of Meng et al. unless ``normalize``)."""
    w = space.leaves_of(params, "params")
    g = space.leaves_of(grads, "updates")
    ct = compute_dtype(list(w) + list(g))
    alpha = balanced_frame(space, w, ct) if normalize or rebalance else None
    gphi, phi, nodes = chart(space, w, g, ct, alpha if normalize else None)
    phi_tree = space.unflatten_like(params, [x.astype(jnp.result_type(y)) for x, y in zip(phi, w, strict=True)])
    return w, g, ct, gphi, phi_tree, nodes, alpha


def balancing_factors(space: PathSpace, alpha):
    """Per leaf, the powers of two ``2^(k_v − k_u)`` that take params towards their balanced frame.

    ``k_v = round(log2 α_v)`` with ``alpha`` = `balanced_frame` (0 where α is 0 or not finite, |k| ≤ 60).
    Multiplying every edge ``u -> v`` by it is a node-wise rescaling by powers of two: the function and every
    path value are bit for bit unchanged, and afterwards each hidden node is within a factor √2 of its place
    in the balanced frame (α within [2^-½, 2^½]). None for leaves of kind "other".
    """
    return edge_products(space, *_balancing_pow2(alpha))


def _balancing_pow2(alpha):
    """The node vectors ``(2^k, 2^-k)`` of `balancing_factors`."""
    m, e = jnp.frexp(alpha)  # α = m 2^e, m in [½, 1): exact, so k shifts exactly under power-of-two rescalings
    k = jnp.where(m < 2**-0.5, e - 1, e).astype(alpha.dtype)
    ok = jnp.isfinite(alpha) & (alpha > 0)
    return pow2_pair(frame_k(jnp.where(ok, k, 0)))


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
        (li.inskel_node, get_flat(jnp.asarray(d, ct), li.inskel_flat))
        for d, li in zip(dphi_leaves, sk.leaves)
        if li.inskel_flat.size
    ]
    d_in = node_sum(n, parts, ct) * chart.s_in  # the update of each node's incoming skeleton coordinate
    free = jnp.asarray(sk.hidden & ~sk.in_is_gauge)
    lo = jnp.full((n,), min_ratio, ct)
    # the share |c_x| / s_x may not drop below min_share (nor shrink at all if already below); min_share
    # may be a tracer (optax.inject_hyperparams)
    if isinstance(min_share, jax.core.Tracer) or min_share > 0:
        share = _skeleton_share(space, w_leaves, chart.factors, ct)
        lo = jnp.maximum(lo, jnp.minimum(min_share * safe_inv(share), 1))
    rho = jnp.maximum(1 + d_in * finite(ia * ib), lo)
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
    up, down, ir_down, up_in = materialize(up, down, ir_down, ratio_in * up)
    out = []
    for w, d, li in zip(w_leaves, dphi_leaves, sk.leaves):
        d = jnp.asarray(d, ct)
        if li.kind == "other":
            out.append(d)
            continue
        w = jnp.asarray(w, ct)
        shape = jnp.shape(w)
        f_dst, f_src = take(up, li.dst_r), take(down, li.src_r)
        u = (w + d * _pair(chart.k, li, chart.guard)) * take(ir_down, li.src_r) * f_dst - w
        im, gm = li.inskel_mask(shape), li.gauge_mask(shape)
        if im is not None:
            u = jnp.where(im, w * (take(up_in, li.dst_r) * f_src) - w, u)
        if gm is not None:
            u = jnp.where(gm, w * (f_dst * f_src) - w, u)
        out.append(u)
    return out
