"""Path coordinates, basis paths, canonicalize and G-SGD (`in_path_space`, `g_sgd`, `g_adam`).

Every property is checked against an independent computation: products of weights along
`basis_paths` read straight from ``ravel_pytree(params)``, the incidence matrix's rank with numpy,
and ∂L/∂v from a dense least-squares solve of the inverse chain rule ∂L/∂w = (∂v/∂w)ᵀ ∂L/∂v with
∂v/∂w by ``jax.jacfwd`` of those products. Invariance uses power-of-two rescalings (exact).
"""

from __future__ import annotations

import functools
import inspect

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree
from zoo import MLP, ZOO, Spaces

import pathspace_jax as pj

CASES = list(ZOO.values())
IDS = [c.name for c in CASES]
SMALL = [
    "mlp",
    "residual_cnn",
    "stacked_rnn_every_step",
    "embedding_rnn",
    "tanh_mlp_partly_pinned",
    "plain_nested_jit_remat_custom_vjp",
]


def _jitted(tx):
    return optax.GradientTransformationExtraArgs(jax.jit(tx.init), jax.jit(tx.update))


@pytest.fixture(scope="module")
def spaces():
    return Spaces()


def _leaves(tree):
    return jax.tree_util.tree_leaves(tree)


def _rows(space):
    """(m, L) basis-path rows in ravel order."""
    return np.concatenate([r.reshape(-1, r.shape[-1]) for r in _leaves(pj.basis_paths(space))])


def _path_values(rows, flat):
    """Product of the weights on each row (independent of `to_coords`)."""
    return jnp.prod(jnp.where(rows >= 0, flat[np.maximum(rows, 0)], 1.0), axis=-1)


def _inskel(rows):
    """In-skeleton entries, found from the paths alone: coordinate entries on another entry's basis path."""
    on_other_paths = np.zeros(rows.shape[0], bool)
    for i, row in enumerate(rows):
        on_other_paths[[j for j in row[row >= 0] if j != i]] = True
    return on_other_paths & (rows[:, 0] >= 0)


def _edges(space):
    """Every edge entry as parallel arrays in ravel order, and the admissible skeleton edges, by brute force: the
    BFS levels relaxed edge by edge over the full (src, dst) arrays (independent of the library's bundles)."""
    kinds = space.node_kinds()
    group = np.full(space.num_nodes, -1)
    for gi, g in enumerate(space.groups):
        group[g.offset : g.offset + g.size] = gi
    src, dst, kind, lid, flat = [], [], [], [], []
    for li, leaf in enumerate(space.leaves):
        src += np.ravel(leaf.src).tolist()
        dst += np.ravel(leaf.dst).tolist()
        kind += [leaf.kind] * leaf.size
        lid += [li] * leaf.size
        flat += range(leaf.size)
    src, dst, kind, lid, flat = map(np.array, (src, dst, kind, lid, flat))
    ok = (kind == "weight") & (group[np.maximum(src, 0)] != group[np.maximum(dst, 0)])

    def bfs(start, a, b):
        level = np.where(start, 0, -1)
        for _ in range(space.num_nodes):
            for u, v in zip(a[ok], b[ok]):
                if level[u] >= 0 and (level[v] < 0 or level[v] > level[u] + 1):
                    level[v] = level[u] + 1
        return level

    depth = bfs((kinds == 1) | (kinds == 4), src, dst)
    entered = np.isin(np.arange(space.num_nodes), dst[kind == "weight"])  # an input in a residual stream ends paths
    dist = bfs((kinds == 3) | (kinds == 4) | ((kinds == 1) & entered), dst, src)
    hidden = kinds == 2
    incoming = ok & hidden[dst] & (depth[src] >= 0) & (depth[src] < depth[dst])
    outgoing = ok & hidden[src] & (dist[dst] >= 0) & (dist[dst] < dist[src])
    return dict(src=src, dst=dst, lid=lid, flat=flat, incoming=incoming, outgoing=outgoing, depth=depth, dist=dist)


def test_index_skeleton_is_its_rule(spaces):
    """The default skeleton, by its definition over the full edge list: hidden node v (the k-th of its group) lists
    its admissible incoming edges leaf by leaf, within a leaf by source node (parallel edges once), takes the
    (k mod count)-th source and, of the parallel edges from it in that leaf, the middle one in flat order; likewise
    outgoing. The library finds it from O(nodes) arrays per leaf; here every entry is enumerated."""
    from pathspace_jax.skeleton import levels, skeleton

    for case in CASES:
        space = spaces[case.name]
        e, sk = _edges(space), skeleton(space)
        np.testing.assert_array_equal(levels(space)[0], e["depth"], err_msg=case.name)
        np.testing.assert_array_equal(levels(space)[1], e["dist"], err_msg=case.name)
        for g in space.groups:
            if g.kind != "hidden":
                continue
            for k, v in enumerate(range(g.offset, g.offset + g.size)):
                for adm, me, them, leaf, flat in (
                    (e["incoming"], e["dst"], e["src"], sk.in_leaf, sk.in_flat),
                    (e["outgoing"], e["src"], e["dst"], sk.out_leaf, sk.out_flat),
                ):
                    sel = np.flatnonzero(adm & (me == v))
                    listed = sorted({(e["lid"][i], them[i]) for i in sel})  # by leaf, then by node
                    if not listed:
                        continue
                    li, u = listed[k % len(listed)]
                    parallel = sorted(e["flat"][i] for i in sel if e["lid"][i] == li and them[i] == u)
                    assert (leaf[v], flat[v]) == (li, parallel[len(parallel) // 2]), (case.name, v)


def _loss_fn(case):
    x = case.inputs(4)
    y = jnp.sin(jnp.arange(np.prod(jax.eval_shape(case.fn, case.params, x).shape))).reshape(
        jax.eval_shape(case.fn, case.params, x).shape
    )
    return jax.jit(lambda p, b: jnp.mean((case.fn(p, b[0]) - b[1]) ** 2)), (x, y)


def _final_loss(model, x, y, tx, params, steps):
    """Cross-entropy of ``model`` after ``steps`` full-batch steps of ``tx`` from ``params`` (one jitted scan)."""

    def loss(p):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": p}, x), y).mean()

    def body(carry, _):
        p, s = carry
        u, s = tx.update(jax.grad(loss)(p), s, p)
        return (optax.apply_updates(p, u), s), None

    (p, _), _ = jax.jit(lambda p: jax.lax.scan(body, (p, tx.init(p)), None, length=steps))(params)
    return float(loss(p))


# ---------------------------------------------------------------------------- structure


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_basis_paths_coordinates_and_rank(case, spaces):
    space = spaces[case.name]
    flat, _ = ravel_pytree(case.params)
    rows = _rows(space)
    mask = np.concatenate([np.ravel(m) for m in _leaves(pj.coord_mask(space))])
    assert mask.sum() == space.num_params - space.num_hidden
    np.testing.assert_array_equal(mask, rows[:, 0] >= 0)  # gauge rows are all -1

    # every coordinate is the product of the weights on its basis path
    coords = np.concatenate([np.ravel(c) for c in _leaves(pj.to_coords(space, case.params))])
    np.testing.assert_allclose(coords[mask], np.asarray(_path_values(rows, flat))[mask], rtol=1e-13, atol=1e-15)

    # the paths are real input -> output paths of the reduction graph containing their own entry
    src = np.concatenate([np.ravel(leaf.src) for leaf in space.leaves]).astype(np.int64)
    dst = np.concatenate([np.ravel(leaf.dst) for leaf in space.leaves]).astype(np.int64)
    edge = np.array([leaf.kind != "other" for leaf in space.leaves for _ in range(leaf.size)])
    kinds = space.node_kinds()
    for i in np.flatnonzero(mask):
        path = rows[i][rows[i] >= 0]
        assert list(path).count(i) == 1
        if not edge[i]:
            assert list(path) == [i]
            continue
        assert edge[path].all()
        np.testing.assert_array_equal(dst[path[:-1]], src[path[1:]])
        assert kinds[src[path[0]]] in (0, 1, 4), "a basis path starts at the bias, an input or a pinned node"
        # or at an input that edges enter (a residual stream that begins with the input itself, as a Mixer's)
        assert kinds[dst[path[-1]]] in (1, 3, 4), "a basis path ends at an output, a pinned node or an input"
        assert (kinds[src[path[1:]]] == 2).all(), "interior nodes are hidden"

    # incidence matrix (multiplicities) has rank m - H
    inc = np.zeros((int(mask.sum()), space.num_params))
    for k, i in enumerate(np.flatnonzero(mask)):
        np.add.at(inc[k], rows[i][rows[i] >= 0], 1.0)
    assert np.linalg.matrix_rank(inc) == space.num_params - space.num_hidden


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_coords_invariant_round_trip_canonicalize(case, spaces):
    space = spaces[case.name]
    p = case.params
    x = case.inputs(3)
    qs = [pj.random_rescale(space, p, jax.random.key(7))]
    for q in qs:
        assert any(not np.array_equal(a, b) for a, b in zip(_leaves(p), _leaves(q)))

    @jax.jit  # one compilation per model
    def everything(p, qs, x):
        c = pj.to_coords(space, p)
        canon = pj.canonicalize(space, p)
        return (
            c,
            pj.from_coords(space, c),
            canon,
            case.fn(canon, x),
            case.fn(p, x),
            [pj.to_coords(space, q) for q in qs],
            [pj.canonicalize(space, q) for q in qs],
        )

    c, back, canon, f_canon, f_p, cqs, canon_qs = everything(p, qs, x)
    mask = pj.coord_mask(space)
    chex.assert_trees_all_equal_shapes_and_dtypes(c, p)
    # the round trip is exact up to rounding: w·f/f, with f a product along the skeleton chains (a few ulps)
    for w, w_back in zip(_leaves(p), _leaves(back)):
        w, w_back = np.asarray(w), np.asarray(w_back)
        if not np.issubdtype(w.dtype, np.floating):
            np.testing.assert_array_equal(w_back, w)
            continue
        assert (np.abs(w_back - w) <= 4 * np.spacing(np.abs(w))).all(), np.abs(w_back - w).max()
    chex.assert_trees_all_close(f_canon, f_p, rtol=1e-11, atol=1e-13)
    for m, w in zip(_leaves(mask), _leaves(canon)):
        np.testing.assert_array_equal(np.abs(np.asarray(w)[~m]), 1.0)  # gauge weights are ±1
    # power-of-two rescalings are exact, so coordinates and the canonical member are unchanged bit for bit
    for cq, cn in zip(cqs, canon_qs):
        for m, a, b in zip(_leaves(mask), _leaves(c), _leaves(cq)):
            np.testing.assert_array_equal(np.asarray(a)[m], np.asarray(b)[m])
        chex.assert_trees_all_equal(cn, canon)
    # where the skeleton products are ±1 (skeleton_init) there is no rounding: the round trip is bitwise
    s = pj.skeleton_init(space, p)
    chex.assert_trees_all_equal(pj.from_coords(space, pj.to_coords(space, s)), s)


def test_skeleton_never_uses_biases_or_recurrent_edges(spaces):
    """Biases are coordinates on their own path only; no chain edge is within one node group."""
    for case in CASES:
        space = spaces[case.name]
        rows = _rows(space)
        kind = np.array([leaf.kind for leaf in space.leaves for _ in range(leaf.size)])
        group_of = np.full(space.num_nodes, -1)
        for gi, g in enumerate(space.groups):
            group_of[g.offset : g.offset + g.size] = gi
        src = np.concatenate([np.ravel(leaf.src) for leaf in space.leaves]).astype(np.int64)
        dst = np.concatenate([np.ravel(leaf.dst) for leaf in space.leaves]).astype(np.int64)
        for i, row in enumerate(rows):
            chain = [j for j in row[row >= 0] if j != i]
            assert all(kind[j] == "weight" for j in chain), case.name
            assert all(group_of[src[j]] != group_of[dst[j]] for j in chain), case.name
        assert (rows[kind == "bias", 0] >= 0).all()


@pytest.mark.parametrize(
    "name", ["mlp", "residual_cnn", "stacked_rnn_every_step", "concat_mlp", "cnn1d_stride_dilation_avgpool"]
)
def test_value_skeleton_takes_the_largest_paths_and_commutes_with_rescaling(name, spaces):
    """trace(skeleton="values") (opt-in): each node's chosen chain carries the largest |path value| among the
    admissible edges (checked by multiplying along the chains in numpy), and a rescaled copy of the params gets
    the same; the default skeleton comes from the graph alone."""
    from pathspace_jax.skeleton import skeleton

    case, by_index = ZOO[name], spaces[name]
    space = pj.trace(case.fn, case.params, case.inputs(2), skeleton="values")
    assert space.skeleton_edges is not None
    q = pj.random_rescale(space, case.params, jax.random.key(5))
    assert pj.trace(case.fn, q, case.inputs(2), skeleton="values") == space  # the same skeleton (part of the identity)

    flat = np.abs(np.asarray(ravel_pytree(case.params)[0]))
    sk = skeleton(space)

    def chain_product(chains):
        return np.prod(np.where(chains >= 0, flat[np.maximum(chains, 0)], 1.0), axis=1)

    a, b = chain_product(sk.chain_in_global()), chain_product(sk.chain_out_global())
    c = _edges(space)  # in ravel order
    e = np.flatnonzero(c["incoming"])
    assert (flat[e] * a[c["src"][e]] <= a[c["dst"][e]] * (1 + 1e-12)).all()
    e = np.flatnonzero(c["outgoing"])
    assert (flat[e] * b[c["dst"][e]] <= b[c["src"][e]] * (1 + 1e-12)).all()

    # the default, abstract params, or skeleton="index": the rule from the graph alone, whatever the values
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), case.params)
    assert by_index.skeleton_edges is None and by_index != space
    assert pj.trace(case.fn, abstract, case.inputs(2), skeleton="values") == by_index
    assert pj.trace(case.fn, q, case.inputs(2), skeleton="index") == by_index
    with pytest.raises(ValueError, match="skeleton must be"):
        pj.trace(case.fn, case.params, case.inputs(2), skeleton="largest")


@pytest.mark.slow
def test_g_sgd_from_a_standard_init_trains_at_sgd_learning_rates():
    """Normalised coordinates (the default): from Flax's standard init, G-SGD trains at SGD's learning rates on
    the index skeleton; on the raw basis-path values (``normalize=False``) the same learning rates diverge,
    because the step on a weight is η g / (A_u B_v)² with chain products of several small weights."""
    model = nn.Sequential([nn.Dense(32), nn.relu, nn.Dense(32), nn.relu, nn.Dense(4)])
    x = jax.random.normal(jax.random.key(0), (64, 10), jnp.float32) + 1.0  # not centred
    y = jnp.argmax(x[:, :4] + 0.5 * x[:, 4:8], -1)
    params = model.init(jax.random.key(1), x)["params"]
    run = lambda tx: _final_loss(model, x, y, tx, params, 300)  # noqa: E731
    space = pj.trace(lambda p, x: model.apply({"params": p}, x), params, x)
    start = _final_loss(model, x, y, optax.identity(), params, 0)
    for lr in (0.05, 0.2):
        l_sgd, l_g = run(optax.sgd(lr)), run(pj.g_sgd(space, lr))
        assert np.isfinite(l_g) and l_g < 0.2 * start and l_g < 1.2 * l_sgd + 1e-3, (lr, l_g, l_sgd)
        assert not run(pj.g_sgd(space, lr, normalize=False)) < 0.5 * start  # raw coordinates: no progress


# ---------------------------------------------------------------------------- G-SGD maths


def _dense_coord_grad(space, case, loss, batch):
    """∂L/∂v by least squares on ∂L/∂w = (∂v/∂w)ᵀ ∂L/∂v, with v = products along basis paths."""
    flat, unravel = ravel_pytree(case.params)
    rows = _rows(space)
    mask = rows[:, 0] >= 0
    jac = np.asarray(jax.jit(jax.jacfwd(lambda f: _path_values(rows[mask], f)))(flat))  # (m - H, m)
    gw = np.asarray(ravel_pytree(jax.grad(loss)(case.params, batch))[0])
    gv, *_ = np.linalg.lstsq(jac.T, gw, rcond=None)
    # the system is consistent: least squares in float64, to the gradient's size (rtol 1e-7, the step's own
    # tolerance below: the path products of a stack of four layers make it ill-conditioned, residuals ~1e-8)
    atol = 1e-10 * max(1.0, float(np.max(np.abs(gw))))
    np.testing.assert_allclose(jac.T @ gv, gw, rtol=1e-7, atol=atol)
    full = np.zeros(flat.size)
    full[mask] = gv
    return full, mask


@pytest.mark.parametrize("name", IDS)
def test_g_sgd_step_moves_coordinates_by_minus_eta_grad(name, spaces):
    """With default arguments one G-SGD step moves the normalised coordinates φ = c / σ by exactly −η ∂L/∂φ,
    i.e. c by −η σ² ∂L/∂c (σ: `coord_scales` at the step's start); with ``normalize=False`` c by −η ∂L/∂c.
    ∂L/∂c is found by least squares on the Jacobian of the brute-force path products, not by the library.
    Each model runs one pair of ``normalize`` and ``rebalance`` (which acts after the step, on the gauge weights
    alone), in turn along the zoo: each pair on a quarter of it."""
    case, space = ZOO[name], spaces[name]
    loss, batch = _loss_fn(case)
    gv, mask = _dense_coord_grad(space, case, loss, batch)
    c0 = np.asarray(ravel_pytree(pj.to_coords(space, case.params))[0])
    sigma = np.asarray(ravel_pytree(pj.coord_scales(space, case.params))[0])
    inskel = _inskel(_rows(space))
    assert np.all(sigma[mask] > 0) and np.all(sigma[~mask] == 1)  # 1 at the gauge
    g = jax.grad(loss)(case.params, batch)
    normalize, rebalance = [(True, True), (False, False), (True, False), (False, True)][IDS.index(name) % 4]
    want = -(sigma**2 if normalize else 1.0) * gv
    # small enough that no in-skeleton coordinate shrinks by half (the safeguard stays inactive)
    eta = min(1e-3, 0.4 * float(np.min(np.abs(c0[inskel] / want[inskel]), initial=np.inf)))
    tx = _jitted(pj.g_sgd(space, eta, normalize=normalize, rebalance=rebalance))
    u, _ = tx.update(g, tx.init(case.params), case.params)
    dc = np.asarray(ravel_pytree(pj.to_coords(space, optax.apply_updates(case.params, u)))[0]) - c0
    atol = 1e-12 * max(1, np.abs(c0).max())
    np.testing.assert_allclose(dc[mask], eta * want[mask], rtol=1e-7, atol=atol)
    assert not np.allclose(ravel_pytree(u)[0], -eta * ravel_pytree(g)[0])  # G-SGD is not plain SGD
    w0 = np.asarray(ravel_pytree(case.params)[0])
    ratio = (w0 + np.asarray(ravel_pytree(u)[0]))[~mask] / w0[~mask]
    if rebalance:  # the gauge weights move by powers of two only (towards the balanced frame)
        np.testing.assert_allclose(np.exp2(np.round(np.log2(np.abs(ratio)))), ratio, rtol=1e-12)
    else:  # gauge weights do not move
        np.testing.assert_array_equal(ratio, 1.0)


@pytest.mark.parametrize("name", ["mlp", "stacked_rnn_every_step"])
def test_in_path_space_adam_applies_adam_to_coordinate_gradient(name, spaces):
    case, space = ZOO[name], spaces[name]
    loss, batch = _loss_fn(case)
    gv, mask = _dense_coord_grad(space, case, loss, batch)
    lr = 1e-4
    tx = _jitted(pj.in_path_space(optax.adam(lr), space))
    state = tx.init(case.params)
    p = case.params
    sigma = np.asarray(ravel_pytree(pj.coord_scales(space, p))[0])
    g = jax.grad(loss)(p, batch)
    u, state = tx.update(g, state, p)
    new = optax.apply_updates(p, u)
    dc = np.asarray(ravel_pytree(pj.to_coords(space, new))[0] - ravel_pytree(pj.to_coords(space, p))[0])
    ref = optax.adam(lr)
    _, unravel = ravel_pytree(p)
    gphi = unravel(jnp.asarray(sigma * gv))  # ∂L/∂φ = σ ∂L/∂c
    expected, _ = ref.update(gphi, ref.init(gphi))
    want = sigma * np.asarray(ravel_pytree(expected)[0])  # dc = σ dφ
    np.testing.assert_allclose(dc[mask], want[mask], rtol=1e-6, atol=1e-4 * lr * sigma[mask].max())
    # g_adam is the same transformation
    g_adam = _jitted(pj.g_adam(space, lr))
    u2, _ = g_adam.update(g, g_adam.init(p), p)
    chex.assert_trees_all_close(u2, u, rtol=1e-12, atol=1e-15)


_TXS = {
    "g_sgd_momentum": lambda space: pj.g_sgd(space, 0.05, momentum=0.9),
    "g_adam": lambda space: pj.g_adam(space, 1e-2),
    "clip_schedule_sgd": lambda space: pj.in_path_space(
        optax.chain(optax.clip_by_global_norm(0.1), optax.sgd(optax.linear_schedule(0.1, 0.0, 5))), space
    ),
}


@pytest.mark.parametrize(
    "name, tx_name",
    [
        ("mlp", "g_sgd_momentum"),
        ("residual_cnn", "g_adam"),
        ("stacked_rnn_every_step", "clip_schedule_sgd"),
        ("embedding_rnn", "g_adam"),
        ("tanh_mlp_partly_pinned", "g_sgd_momentum"),
        ("tied_embedding_rnn", "g_sgd_momentum"),
        ("vmap_ensemble_mean", "g_adam"),
        ("plain_experts_einsum", "g_sgd_momentum"),
        ("separable_cnn_depthwise_grouped", "g_adam"),
        ("mixer_input_residual_stream", "g_sgd_momentum"),
        ("plain_graph_scatter_add", "g_adam"),
        ("layernorm_scale_offset_mlp", "g_sgd_momentum"),
        ("sigmoid_gated_mlp", "g_adam"),
    ],
)
def test_update_invariant_under_rescaling(name, tx_name, spaces):
    case, space = ZOO[name], spaces[name]
    loss, batch = _loss_fn(case)
    tx = _jitted(_TXS[tx_name](space))
    pj.testing.assert_update_invariant(tx, loss, space, case.params, batch, num_steps=2, rtol=1e-9, atol=1e-12)
    if name == "mlp":  # the assertion has teeth: plain SGD is not invariant
        with pytest.raises(AssertionError):
            pj.testing.assert_update_invariant(optax.sgd(0.05), loss, space, case.params, batch, rtol=1e-9)


# ---------------------------------------------------------------------------- sign flips, zero biases


def _propose(factor):
    """An inner transformation proposing dc = factor · c (it sees the coordinates as params)."""
    return optax.GradientTransformation(
        lambda p: optax.EmptyState(), lambda u, s, p=None: (jax.tree_util.tree_map(lambda c: factor * c, p), s)
    )


@pytest.mark.parametrize("name", ["mlp", "residual_cnn", "stacked_rnn_every_step"])
def test_in_skeleton_sign_flip_rule(name, spaces):
    """A step that would flip every coordinate: in-skeleton coordinates shrink by min_ratio instead."""
    case, space = ZOO[name], spaces[name]
    rows = _rows(space)
    mask = rows[:, 0] >= 0
    inskel = _inskel(rows)
    assert inskel.sum() > 0
    p = case.params
    c0 = np.asarray(ravel_pytree(pj.to_coords(space, p))[0])
    tx = _jitted(pj.in_path_space(_propose(-2.0), space, min_ratio=0.25))
    fn = jax.jit(case.fn)
    g = jax.tree_util.tree_map(jnp.zeros_like, p)
    results = []
    for q in (p, pj.random_rescale(space, p, jax.random.key(3))):
        u, _ = tx.update(g, tx.init(q), q)
        new = optax.apply_updates(q, u)
        assert all(np.isfinite(np.asarray(a)).all() for a in _leaves(new))
        c1 = np.asarray(ravel_pytree(pj.to_coords(space, new))[0])
        np.testing.assert_allclose(c1[inskel], 0.25 * c0[inskel], rtol=1e-12)  # shrunk, same sign
        np.testing.assert_allclose(c1[mask & ~inskel], -c0[mask & ~inskel], rtol=1e-12, atol=1e-15)
        results.append(fn(new, batch := case.inputs(3)))
    chex.assert_trees_all_close(results[0], results[1], rtol=1e-10, atol=1e-13)  # the rule is invariant
    # the opt-in share floor: no in-skeleton coordinate flips or vanishes, and it is invariant
    tx = _jitted(pj.in_path_space(_propose(-2.0), space, min_share=0.5))
    results = []
    for q in (p, pj.random_rescale(space, p, jax.random.key(3))):
        new = optax.apply_updates(q, tx.update(g, tx.init(q), q)[0])
        c1 = np.asarray(ravel_pytree(pj.to_coords(space, new))[0])
        assert np.all(np.sign(c1[inskel]) == np.sign(c0[inskel])) and np.all(
            np.abs(c1[inskel]) >= 0.5 * np.abs(c0[inskel])
        )
        results.append(fn(new, batch))
    chex.assert_trees_all_close(results[0], results[1], rtol=1e-10, atol=1e-13)


@pytest.mark.slow
def test_zero_initialised_biases_and_float_dtypes():
    model = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(6), nn.relu, nn.Dense(3)])
    x = jax.random.normal(jax.random.key(0), (5, 4))
    params = model.init(jax.random.key(1), x)["params"]
    assert any(np.all(np.asarray(b) == 0) for b in _leaves(params))  # Flax's zero biases
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float64):
        p = jax.tree_util.tree_map(lambda a, dtype=dtype: a.astype(dtype), params)
        xd = x.astype(dtype)
        space = pj.trace(lambda p, x: model.apply({"params": p}, x), p, xd)
        loss = lambda p: jnp.mean(model.apply({"params": p}, xd).astype(jnp.float32) ** 2)  # noqa: B023
        for tx in (pj.g_adam(space, 1e-2) if dtype == jnp.bfloat16 else pj.g_sgd(space, 0.1),):

            @jax.jit
            def step(q, state, tx=tx, loss=loss):
                g = jax.grad(loss)(q)
                u, state = tx.update(g, state, q)
                return u, g, optax.apply_updates(q, u), state

            state = tx.init(p)
            q = p
            for _ in range(3):
                u, g, q, state = step(q, state)
                chex.assert_trees_all_equal_dtypes(u, g)
            assert all(np.isfinite(np.asarray(a, np.float64)).all() for a in _leaves(q))
            assert not all(np.array_equal(a, b) for a, b in zip(_leaves(q), _leaves(p)))
        c = pj.to_coords(space, p)
        assert all(np.isfinite(np.asarray(a, np.float64)).all() for a in _leaves(pj.from_coords(space, c)))


def test_static_node_gathers_and_sums_match_numpy():
    """The O(nodes) kernels' static slices and segment sums (contiguous, repeated, overlapping and scattered
    index arrays) against numpy's fancy indexing and ``np.add.at``."""
    from pathspace_jax.frames import node_sum, take

    rng = np.random.default_rng(0)
    vec = jnp.asarray(rng.normal(size=12))
    parts_idx = [
        np.arange(2, 5).reshape(3, 1),  # a range
        np.arange(2, 5).reshape(1, 3),  # the same range again (summed first)
        np.arange(4, 8),  # overlapping the first: scattered
        np.array([[11], [0], [11]]),  # not a range, repeated node
        np.arange(9, 11),
    ]
    parts = [(idx, jnp.asarray(rng.normal(size=idx.shape))) for idx in parts_idx]
    want = np.zeros(12)
    for idx, vals in parts:
        np.add.at(want, idx.ravel(), np.asarray(vals).ravel())
        np.testing.assert_array_equal(take(vec, idx), np.asarray(vec)[idx])
    np.testing.assert_allclose(node_sum(12, parts, jnp.float64), want, rtol=1e-15, atol=1e-15)
    np.testing.assert_array_equal(node_sum(5, [], jnp.float64), np.zeros(5))


# ---------------------------------------------------------------------------- jit, vmap, errors


@pytest.mark.slow
def test_jit_no_recompile_vmap_and_errors(spaces):
    case, space = ZOO["stacked_rnn_every_step"], spaces["stacked_rnn_every_step"]
    loss, batch = _loss_fn(case)
    tx = pj.g_sgd(space, 0.05, momentum=0.9)
    traces = []

    @jax.jit
    def step(p, s):
        traces.append(1)
        u, s = tx.update(jax.grad(loss)(p, batch), s, p)
        return optax.apply_updates(p, u), s

    p, s = case.params, tx.init(case.params)
    for _ in range(3):
        p, s = step(p, s)
    assert len(traces) == 1
    # no parameter-sized state beyond the inner optimizer's
    assert _leaves(pj.g_sgd(space, 0.1).init(case.params)) == []
    adam_state = _leaves(pj.g_adam(space, 0.1).init(case.params))
    assert len(adam_state) == len(_leaves(optax.adam(0.1).init(case.params)))

    # vmap over an ensemble axis of params, grads and states
    members = [pj.random_rescale(space, case.params, k) for k in jax.random.split(jax.random.key(4), 3)]
    stack = lambda ts: jax.tree_util.tree_map(lambda *a: jnp.stack(a), *ts)  # noqa: E731
    ps = stack(members)
    gs = stack([jax.grad(loss)(m, batch) for m in members])
    ss = stack([tx.init(m) for m in members])
    us, _ = jax.jit(jax.vmap(tx.update))(gs, ss, ps)
    upd = jax.jit(tx.update)
    for i, m in enumerate(members):
        u, _ = upd(jax.grad(loss)(m, batch), tx.init(m), m)
        chex.assert_trees_all_close(jax.tree_util.tree_map(lambda a, i=i: a[i], us), u, rtol=1e-12, atol=1e-15)

    with pytest.raises(ValueError, match="needs params"):
        tx.update(gs, tx.init(case.params))

    # extra arguments reach an ExtraArgs inner
    seen = {}

    def upd(u, s, p=None, *, scale, **kw):
        seen["scale"] = scale
        return jax.tree_util.tree_map(lambda a: -scale * a, u), s

    tx2 = pj.in_path_space(optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), upd), space)
    tx2.update(jax.grad(loss)(case.params, batch), tx2.init(case.params), case.params, scale=0.5, other=1)
    assert seen["scale"] == 0.5
    with pytest.raises(ValueError):
        pj.in_path_space(optax.sgd(0.1), space, min_ratio=0.0)


def test_public_functions_called_with_concrete_arrays_run_as_one_program():
    """Called with concrete arrays, a public function of the params is lowered (and compiled) as one program, once
    per space and shapes; run op by op, each of its operations was lowered and compiled alone, seconds for a U-Net
    from an empty compilation cache. Inside a trace it is inlined in the caller's program, with the same values."""
    model = MLP(widths=(13, 11), out=5)  # widths no other test uses: none of its operations is compiled yet
    x = jax.random.normal(jax.random.key(0), (4, 9))
    params = model.init(jax.random.key(1), x)["params"]
    space = pj.trace(lambda p, x: model.apply({"params": p}, x), params, x)
    key, lowered = jax.random.key(2), []
    # float32, the same function in two programs: κ's entries are sums of terms up to ~100 times larger, summed in
    # another order (at XLA:CPU -O0 they differ by 2e-8)
    close = functools.partial(chex.assert_trees_all_close, rtol=1e-6, atol=1e-7)

    def listen(event, _, **kwargs):
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            lowered.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        for fn, args in ((pj.to_coords, (params,)), (pj.path_kappa, (params,)), (pj.random_rescale, (params, key))):
            del lowered[:]
            op_by_op = inspect.unwrap(fn)(space, *args)  # the function as written, outside any trace
            assert len(lowered) > 10, (fn.__name__, len(lowered))  # the count sees op-by-op dispatch
            del lowered[:]
            eager = fn(space, *args)
            assert len(lowered) == 1, (fn.__name__, len(lowered))
            fn(space, *args)
            assert len(lowered) == 1, fn.__name__  # cached
            close(eager, op_by_op)
            close(jax.jit(lambda *a, fn=fn: fn(space, *a))(*args), eager)
        state = pj.g_adam(space, 1e-3).init(params)  # a TrainState's init, called eagerly
        del lowered[:]
        chex.assert_trees_all_equal(pj.g_adam(space, 1e-3).init(params), state)
        assert not lowered  # another transformation on the space: nothing compiled again
        # G-SGD's step called eagerly: its chart and allocation are two programs, and SGD's operations; op by op,
        # the chart's many operations were compiled one by one (an RNN's G-Adam step: 5.9 s the first time, then
        # 26 ms; now 2.2 s, then 3 ms)
        grads = jax.tree_util.tree_map(lambda a: jnp.cos(a) / 8, params)
        tx = pj.g_sgd(space, 0.1)
        state = tx.init(params)
        del lowered[:]
        eager, _ = tx.update(grads, state, params)
        shapes = {a.shape for a in jax.tree_util.tree_leaves(params)}  # SGD's scaling: one operation per shape
        assert len(lowered) <= 2 + len(shapes), len(lowered)  # (op by op: 105)
        close(eager, jax.jit(tx.update)(grads, state, params)[0])
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


# ---------------------------------------------------------------------------- long run


class _RNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.RNN(nn.SimpleCell(8, activation_fn=nn.relu))(x)
        return nn.Dense(3)(h[:, -1])


@pytest.mark.slow
def test_10000_g_sgd_steps_on_relu_rnn_stay_finite():
    model = _RNN()
    key = jax.random.key(0)
    x = jax.random.normal(key, (16, 10, 4), jnp.float32)
    y = jnp.arange(16) % 3
    params = model.init(jax.random.key(1), x)["params"]
    space = pj.trace(lambda p, x: model.apply({"params": p}, x), params, x)

    def loss(p, xb):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": p}, xb), y).mean()

    def run(tx):
        def body(carry, k):
            p, s = carry
            xb = x + 0.1 * jax.random.normal(k, x.shape, x.dtype)
            u, s = tx.update(jax.grad(loss)(p, xb), s, p)
            return (optax.apply_updates(p, u), s), None

        (p, _), _ = jax.jit(lambda p: jax.lax.scan(body, (p, tx.init(p)), jax.random.split(key, 10_000)))(params)
        return p, loss(p, x)

    lr = 0.05
    p_sgd, l_sgd = run(optax.sgd(lr))
    assert np.isfinite(float(l_sgd))  # plain SGD tolerates this learning rate
    p_g, l_g = run(pj.g_sgd(space, lr))
    assert all(np.isfinite(np.asarray(a)).all() for a in _leaves(p_g))
    assert float(l_g) < float(loss(params, x))  # and it trained


@pytest.mark.parametrize("name", ["mlp", "residual_cnn", "stacked_rnn_every_step"])
def test_skeleton_init_sets_exactly_the_skeleton_to_signs(name, spaces):
    """Skeleton entries (found from the basis paths alone) become ±1 with their sign; nothing else moves;
    then every basis path's value is ± its middle weight (A = B = ±1)."""
    case, space = ZOO[name], spaces[name]
    rows = _rows(space)
    skel = _inskel(rows) | (rows[:, 0] < 0)
    flat = np.asarray(ravel_pytree(case.params)[0])
    new = np.asarray(ravel_pytree(pj.skeleton_init(space, case.params))[0])
    np.testing.assert_array_equal(new[~skel], flat[~skel])
    np.testing.assert_array_equal(new[skel], np.where(flat[skel] < 0, -1.0, 1.0))
    coord = rows[:, 0] >= 0
    np.testing.assert_allclose(np.abs(_path_values(rows, jnp.asarray(new)))[coord], np.abs(new)[coord], rtol=1e-12)


@pytest.mark.slow
def test_g_sgd_from_skeleton_init_trains_like_sgd():
    """From `skeleton_init` (A = B = ±1, so ∂L/∂c = ±∂L/∂w at the non-skeleton entries) G-SGD trains at
    SGD's learning rate."""
    model = _RNN()
    x = jax.random.normal(jax.random.key(0), (16, 10, 4), jnp.float32)
    y = jnp.arange(16) % 3
    params = model.init(jax.random.key(1), x)["params"]
    space = pj.trace(lambda p, x: model.apply({"params": p}, x), params, x)
    start = pj.skeleton_init(space, params)
    l_sgd, l_g = (_final_loss(model, x, y, tx, start, 300) for tx in (optax.sgd(0.05), pj.g_sgd(space, 0.05)))
    l_start = _final_loss(model, x, y, optax.identity(), start, 0)
    assert np.isfinite(l_g) and l_g < 0.8 * l_start, (l_g, l_start)
    assert l_g < 2.0 * l_sgd + 0.05, (l_g, l_sgd)


@pytest.mark.slow
def test_zero_skeleton_weight_is_a_clear_error_at_init_and_a_zero_update_inside_jit():
    """A dead unit (all incoming weights 0) cannot be represented: the chart says where, G-SGD's init refuses it
    (also inside a jit that closes over the params: they are concrete there), and under jit with the params traced
    (no check possible) the update is finite and leaves the unrepresentable weights alone."""
    model = nn.Sequential([nn.Dense(6), nn.relu, nn.Dense(5), nn.relu, nn.Dense(3)])
    x = jax.random.normal(jax.random.key(0), (8, 4))
    params = model.init(jax.random.key(1), x)["params"]
    space = pj.trace(lambda p, x: model.apply({"params": p}, x), params, x)
    dead = jax.tree_util.tree_map(lambda a: a, params)
    dead["layers_2"]["kernel"] = dead["layers_2"]["kernel"].at[:, 3].set(0.0)  # unit 3 of the second layer
    pj.gsgd.check_chart(space, params)  # the standard init is fine
    with pytest.raises(ValueError, match=r"'layers_2/kernel' entry \(\d, 3\) \((incoming skeleton|gauge)"):
        pj.g_sgd(space, 0.1).init(dead)
    with pytest.raises(ValueError, match=r"'layers_2/kernel' entry \(\d, 3\)"):  # closed over by a jit: concrete
        jax.jit(lambda: pj.g_sgd(space, 0.1).init(dead))()
    back = pj.from_coords(space, pj.to_coords(space, dead))
    out = np.asarray(pj.coord_mask(space)["layers_4"]["kernel"][3])  # unit 3's outgoing coordinate entries
    np.testing.assert_array_equal(back["layers_4"]["kernel"][3][out], 0.0)  # documented: not representable
    assert out.any() and np.all(dead["layers_4"]["kernel"][3][out] != 0)
    tx = pj.g_sgd(space, 0.1)
    loss = lambda p: jnp.mean(model.apply({"params": p}, x) ** 2)  # noqa: E731
    u, _ = jax.jit(tx.update)(jax.grad(loss)(dead), tx.init(params), dead)
    assert all(np.isfinite(np.asarray(a)).all() for a in _leaves(u))
    np.testing.assert_array_equal(u["layers_4"]["kernel"][3], 0.0)
    np.testing.assert_array_equal(pj.coord_scales(space, dead)["layers_4"]["kernel"][3][out], 0.0)


def test_coord_scales_match_the_balanced_frame_computed_by_hand(spaces):
    """σ of the zoo MLP (4-7-6-3) against numpy: path norms layer by layer, α = λ (q_out / q_in)^¼ (λ per layer,
    from the path norms of LeCun's expected squared weights, written out for these widths), σ_e =
    |product of the basis path without e| α_u / α_v at coordinate entries, |c_x| / ‖v_x‖ at in-skeleton ones;
    1 at the gauge; and the same σ for a rescaled copy of the params."""
    case, space = ZOO["mlp"], spaces["mlp"]
    p = {k: {n: np.asarray(a) for n, a in v.items()} for k, v in case.params.items()}
    ws = [p[f"Dense_{i}"]["kernel"] for i in range(3)]
    bs = [p[f"Dense_{i}"]["bias"] for i in range(3)]
    q_in = [np.ones(4)]
    for w, b in zip(ws[:2], bs[:2]):
        q_in.append((w**2).T @ q_in[-1] + b**2)
    q_out = [np.ones(3)]
    for w in ws[:0:-1]:
        q_out.insert(0, (w**2) @ q_out[0])
    # the level λ, per layer: the same path norms with every squared weight 1 / fan_in (LeCun's expectation) and
    # biases 0: q_in = 4 × 1/4 = 1 on layer 1 and 7 × 1/7 = 1 on layer 2; q_out = 3 × 1/6 = 1/2 on layer 2 and
    # 6 × 1/7 × 1/2 = 3/7 on layer 1; log2 λ = ¼ log2(q_in / q_out) (computed in float32 whatever the params'
    # dtype, so that it is the same constant in every process)
    levels = [2 ** (np.log2(7 / 3) / 4), 2 ** (np.log2(2) / 4)]
    got = pj.gsgd.frame_level(space)
    np.testing.assert_allclose(got, np.concatenate([np.ones(5), np.repeat(levels, [7, 6]), np.ones(3)]), rtol=1e-6)
    levels = [got[5], got[12]]
    alpha = [np.ones(4), *(lv * (qo / qi) ** 0.25 for lv, qo, qi in zip(levels, q_out[:2], q_in[1:])), np.ones(3)]
    # per entry, in ravel order (per layer: bias, then kernel), the α of its source and target nodes
    a_src, a_dst = [], []
    for i in range(3):
        a_src += [np.ones_like(bs[i]), np.broadcast_to(alpha[i][:, None], ws[i].shape).ravel()]
        a_dst += [alpha[i + 1], np.broadcast_to(alpha[i + 1][None, :], ws[i].shape).ravel()]
    a_src, a_dst = np.concatenate(a_src), np.concatenate(a_dst)

    flat = np.asarray(ravel_pytree(case.params)[0])
    rows = _rows(space)
    mask, inskel = rows[:, 0] >= 0, _inskel(rows)
    c = np.asarray(_path_values(rows, jnp.asarray(flat)))
    want = np.ones_like(flat)
    want[mask] = np.abs(c[mask] / flat[mask]) * a_src[mask] / a_dst[mask]
    wf2 = (flat * a_dst / a_src) ** 2  # squared weights in the balanced frame
    offsets = np.cumsum([0] + [b.size + w.size for b, w in zip(bs, ws)])
    for i in np.flatnonzero(inskel):
        layer = np.searchsorted(offsets, i, side="right") - 1
        unit = (i - offsets[layer] - bs[layer].size) % ws[layer].shape[1]
        start = offsets[layer + 1] + bs[layer + 1].size + unit * ws[layer + 1].shape[1]
        out = np.arange(start, start + ws[layer + 1].shape[1])  # row `unit` of the next kernel
        want[i] = np.abs(c[i]) / np.sqrt(wf2[i] + wf2[out][mask[out]].sum())
    got = np.asarray(ravel_pytree(pj.coord_scales(space, case.params))[0])
    np.testing.assert_allclose(got, want, rtol=1e-12)
    rescaled = pj.coord_scales(space, pj.random_rescale(space, case.params, jax.random.key(2)))
    np.testing.assert_allclose(np.asarray(ravel_pytree(rescaled)[0]), want, rtol=1e-12)


class _RowRNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(10)(nn.RNN(nn.SimpleCell(64, activation_fn=nn.relu))(x)[:, -1])


@pytest.mark.parametrize(
    "model, shape",
    [
        (nn.Sequential([nn.Dense(128), nn.relu, nn.Dense(64), nn.relu, nn.Dense(10)]), (2, 64)),
        (_RowRNN(), (2, 8, 8)),
    ],
    ids=["mlp", "rnn"],
)
def test_a_standard_flax_init_is_on_average_its_own_balanced_frame(model, shape):
    """The level λ (`frame_level`) puts the balanced frame where Flax's standard initialisation is: the geometric
    mean of α over each layer's units is within 2^±0.15 of 1 (without the level it is 2^-0.92 and 2^-0.67 on this
    MLP's layers and 2^-0.68 on this RNN, so the normalised chart's first-layer steps were 3.6 and 2.6 times SGD's)."""
    x = jnp.ones(shape, jnp.float32)
    for seed in range(3):
        params = model.init(jax.random.key(seed), x)["params"]
        space = pj.trace(lambda p, x: model.apply({"params": p}, x), params, x)
        alpha = np.asarray(pj.gsgd.balanced_frame(space, space.leaves_of(params), jnp.float32))
        level = pj.gsgd.frame_level(space)
        for g in (space.groups[i] for i in space.hidden_groups):
            units = slice(g.offset, g.offset + g.size)
            assert abs(np.log2(alpha[units]).mean()) < 0.15, (g.name, np.log2(alpha[units]).mean())
            assert np.all(np.log2(level[units]) > 0.5)  # the level is what moved it


@pytest.mark.parametrize("gpu_form", [False, True])
def test_path_norms_of_a_relu_rnn_count_paths_through_the_recurrent_kernel_by_enumeration(gpu_form, monkeypatch):
    """q_in,v: Σ over every path from an input or the bias into v through up to RECURRENT_STEPS recurrent edges
    of the product of its squared weights (the unrolled network's paths); q_out,v likewise from v to the outputs.
    Enumerated path by path in float64, in both forms of the sweeps (the GPU's keeps each dense kernel's sums
    apart from their consumers), also under ``jit`` of ``vmap``."""
    import itertools

    from pathspace_jax.gsgd import RECURRENT_STEPS, path_norms

    monkeypatch.setattr(pj.gsgd, "_separate_sums", lambda: gpu_form)

    model = _RNN()  # 4 inputs, 8 hidden ReLU units with a recurrent kernel, 3 outputs
    x = jnp.ones((2, 5, 4), jnp.float32)
    p = jax.tree.map(lambda a: a + 0.1, model.init(jax.random.key(3), x)["params"])  # nonzero biases too
    space = pj.trace(lambda p, x: model.apply({"params": p}, x), p, x)
    w_in = np.asarray(p["SimpleCell_0"]["i"]["kernel"], np.float64)  # (4, 8): input i -> unit j
    b = np.asarray(p["SimpleCell_0"]["i"]["bias"], np.float64)
    u = np.asarray(p["SimpleCell_0"]["h"]["kernel"], np.float64)  # (8, 8): unit i -> unit j
    w_out = np.asarray(p["Dense_0"]["kernel"], np.float64)  # (8, 3)
    h = u.shape[0]

    def chains(k):  # every sequence of k + 1 hidden units: a path through k recurrent edges
        return itertools.product(range(h), repeat=k + 1)

    q_in, q_out = np.zeros(h), np.zeros(h)
    for k in range(RECURRENT_STEPS + 1):
        for chain in chains(k):
            through = np.prod([u[a, c] ** 2 for a, c in itertools.pairwise(chain)])
            q_in[chain[-1]] += through * (np.sum(w_in[:, chain[0]] ** 2) + b[chain[0]] ** 2)
            q_out[chain[0]] += through * np.sum(w_out[chain[-1]] ** 2)

    assert np.all(q_in > 1.5 * (np.sum(w_in**2, 0) + b**2))  # not vacuous: the recurrent paths count
    got_in, got_out = path_norms(space, space.leaves_of(p), jnp.float64)
    hidden = next(g for g in space.groups if g.size == h)
    units = slice(hidden.offset, hidden.offset + h)
    np.testing.assert_allclose(np.asarray(got_in)[units], q_in, rtol=1e-12)
    np.testing.assert_allclose(np.asarray(got_out)[units], q_out, rtol=1e-12)
    # batched over (p, 2 p): the norms of 2 p are those of p times 4 per weight on the path
    both = jax.jit(jax.vmap(lambda leaves: path_norms(space, leaves, jnp.float64)))(
        [jnp.stack([a, 2 * a]) for a in space.leaves_of(p)]
    )
    for batched, one in zip(both, (got_in, got_out), strict=True):
        np.testing.assert_allclose(batched[0], one, rtol=1e-12)
        assert np.all(np.asarray(batched[1])[units] >= 4 * np.asarray(one)[units])
