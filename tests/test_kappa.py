"""Path-SGD (issue 2): path_kappa and path_norm against their definitions, in float64, and the optax contract.

References are computed independently of pathspace_jax.kappa: γ²_net is the sum of the model's outputs
on an all-ones input with squared parameters (Neyshabur et al., "Path-normalized optimization of recurrent neural
networks with ReLU activations", Thm 3; models without average pooling) or a
hand-written function with the pooling coefficient squared, differentiated twice by ``jax.hessian``;
path norms are sums over explicitly enumerated paths of hand-built graphs.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from zoo import MLP, ZOO

import pathspace_jax as pj
from pathspace_jax.frames import kappa_from_frame
from pathspace_jax.gsgd import balanced_frame
from pathspace_jax.kappa import RankOne, full
from pathspace_jax.testing import assert_update_invariant

F64 = jnp.float64


def _normal(key, shape, scale=1.0):
    return scale * jax.random.normal(key, shape, F64)


def _tree_normal(params, seed, scale=0.5, shift=0.0):
    leaves, treedef = jax.tree_util.tree_flatten(params)
    ks = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree_util.tree_unflatten(
        treedef, [shift + _normal(k, jnp.shape(a), scale) for a, k in zip(leaves, ks, strict=True)]
    )


def _squared(p):
    return jax.tree_util.tree_map(lambda a: a * a, p)


def _half_hessian_diag(g, params):
    """½ diag ∇² g(params), leaf by leaf (jax.hessian of the whole pytree)."""
    h = jax.jit(jax.hessian(g))(params)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    out = []
    for path, leaf in leaves:
        block = h
        for k in path:
            block = block[k.key if hasattr(k, "key") else k.idx]
        for k in path:
            block = block[k.key if hasattr(k, "key") else k.idx]
        n = leaf.size
        out.append(0.5 * jnp.diagonal(block.reshape(n, n)).reshape(leaf.shape))
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params), out)


# ----------------------------------------------------------------------------- models


def mlp_fn(p, x):
    h = jax.nn.relu(x @ p["w0"] + p["b0"])
    h = jax.nn.relu(h @ p["w1"] + p["b1"])
    return h @ p["w2"] + p["b2"]


def _mlp_params(seed=0, sizes=(3, 4, 3, 2)):
    ks = jax.random.split(jax.random.key(seed), 2 * len(sizes))
    p = {}
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        p[f"w{i}"] = _normal(ks[2 * i], (a, b))
        p[f"b{i}"] = _normal(ks[2 * i + 1], (b,), 0.5)
    return p


def res_fn(p, x):
    h = jax.nn.relu(x @ p["w0"] + p["b0"])
    r = jax.nn.relu(h @ p["w1"] + p["b1"])
    s = h + r @ p["w2"] + p["b2"]
    return jax.nn.relu(s) @ p["w3"] + p["b3"]


def _res_params(seed=1):
    k = jax.random.split(jax.random.key(seed), 8)
    shapes = {"w0": (3, 4), "b0": (4,), "w1": (4, 3), "b1": (3,), "w2": (3, 4), "b2": (4,), "w3": (4, 2), "b3": (2,)}
    return {n: _normal(kk, s) for (n, s), kk in zip(shapes.items(), k, strict=True)}


def cnn_fn(p, x, avg_coef=0.25):
    """conv-relu-maxpool-conv-relu-avgpool(sum * avg_coef)-dense, NHWC, plain JAX."""
    dn = ("NHWC", "HWIO", "NHWC")
    h = jax.lax.conv_general_dilated(x, p["k0"], (1, 1), "SAME", dimension_numbers=dn) + p["c0"]
    h = jax.nn.relu(h)
    h = jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 1, 1, 1), "VALID")
    h = jax.nn.relu(jax.lax.conv_general_dilated(h, p["k1"], (1, 1), "VALID", dimension_numbers=dn) + p["c1"])
    h = jax.lax.reduce_window(h, 0.0, jax.lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") * avg_coef
    return h.reshape(h.shape[0], -1) @ p["w"] + p["b"]


def _cnn_params(seed=2):
    k = jax.random.split(jax.random.key(seed), 6)
    return {
        "k0": _normal(k[0], (2, 2, 1, 2)),
        "c0": _normal(k[1], (2,), 0.5),
        "k1": _normal(k[2], (2, 2, 2, 3)),
        "c1": _normal(k[3], (3,), 0.5),
        "w": _normal(k[4], (3 * 2 * 2, 2)),
        "b": _normal(k[5], (2,), 0.5),
    }


class LinenCNN(nn.Module):
    """flax conv, max pool, conv, dense (no average pooling: the model itself is the reference)."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(2, (2, 2), param_dtype=F64)(x))
        x = nn.max_pool(x, (2, 2), (2, 2))
        x = nn.relu(nn.Conv(3, (2, 2), padding="VALID", param_dtype=F64)(x))
        return nn.Dense(2, param_dtype=F64)(x.reshape(x.shape[0], -1))


class LinenSeparable(nn.Module):
    """A depthwise convolution (one filter per channel) and a grouped pointwise one (two groups of two channels)."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(4, (2, 2), param_dtype=F64)(x))
        x = nn.relu(nn.Conv(4, (2, 2), feature_group_count=4, param_dtype=F64)(x))
        x = nn.relu(nn.Conv(4, (1, 1), feature_group_count=2, param_dtype=F64)(x))
        return nn.Dense(2, param_dtype=F64)(x.reshape(x.shape[0], -1))


class LinenRNN(nn.Module):
    """ReLU SimpleCell RNN(s) with input biases; last-step or every-step Dense readout."""

    layers: int = 1
    every_step: bool = False
    reverse: bool = False
    hidden: int = 3

    @nn.compact
    def __call__(self, x):
        for _ in range(self.layers):
            cell = nn.SimpleCell(self.hidden, activation_fn=nn.relu, param_dtype=F64)
            x = nn.RNN(cell, reverse=self.reverse, keep_order=True)(x)
        return nn.Dense(2, param_dtype=F64)(x if self.every_step else x[:, -1])


def _linen(module, xshape, seed=0):
    x = _normal(jax.random.key(seed + 11), xshape)
    shapes = jax.eval_shape(module.init, jax.random.key(seed), x)["params"]
    params = _tree_normal(shapes, seed, scale=0.6)
    return (lambda p, x: module.apply({"params": p}, x)), params, x


ZOO_NAMES = {
    "multihead": "plain_multihead_einsum_position_bias",
    "ensemble": "vmap_ensemble_mean",
    "graph": "plain_graph_scatter_add",
    "local": "local_cnn_convlocal",
    "graph_max": "plain_graph_segment_max",
    "layer_scale": "layer_scale_mlp",
    "prelu": "prelu_mlp_scalar_gain",
    "dense_general": "dense_general_shared_readout",
    "shared_head": "vmap_members_shared_head",
    "positionwise": "positionwise_dense_flatten_head",
    "soft_moe": "soft_mixture_of_experts",
}


@functools.cache  # the same fn object across tests: compiled κ functions are reused
def _model(name):
    if name == "mlp":
        return mlp_fn, _mlp_params(), _normal(jax.random.key(3), (5, 3))
    if name == "res":
        return res_fn, _res_params(), _normal(jax.random.key(4), (5, 3))
    if name == "cnn":
        return cnn_fn, _cnn_params(), _normal(jax.random.key(5), (2, 6, 6, 1))
    if name == "linen_cnn":
        return _linen(LinenCNN(), (2, 6, 6, 1))
    if name.startswith("rnn"):
        kw = {"layers": 2 if "stacked" in name else 1, "every_step": "every" in name, "reverse": "reverse" in name}
        return _linen(LinenRNN(**kw), (2, 4, 2))
    if name == "separable":
        return _linen(LinenSeparable(), (2, 5, 5, 1))
    if name in ZOO_NAMES:  # heads × width nodes, a per-position bias; an nn.vmap ensemble; a graph; nn.ConvLocal
        case = ZOO[ZOO_NAMES[name]]
        return case.fn, case.params, case.inputs(2)
    raise KeyError(name)


def _output_sum(name, fn):
    """The sum of the network's output nodes: of its outputs, but for the ensemble, whose output nodes are the
    members' outputs, averaged after them."""
    return lambda p, x: jnp.sum(fn(p, x)) * (3.0 if name == "ensemble" else 1.0)


def _gamma2_reference(name, fn, x):
    """γ²_net(p) built independently: squared params on an all-ones input, pooling coefficient squared."""
    ones = jnp.ones((1, *x.shape[1:]), F64)
    if name == "cnn":
        return lambda p: jnp.sum(cnn_fn(_squared(p), ones, avg_coef=0.25**2))
    return lambda p: _output_sum(name, fn)(_squared(p), ones)


FEEDFORWARD = [
    "mlp",
    "res",
    "cnn",
    "linen_cnn",
    "multihead",
    "separable",
    "ensemble",
    "graph",
    "graph_max",
    "local",
    "layer_scale",
    "prelu",
    "dense_general",
    "shared_head",
    "positionwise",
]
RECURRENT = ["rnn_last", "rnn_stacked_every", "rnn_reverse_every"]  # single/stacked, last/every step, reverse


# ----------------------------------------------------------------------------- κ against jax.hessian


@pytest.mark.parametrize("name", FEEDFORWARD + RECURRENT)
def test_kappa_is_half_hessian_diagonal(name):
    fn, params, x = _model(name)
    space = pj.trace(fn, params, x)
    ref = _half_hessian_diag(_gamma2_reference(name, fn, x), params)
    kappa = pj.path_kappa(space, params)
    chex.assert_trees_all_close(kappa, ref, rtol=1e-10, atol=1e-12)
    kappa1 = pj.path_kappa(space, params, second_order=False)
    ones = jnp.ones((1, *x.shape[1:]), F64)
    if name != "cnn":  # κ⁽¹⁾ = ∂G/∂p̃: the gradient of γ² as a function of the squared params, by autodiff
        ref1 = jax.grad(lambda pt: _output_sum(name, fn)(pt, ones))(_squared(params))
        chex.assert_trees_all_close(kappa1, ref1, rtol=1e-10, atol=1e-12)
    for leaf, k1, r in zip(space.leaves, jax.tree_util.tree_leaves(kappa1), jax.tree_util.tree_leaves(ref)):
        if leaf.recurrent:  # κ⁽¹⁾ alone misses the pairs of uses of a recurrent kernel
            assert np.max(np.abs(np.asarray(k1 - r))) > 1e-3 * np.max(np.abs(np.asarray(r))), leaf.path
        else:
            np.testing.assert_allclose(k1, r, rtol=1e-10, atol=1e-12, err_msg=leaf.path)
    assert any(leaf.recurrent for leaf in space.leaves) == name.startswith("rnn")


@pytest.mark.parametrize("name", ["mlp", "res", "cnn", "linen_cnn"])
def test_first_order_kappa_equals_ddp_at_alpha_zero(name):
    fn, params, x = _model(name)
    space = pj.trace(fn, params, x)
    chex.assert_trees_all_close(
        pj.path_kappa(space, params, second_order=False), pj.ddp_kappa(space, params, x, alpha=0.0), rtol=1e-10
    )


# ----------------------------------------------------------------------------- path norms by enumeration


def _enumerate(edges, sources, sinks, p):
    """Σ over all source→sink paths of Π |w|^p in an explicit DAG given as {node: [(next, w), ...]}."""
    total = 0.0

    def walk(node, val):
        nonlocal total
        if node in sinks:
            total += val
        for nxt, w in edges.get(node, ()):
            walk(nxt, val * abs(float(w)) ** p)

    for s in sources:
        walk(s, 1.0)
    return total


def _mlp_graph(p, sizes=(3, 4, 3, 2)):
    """Nodes ("n", layer, j) (layer 0: inputs) and one bias node per layer ("b", layer)."""
    edges, sources = {}, [("n", 0, j) for j in range(sizes[0])]
    for layer in range(len(sizes) - 1):
        w, b = np.asarray(p[f"w{layer}"]), np.asarray(p[f"b{layer}"])
        for a in range(sizes[layer]):
            edges[("n", layer, a)] = [(("n", layer + 1, c), w[a, c]) for c in range(sizes[layer + 1])]
        sources.append(("b", layer + 1))
        edges[("b", layer + 1)] = [(("n", layer + 1, c), b[c]) for c in range(sizes[layer + 1])]
    return edges, sources, {("n", len(sizes) - 1, c) for c in range(sizes[-1])}


def _rnn_graph(p, t_len):
    """The unrolled graph of LinenRNN(layers=1, every_step=False) at length t_len."""
    wi, bi = np.asarray(p["SimpleCell_0"]["i"]["kernel"]), np.asarray(p["SimpleCell_0"]["i"]["bias"])
    wh = np.asarray(p["SimpleCell_0"]["h"]["kernel"])
    wo, bo = np.asarray(p["Dense_0"]["kernel"]), np.asarray(p["Dense_0"]["bias"])
    n_in, n = wi.shape
    edges, sources = {}, []
    for t in range(t_len):
        for a in range(n_in):
            sources.append(("x", t, a))
            edges[("x", t, a)] = [(("h", t, c), wi[a, c]) for c in range(n)]
        sources.append(("b", t))
        edges[("b", t)] = [(("h", t, c), bi[c]) for c in range(n)]
        for a in range(n):
            if t + 1 < t_len:
                edges[("h", t, a)] = [(("h", t + 1, c), wh[a, c]) for c in range(n)]
            else:
                edges[("h", t, a)] = [(("o", c), wo[a, c]) for c in range(wo.shape[1])]
    sources.append(("bo",))
    edges[("bo",)] = [(("o", c), bo[c]) for c in range(wo.shape[1])]
    return edges, sources, {("o", c) for c in range(wo.shape[1])}


@pytest.mark.parametrize("p", [1.0, 2.0, 3.0, 0.5])
def test_path_norm_matches_enumeration(p):
    params = _mlp_params(seed=7)
    space = pj.trace(mlp_fn, params, jnp.ones((2, 3), F64))
    edges, sources, sinks = _mlp_graph(params)
    ref = _enumerate(edges, sources, sinks, p) ** (1.0 / p)
    np.testing.assert_allclose(pj.path_norm(space, params, p=p), ref, rtol=1e-12)

    fn, rparams, x = _linen(LinenRNN(hidden=2), (2, 3, 2), seed=3)
    rspace = pj.trace(fn, rparams, x)
    ref = _enumerate(*_rnn_graph(rparams, 3), p) ** (1.0 / p)
    np.testing.assert_allclose(pj.path_norm(rspace, rparams, p=p), ref, rtol=1e-12)


@pytest.mark.slow
def test_one_fn_traced_at_two_lengths_gives_two_spaces():
    """The space's identity includes the argument shapes: κ and path norms are cached on it."""
    fn, params, _ = _linen(LinenRNN(hidden=2), (2, 3, 2), seed=3)
    spaces = {t: pj.trace(fn, params, jnp.ones((2, t, 2), F64)) for t in (1, 8)}
    assert spaces[1] != spaces[8]
    for t, space in spaces.items():
        ref = _enumerate(*_rnn_graph(params, t), 2.0) ** 0.5
        np.testing.assert_allclose(pj.path_norm(space, params), ref, rtol=1e-12)
        ones = jnp.ones((1, t, 2), F64)
        k_ref = _half_hessian_diag(lambda p, ones=ones: jnp.sum(fn(_squared(p), ones)), params)
        chex.assert_trees_all_close(pj.path_kappa(space, params), k_ref, rtol=1e-10, atol=1e-12)


@pytest.mark.slow
def test_path_norm_squared_is_gamma2_with_squared_pooling():
    fn, params, x = _model("cnn")
    space = pj.trace(fn, params, x)
    np.testing.assert_allclose(pj.path_norm(space, params) ** 2, _gamma2_reference("cnn", fn, x)(params), rtol=1e-12)


def _deep_params(depth=40, width=4, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(0), depth)
    ws = []
    for i, k in enumerate(ks):  # first half ×2^5, second half ×2^-5: intermediate path sums reach ~2^230
        scale = 2.0**5 if i < depth // 2 else 2.0**-5
        ws.append((scale * jax.random.uniform(k, (width, width), F64, 0.5, 1.0)).astype(dtype))
    return ws


def _deep_fn(ws, x):
    for w in ws[:-1]:
        x = jax.nn.relu(x @ w)
    return x @ ws[-1]


@pytest.mark.slow
def test_path_norm_deep_float32_does_not_overflow():
    ws = _deep_params()
    x = jnp.ones((1, 4), jnp.float32)
    space = pj.trace(_deep_fn, ws, x)
    w64 = [w.astype(F64) for w in ws]
    ones = jnp.ones((1, 4), F64)
    ref2 = float(jnp.sum(_deep_fn([w * w for w in w64], ones)))  # float64 reference (no overflow there)
    naive = jnp.sum(_deep_fn([w * w for w in ws], x.astype(jnp.float32)))
    assert not np.isfinite(float(naive)) or float(naive) == 0.0  # the naive float32 product overflows
    got = pj.path_norm(space, ws)
    assert got.dtype == jnp.float32 and np.isfinite(float(got))
    np.testing.assert_allclose(float(got), np.sqrt(ref2), rtol=1e-5)
    # a path norm outside the float32 range is inf (documented), not NaN
    big = [w * 8.0 for w in ws]
    assert float(pj.path_norm(space, big)) == np.inf


# ----------------------------------------------------------------------------- pinned groups as boundaries


class LinenLNTanh(nn.Module):
    """A LayerNorm in the middle (its group pinned) and a tanh head (the output group meets a tanh)."""

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(4, param_dtype=F64)(x))
        h = nn.LayerNorm(param_dtype=F64)(nn.Dense(4, param_dtype=F64)(h))
        h = nn.relu(nn.Dense(3, param_dtype=F64)(h))
        return jnp.tanh(nn.Dense(2, param_dtype=F64)(h))


class LinenTanhRNN(nn.Module):
    """A tanh RNN: the recurrent group is pinned, so the boundary cuts the recurrence at every step."""

    @nn.compact
    def __call__(self, x):
        h = nn.RNN(nn.SimpleCell(4, activation_fn=jnp.tanh, param_dtype=F64))(x)
        return nn.Dense(2, param_dtype=F64)(h[:, -1])


class LinenFusedLSTM(nn.Module):
    """Flax's fast LSTM (gate kernels concatenated from parameters: fixed coefficients) read by a ReLU layer: its
    state is a pinned group, and the paths start there; the LSTM's parameters lie on no path."""

    @nn.compact
    def __call__(self, x):
        h = nn.RNN(nn.OptimizedLSTMCell(4, param_dtype=F64))(x)
        return nn.Dense(2, param_dtype=F64)(nn.relu(nn.Dense(3, param_dtype=F64)(h[:, -1])))


def _boundary_gamma2(name, t_len=5):
    """γ²_net with pinned groups as boundaries, written out by hand: paths start at the inputs, the bias node
    and the pinned nodes (value 1), and end at the outputs and the pinned nodes."""

    def dense(a, p):
        return a @ p["kernel"] + p["bias"]

    if name == "ln_tanh":

        def g(p):
            q = _squared(p)
            to_ln = dense(dense(jnp.ones(3), q["Dense_0"]), q["Dense_1"])  # ends at the LayerNorm's input
            # the normalised value is a source; its scale an edge into hidden units of their own, the offset their bias
            scaled = jnp.ones(4) * q["LayerNorm_0"]["scale"] + q["LayerNorm_0"]["bias"]
            head = dense(dense(scaled, q["Dense_2"]), q["Dense_3"])  # to tanh's input
            return jnp.sum(to_ln) + jnp.sum(head)

        return g

    if name == "fused_lstm":

        def g(p):
            q = _squared(p)
            return jnp.sum(dense(dense(jnp.ones(4), q["Dense_1"]), q["Dense_0"]))  # Dense_0 is the outer one

        return g

    def g(p):  # tanh_rnn: one step's paths into z_t, the recurrent edge from h_{t-1} (none at t = 0)
        q, c = _squared(p), _squared(p)["SimpleCell_0"]
        steps = t_len * jnp.sum(dense(jnp.ones(3), c["i"])) + (t_len - 1) * jnp.sum(jnp.ones(4) @ c["h"]["kernel"])
        return steps + jnp.sum(dense(jnp.ones(4), q["Dense_0"]))

    return g


@pytest.mark.parametrize("name", ["ln_tanh", "tanh_rnn", "fused_lstm"])
def test_pinned_groups_are_boundaries(name):
    model, shape = {"ln_tanh": (LinenLNTanh(), (5, 3)), "tanh_rnn": (LinenTanhRNN(), (2, 5, 3)),
                    "fused_lstm": (LinenFusedLSTM(), (2, 5, 3))}[name]  # fmt: skip
    fn, params, x = _linen(model, shape)
    space = pj.trace(fn, params, x)
    assert any(g.reasons for g in space.groups if g.kind != "input")
    g = _boundary_gamma2(name)
    np.testing.assert_allclose(float(pj.path_norm(space, params)) ** 2, float(g(params)), rtol=1e-12)
    ref = _half_hessian_diag(g, params)
    chex.assert_trees_all_close(pj.path_kappa(space, params), ref, rtol=1e-10, atol=1e-12)
    chex.assert_trees_all_close(pj.path_kappa(space, params, second_order=False), ref, rtol=1e-10, atol=1e-12)
    if name == "ln_tanh":  # the LayerNorm's scale and offset are on paths, as edges into its units
        assert all(np.all(k > 0) for k in jax.tree.leaves(ref["LayerNorm_0"]))
    if space.num_hidden:  # (the tanh RNN has no hidden node: nothing to rescale)
        y = jnp.zeros_like(fn(params, x))
        for tx, kw in ((pj.path_sgd(space, 0.05), {}), (pj.ddp_sgd(space, 0.05, alpha=0.5), {"inputs": x})):
            assert_update_invariant(tx, jax.jit(_loss(fn)), space, params, (x, y), update_kwargs=kw, num_steps=2,
                                    rtol=1e-8, atol=1e-10)  # fmt: skip


def test_a_residual_stream_from_the_inputs_is_a_boundary_where_a_layernorm_reads_it():
    """``LayerNorm(x + MLP(x))`` with x the raw inputs: the stream's units are the inputs' (never rescaled), and the
    LayerNorm meets them. The paths into the stream end there, as at a pinned group, and the LayerNorm's outputs start
    new ones: κ and DDP-SGD's κ (α 0.5 and 1) of every leaf equal those of the two halves traced apart (the MLP with
    the stream as output, the head with the LayerNorm's outputs as inputs), and the squared path norm is their sum
    less the stream's identity from the inputs (no parameter on it, one per unit). Before, path_kappa and ddp_kappa
    refused the LayerNorm's square as "not positively homogeneous"."""
    k = jax.random.split(jax.random.key(2), 8)
    p = {"d1": _normal(k[0], (4, 6)), "b1": _normal(k[1], (6,), 0.1), "d2": _normal(k[2], (6, 4)),
         "s": 1 + _normal(k[3], (4,), 0.1), "c": _normal(k[4], (4,), 0.1), "h1": _normal(k[5], (4, 5)),
         "h2": _normal(k[6], (5, 2))}  # fmt: skip
    x = _normal(k[7], (8, 4))

    def stream(p, x):
        return x + jax.nn.relu(x @ p["d1"] + p["b1"]) @ p["d2"]

    def normalized(h):
        h = h - h.mean(-1, keepdims=True)
        return h * jax.lax.rsqrt((h * h).mean(-1, keepdims=True) + 1e-6)

    def head(p, z):
        return jax.nn.relu((z * p["s"] + p["c"]) @ p["h1"]) @ p["h2"]

    pa, pb = {n: p[n] for n in ("d1", "b1", "d2")}, {n: p[n] for n in ("s", "c", "h1", "h2")}
    z = normalized(stream(p, x))
    full, first, second = (
        pj.trace(lambda p, x: head(p, normalized(stream(p, x))), p, x),
        pj.trace(stream, pa, x),
        pj.trace(head, pb, z),
    )
    assert full.num_hidden == first.num_hidden + second.num_hidden == 15
    norms = [float(pj.path_norm(s, q)) ** 2 for s, q in ((full, p), (first, pa), (second, pb))]
    np.testing.assert_allclose(norms[0], norms[1] + norms[2] - 4, rtol=1e-12)
    chex.assert_trees_all_close(pj.path_kappa(full, p), {**pj.path_kappa(first, pa), **pj.path_kappa(second, pb)},
                                rtol=1e-12)  # fmt: skip
    for alpha in (0.5, 1.0):
        halves = {**pj.ddp_kappa(first, pa, x, alpha=alpha), **pj.ddp_kappa(second, pb, z, alpha=alpha)}
        chex.assert_trees_all_close(pj.ddp_kappa(full, p, x, alpha=alpha), halves, rtol=1e-12)


def test_attention_values_are_hidden_and_its_weights_are_one_in_the_squared_network():
    """Self-attention ``softmax(q kᵀ) v``: the weights are computed from pinned values (q and k, whose product pins
    them), so no rescaling changes them, and the values' units go on through the weighted sum into the output
    projection: hidden (they were pinned, as a product of activations). In the |w|^2 network the weights are
    boundary values, 1: every value position reaches every query position. γ² written by hand on the all-ones
    input (T positions): the paths that end at q and k, and those through the values, T of them per query."""
    t, ks = 3, jax.random.split(jax.random.key(8), 9)
    shapes = {"w0": (3, 6), "b0": (6,), "wq": (6, 4), "wk": (6, 4), "wv": (6, 4), "bv": (4,), "wo": (4, 2), "bo": (2,)}
    params = {n: 0.5 * jax.random.normal(k, s_, F64) for k, (n, s_) in zip(ks, shapes.items())}

    def fn(p, x):  # x: [B, T, 3]
        h = jax.nn.relu(x @ p["w0"] + p["b0"])
        q, k, v = h @ p["wq"], h @ p["wk"], h @ p["wv"] + p["bv"]
        a = jax.nn.softmax(jnp.einsum("btd,bsd->bts", q, k), axis=-1)
        return (jax.nn.relu(jnp.einsum("bts,bsd->btd", a, v)) @ p["wo"] + p["bo"]).sum(1)

    def gamma2(p):
        q = _squared(p)
        h = jnp.ones(3) @ q["w0"] + q["b0"]  # at every position
        values = h @ q["wv"] + q["bv"]
        out = (t * values) @ q["wo"] + q["bo"]  # the weights are 1: T value positions per query
        return t * (jnp.sum(h @ q["wq"]) + jnp.sum(h @ q["wk"]) + jnp.sum(out))

    x = jax.random.normal(jax.random.key(9), (5, t, 3), F64)
    space = pj.trace(fn, params, x)
    assert space.num_hidden == 6 + 4
    np.testing.assert_allclose(float(pj.path_norm(space, params)) ** 2, float(gamma2(params)), rtol=1e-12)
    ref = _half_hessian_diag(gamma2, params)
    chex.assert_trees_all_close(pj.path_kappa(space, params), ref, rtol=1e-10, atol=1e-12)
    pj.testing.assert_function_invariant(fn, space, params, x)


def _embed_fn(p, ids):
    return jax.nn.relu(p["emb"][ids] @ p["w0"] + p["b0"]) @ p["w1"] + p["b1"]


def _one_hot_fn(p, x):
    return jax.nn.relu((x @ p["emb"]) @ p["w0"] + p["b0"]) @ p["w1"] + p["b1"]


def test_token_ids_are_a_one_hot_input():
    """An embedding lookup table[ids] is the one-hot input times the table: path norms, Path-SGD's κ and DDP's κ
    (every α, exact) on token ids equal those of the one-hot formulation."""
    shapes = {"emb": (7, 3), "w0": (3, 4), "b0": (4,), "w1": (4, 2), "b1": (2,)}
    params = _tree_normal({k: jax.ShapeDtypeStruct(v, F64) for k, v in shapes.items()}, 5, scale=0.8)
    ids = jax.random.randint(jax.random.key(3), (6,), 0, 7)
    x = jax.nn.one_hot(ids, 7, dtype=F64)
    s_ids, s_hot = pj.trace(_embed_fn, params, ids), pj.trace(_one_hot_fn, params, x)
    np.testing.assert_allclose(float(pj.path_norm(s_ids, params)), float(pj.path_norm(s_hot, params)), rtol=1e-13)
    chex.assert_trees_all_close(pj.path_kappa(s_ids, params), pj.path_kappa(s_hot, params), rtol=1e-12)
    for alpha, moment in [(0.0, "second"), (0.5, "second"), (1.0, "second"), (0.5, "variance")]:
        got = pj.ddp_kappa(s_ids, params, ids, alpha=alpha, moment=moment)
        chex.assert_trees_all_close(got, pj.ddp_kappa(s_hot, params, x, alpha=alpha, moment=moment), rtol=1e-10)
    rows = np.unique(np.asarray(ids))  # not vacuous: at α = 1 only the rows in the batch have κ > 0
    k1 = np.asarray(pj.ddp_kappa(s_ids, params, ids, alpha=1.0)["emb"])
    assert np.all(k1[rows] > 0) and np.all(np.delete(k1, rows, axis=0) == 0)


# ----------------------------------------------------------------------------- the optax contract


def _loss(fn):
    return lambda p, b: jnp.mean((fn(p, b[0]) - b[1]) ** 2)


@pytest.mark.parametrize(
    "name, second_order",
    [("mlp", True), ("cnn", False), ("rnn_stacked_every", True), ("rnn_stacked_every", False), ("soft_moe", True)],
)
def test_update_is_rescaling_invariant(name, second_order):
    fn, params, x = _model(name)
    space = pj.trace(fn, params, x)
    y = jnp.zeros_like(fn(params, x))
    tx = pj.path_sgd(space, 0.05, second_order=second_order, eps=0.0, momentum=0.5, nesterov=True)
    assert_update_invariant(tx, jax.jit(_loss(fn)), space, params, (x, y), num_steps=2, rtol=1e-8, atol=1e-10)


def test_update_differs_from_sgd_on_unbalanced_network():
    fn, params, x = _model("mlp")
    space = pj.trace(fn, params, x)
    params = pj.random_rescale(space, params, jax.random.key(1), max_exponent=4)
    g = jax.grad(_loss(fn))(params, (x, jnp.zeros((5, 2), F64)))
    tx = pj.path_sgd(space, 1.0, normalize=False, floor=0.0)
    u, _ = tx.update(g, tx.init(params), params)
    ratio = np.concatenate(
        [np.ravel(-a / b) for a, b in zip(jax.tree_util.tree_leaves(u), jax.tree_util.tree_leaves(g))]
    )
    ratio = ratio[np.isfinite(ratio)]
    assert ratio.size > 20
    assert np.max(ratio) / np.min(ratio) > 10.0  # not a multiple of the gradient
    chex.assert_trees_all_close(
        u, jax.tree_util.tree_map(lambda a, k: jnp.where(k > 0, -a / k, 0), g, pj.path_kappa(space, params))
    )


@pytest.mark.parametrize("name", ["mlp", "cnn", "rnn_stacked_every"])
def test_normalized_step_is_path_sgd_times_a_leaf_constant(name):
    """The default ``normalize=True``: on each leaf the step is Path-SGD's ``−g/κ`` times one number, the geometric
    mean over the leaf's positive entries of κ in the balanced frame α of G-SGD's chart (``κ (α_u / α_v)²`` on
    ``u -> v``, a rescaling invariant), so the direction within a leaf is Path-SGD's; from params far from
    balance (exact rescalings)."""
    fn, params, x = _model(name)
    space = pj.trace(fn, params, x)
    params = pj.random_rescale(space, params, jax.random.key(1), max_exponent=4)
    g = jax.grad(_loss(fn))(params, (x, jnp.zeros_like(fn(params, x))))
    tx = pj.path_sgd(space, 1.0, floor=0.0)
    u, _ = tx.update(g, tx.init(params), params)
    alpha = np.asarray(balanced_frame(space, space.leaves_of(params), F64))
    kappa = space.leaves_of(pj.path_kappa(space, params))
    for leaf, gi, ui, k in zip(space.leaves, space.leaves_of(g), space.leaves_of(u), kappa, strict=True):
        k = np.asarray(k)
        balanced = np.broadcast_to(k * (alpha[leaf.src] / alpha[leaf.dst]) ** 2, k.shape)
        mean = np.exp(np.mean(np.log(balanced[balanced > 0])))
        want = np.where(k > 0, -np.asarray(gi) * mean / np.where(k > 0, k, 1), 0)
        np.testing.assert_allclose(ui, want, rtol=1e-9, atol=0, err_msg=leaf.path)
        assert 0 < mean < np.inf


@pytest.mark.slow
def test_jit_without_recompilation_and_every():
    fn, params, x = _model("rnn_last")
    space = pj.trace(fn, params, x)
    tx = pj.path_sgd(space, 0.01, every=3)
    traces = []

    @jax.jit
    def step(p, s):
        traces.append(1)
        g = jax.grad(_loss(fn))(p, (x, jnp.ones((2, 2), F64)))
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    state = tx.init(params)
    p = params
    kappas = []
    for _ in range(5):
        p_before = p
        p, state = step(p, state)
        st = state[0]
        kappas.append((p_before, _state_kappa(space, st)))
    assert len(traces) == 1
    # κ recomputed at steps 0 and 3 only
    chex.assert_trees_all_close(kappas[0][1], pj.path_kappa(space, kappas[0][0]))
    chex.assert_trees_all_close(kappas[2][1], kappas[0][1])
    chex.assert_trees_all_close(kappas[3][1], pj.path_kappa(space, kappas[3][0]))
    assert not np.allclose(np.asarray(kappas[3][1]["SimpleCell_0"]["h"]["kernel"]),
                           np.asarray(kappas[0][1]["SimpleCell_0"]["h"]["kernel"]))  # fmt: skip


@pytest.mark.parametrize("name", ["mlp", "rnn_stacked_every"])
def test_kept_kappa_is_path_kappa(name):
    """With ``every > 1`` the state keeps κ: a dense kernel's as `RankOne` vectors where the |·|² network's
    activation has one row (the MLP), as the full product where it has several (a readout applied at every
    step of an RNN), the rest as arrays; expanded, it is `path_kappa`'s."""
    fn, params, x = _model(name)
    space = pj.trace(fn, params, x)
    tx = pj.path_sgd(space, 0.01, second_order=False, every=2)
    _, state = jax.jit(tx.update)(jax.tree_util.tree_map(jnp.ones_like, params), tx.init(params), params)
    kept = jax.tree_util.tree_leaves(state[0].kept.unpack().kappa, is_leaf=lambda k: isinstance(k, RankOne))
    assert any(isinstance(k, RankOne) for k in kept) == (name == "mlp")
    got, want = _state_kappa(space, state[0]), pj.path_kappa(space, params, second_order=False)
    chex.assert_trees_all_close(got, want, rtol=1e-10, atol=0)


def _state_kappa(space, st):
    """κ of the params from a Path-SGD/DDP state (which keeps κ in the canonical frame)."""
    kept = st.kept.unpack()
    kappa, treedef = jax.tree_util.tree_flatten(kept.kappa, is_leaf=lambda k: isinstance(k, RankOne))  # κ = a bᵀ
    return jax.tree_util.tree_unflatten(treedef, kappa_from_frame(space, [full(k) for k in kappa], kept.log2_gauge))


@pytest.mark.slow
def test_vmap_over_an_ensemble():
    fn, params, x = _model("rnn_last")
    space = pj.trace(fn, params, x)
    members = [_tree_normal(params, s) for s in range(3)]
    stacked = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *members)
    got = jax.vmap(lambda p: pj.path_kappa(space, p))(stacked)
    for i, m in enumerate(members):
        chex.assert_trees_all_close(jax.tree_util.tree_map(lambda a, i=i: a[i], got), pj.path_kappa(space, m))
    norms = jax.vmap(lambda p: pj.path_norm(space, p))(stacked)
    np.testing.assert_allclose(norms, [pj.path_norm(space, m) for m in members], rtol=1e-12)


@pytest.mark.parametrize("dtype, name", [(jnp.float64, "mlp"), (jnp.float32, "rnn_last"), (jnp.bfloat16, "rnn_last")])
def test_dtype_preserved(dtype, name):
    fn, params, x = _model(name)
    params = jax.tree_util.tree_map(lambda a: a.astype(dtype), params)
    space = pj.trace(fn, params, x.astype(dtype))
    tx = pj.path_sgd(space, 0.1, every=2)  # the state keeps κ: in the params' dtype too
    g = jax.tree_util.tree_map(jnp.ones_like, params)
    u, s = jax.jit(tx.update)(g, tx.init(params), params)
    for a in jax.tree_util.tree_leaves((u, s[0].kept.unpack().kappa, pj.path_kappa(space, params))):
        assert a.dtype == dtype and np.all(np.isfinite(np.asarray(a, np.float32)))
    assert pj.path_norm(space, params).dtype == dtype


def test_dead_unit_gives_no_nan():
    fn, params, x = _model("mlp")
    params = dict(params)
    params["w1"] = params["w1"].at[:, 0].set(0.0)  # hidden unit 0 of layer 2: no input ...
    params["b1"] = params["b1"].at[0].set(0.0)
    params["w2"] = params["w2"].at[0, :].set(0.0)  # ... and no output: κ = 0 on its edges
    space = pj.trace(fn, params, x)
    kappa = pj.path_kappa(space, params)
    assert float(kappa["w2"][0, 0]) == 0.0 and float(kappa["w1"][0, 0]) == 0.0
    tx = pj.path_sgd(space, 0.1, eps=0.0)
    g = jax.grad(_loss(fn))(params, (x, jnp.ones((5, 2), F64)))
    u, _ = tx.update(g, tx.init(params), params)
    assert all(np.all(np.isfinite(np.asarray(a))) for a in jax.tree_util.tree_leaves(u))
    assert float(u["w2"][0, 0]) == 0.0


def test_non_finite_params_are_not_hidden_by_a_zero_step():
    """A NaN weight makes κ NaN on its paths: the step is NaN there, as SGD's is, never a silent 0 that
    `optax.apply_if_finite` could not see (the denominator's guard once read ``den > 0``)."""
    fn, params, x = _model("mlp")
    space = pj.trace(fn, params, x)
    bad = dict(params, w1=params["w1"].at[0, 0].set(jnp.nan))
    g = jax.grad(_loss(fn))(bad, (x, jnp.ones((5, 2), F64)))
    sgd_nan = [~np.isfinite(np.asarray(a)) for a in jax.tree_util.tree_leaves(g)]
    for tx in (pj.path_sgd(space, 0.1), pj.path_sgd(space, 0.1, every=3)):
        u, _ = tx.update(g, tx.init(params), bad)
        for s, a in zip(sgd_nan, jax.tree_util.tree_leaves(u)):
            assert np.all(~np.isfinite(np.asarray(a))[s])
        guarded = optax.apply_if_finite(tx, max_consecutive_errors=3)
        u, state = guarded.update(g, guarded.init(params), bad)
        assert int(state.notfinite_count) == 1 and all(np.all(np.asarray(a) == 0) for a in jax.tree_util.tree_leaves(u))


def test_errors():
    fn, params, x = _model("mlp")
    space = pj.trace(fn, params, x)
    tx = pj.scale_by_path_sgd(space)
    with pytest.raises(ValueError, match="needs params"):
        tx.update(params, tx.init(params))
    with pytest.raises(ValueError, match="every"):
        pj.scale_by_path_sgd(space, every=0)

    def part_of_rows_fn(p, ids):  # token ids that select part of each row: not an embedding lookup
        return jax.nn.relu(p["emb"][ids, :2]) @ p["w"]

    ep = {"emb": jnp.ones((5, 3), F64), "w": jnp.ones((2, 2), F64)}
    espace = pj.trace(part_of_rows_fn, ep, jnp.array([0, 1, 2]))
    with pytest.raises(pj.PathKappaUnsupportedError, match="whole rows"):
        pj.path_norm(espace, ep)


def _refused_at_alpha_0_taken_on_data(fn, space, params, x, line):
    """Path-SGD's κ and DDP-SGD's at α = 0 refuse, with the message ``line``; DDP-SGD's at α = 1 (on the data ``x``)
    is not 0 where the gradient of a loss is not: no weight the data trains is frozen."""
    with pytest.raises(pj.PathKappaUnsupportedError, match=line):
        pj.path_kappa(space, params)
    with pytest.raises(pj.DDPUnsupportedError, match=line):
        pj.ddp_kappa(space, params, x, alpha=0.0, estimator="exact")
    kappa = pj.ddp_kappa(space, params, x, alpha=1.0, estimator="exact")
    g = jax.grad(lambda p: jnp.sum(fn(p, x) ** 2))(params)
    assert not any(np.any((k == 0) & (d != 0)) for k, d in zip(jax.tree.leaves(kappa), jax.tree.leaves(g)))


def test_choices_between_activations_that_different_weights_feed_are_refused_where_kappa_would_freeze_them():
    """A maxout unit (``jnp.maximum`` of two layers) or a ``jnp.where`` on the data between two branches: the |w|^p
    network keeps one operand per entry, so κ is 0 on the other's weights, which the data trains (Path-SGD never
    updated them: κ = 0 on every entry of the second maxout piece, before this check). Path-SGD and DDP-SGD at
    α = 0 refuse, naming the user's line (the select of ``jnp.where`` lies in JAX's cached helper); DDP-SGD at
    α = 1 takes them. A ReLU written with ``jnp.where`` and a leaky ReLU pass."""
    ks = jax.random.split(jax.random.key(0), 5)
    a1, o = _normal(ks[0], (6, 8)), _normal(ks[1], (8, 3))
    x = -jnp.abs(_normal(ks[2], (16, 6)))  # the data takes the branch through u

    def maxout(p, x):
        return jnp.maximum(x @ p["a1"], x @ p["a2"]) @ p["o"]

    def branch(p, x):
        h = x @ p["a1"]
        return jnp.where(jnp.sum(x) < 0, jax.nn.relu(h @ p["u"]), h) @ p["o"]

    for fn, extra in ((maxout, {"a2": _normal(ks[3], (6, 8), 0.1)}), (branch, {"u": _normal(ks[4], (8, 8))})):
        p = {"a1": a1, "o": o, **extra}
        space = pj.trace(fn, p, x)
        line = r"at \S*test_kappa.py:\d+ \(test_choices_between\w+\) chooses between activations"
        _refused_at_alpha_0_taken_on_data(fn, space, p, x, line)
        assert all(np.any(g != 0) for g in jax.tree.leaves(jax.grad(lambda p, fn=fn: jnp.sum(fn(p, x) ** 2))(p)))

    def leaky(p, x):
        h = x @ p["a1"]
        return jnp.where(h > 0, h, 0.1 * h) @ p["o"]

    def where_relu(p, x):
        h = x @ p["a1"]
        return jnp.where(h > 0, h, 0.0) @ p["o"]

    q = {"a1": a1, "o": o}
    for fn in (leaky, where_relu):
        assert all(np.all(k > 0) for k in jax.tree.leaves(pj.path_kappa(pj.trace(fn, q, x), q)))


class _Pieces(nn.Module):
    """A ReLU head on pieces that different weights feed: a maxout layer written as ``Dense(5 * 3)`` reshaped to
    ``(5, 3)`` and its maximum over the pieces (``"maxout"``), or ``nn.ConvLocal`` (a kernel per position) then max
    pooling (``"local_pool"``)."""

    how: str

    @nn.compact
    def __call__(self, x):
        if self.how == "local_pool":
            h = nn.max_pool(nn.relu(nn.ConvLocal(2, (2, 2), padding="VALID", param_dtype=F64)(x)), (2, 2), (2, 2))
            h = h.reshape(x.shape[0], -1)
        else:
            h = nn.Dense(5 * 3, param_dtype=F64)(x).reshape(x.shape[0], 5, 3).max(-1)
        return nn.Dense(2, param_dtype=F64)(nn.relu(nn.Dense(4, param_dtype=F64)(h)))


@pytest.mark.parametrize("how", ["maxout", "local_pool"])
def test_a_maximum_over_pieces_that_different_weights_feed_is_refused_where_kappa_would_freeze_them(how):
    """A maximum over a kernel's pieces (maxout by a reshape) or max pooling over ``nn.ConvLocal``'s positions (a
    kernel each): the |w|^p network keeps one piece per entry, so κ is 0 on the others' weights (before: 10 of the
    maxout biases' 15 entries, 24 of ConvLocal's 32, with no error). Path-SGD and DDP-SGD at α = 0 refuse, naming
    the user's line; DDP-SGD at α = 1 takes them. Each maxout unit is a hidden node whose pieces rescale together
    (H = 5 + 4; a maximum over units pinned them); the function is invariant under that rescaling."""
    x = _normal(jax.random.key(0), (16, 5, 5, 1) if how == "local_pool" else (16, 3))
    model = _Pieces(how)
    p = model.init(jax.random.key(1), x)["params"]
    fn = lambda p, x: model.apply({"params": p}, x)  # noqa: E731
    space = pj.trace(fn, p, x)
    if how == "maxout":
        assert space.num_hidden == 5 + 4
    pj.testing.assert_function_invariant(fn, space, p, x)
    _refused_at_alpha_0_taken_on_data(fn, space, p, x, r"a maximum over pieces at \S*test_kappa.py:\d+ \(_Pieces")


def test_a_maxout_recurrent_cell_is_refused_and_a_maximum_over_time_steps_is_not():
    """In a recurrence's body: a maxout cell (the maximum of two pieces, each with its own input and recurrent
    kernel) froze its second piece under Path-SGD κ⁽¹⁾ (κ = 0 on all 40 of its entries, the body was not searched);
    a running maximum of a ReLU cell's states over time (from a zero carry) is no choice between weights."""
    ks = jax.random.split(jax.random.key(3), 6)
    p = {"w": _normal(ks[0], (3, 5)), "u": _normal(ks[1], (5, 5)), "o": _normal(ks[2], (5, 2))}
    x = _normal(ks[3], (4, 6, 3))

    def maxout_cell(p, x):
        def step(h, xt):
            return jnp.maximum(xt @ p["w"] + h @ p["u"], xt @ p["w2"] + h @ p["u2"]), None

        h, _ = jax.lax.scan(step, jnp.zeros((x.shape[0], 5), x.dtype), jnp.swapaxes(x, 0, 1))
        return h @ p["o"]

    def max_over_time(p, x):
        def step(carry, xt):
            h, m = carry
            h = jax.nn.relu(xt @ p["w"] + h @ p["u"])
            return (h, jnp.maximum(m, h)), None

        z = jnp.zeros((x.shape[0], 5), x.dtype)
        (_, m), _ = jax.lax.scan(step, (z, z), jnp.swapaxes(x, 0, 1))
        return m @ p["o"]

    q = {**p, "w2": _normal(ks[4], (3, 5), 0.1), "u2": _normal(ks[5], (5, 5), 0.1)}
    space = pj.trace(maxout_cell, q, x)
    line = r"a max at \S*test_kappa.py:\d+ \(\w+\) chooses between activations"
    with pytest.raises(pj.PathKappaUnsupportedError, match=line):
        pj.path_kappa(space, q, second_order=False)
    with pytest.raises(pj.DDPUnsupportedError, match=line):
        pj.ddp_kappa(space, q, x, alpha=0.0, estimator="exact")
    kappa = pj.path_kappa(pj.trace(max_over_time, p, x), p, second_order=False)
    g = jax.grad(lambda p: jnp.sum(max_over_time(p, x) ** 2))(p)
    assert all(np.any(g[n] != 0) and not np.any((kappa[n] == 0) & (g[n] != 0)) for n in p)


@pytest.mark.parametrize("op", ["cumsum", "cummax"])
def test_a_running_sum_or_maximum_along_positions_is_its_windows_written_out(op):
    """A causal mean (``jnp.cumsum`` over the positions over the counts) or running maximum (``lax.cummax``) of a
    ReLU layer: the path norm, κ and DDP-SGD's κ (α 0.5 and 1) equal those of the same network with each window's
    sum or maximum written out (slices reduced and stacked). Before, the trace read the cumulative op as
    homogeneous and path_kappa and ddp_kappa refused it."""
    ks = jax.random.split(jax.random.key(4), 5)
    p = {"w": _normal(ks[0], (3, 5)), "b": _normal(ks[1], (5,), 0.1), "o": _normal(ks[2], (5, 2))}
    x = _normal(ks[3], (4, 6, 3))
    counts = jnp.arange(1, 7, dtype=F64)[None, :, None]
    running = {"cumsum": lambda h: jnp.cumsum(h, axis=1) / counts, "cummax": lambda h: jax.lax.cummax(h, axis=1)}[op]
    reduce = {"cumsum": jnp.sum, "cummax": jnp.max}[op]

    def windows(h):
        stacked = jnp.stack([reduce(h[:, : t + 1], axis=1) for t in range(h.shape[1])], axis=1)
        return stacked / counts if op == "cumsum" else stacked

    def quantities(read):
        fn = lambda p, x: read(jax.nn.relu(x @ p["w"] + p["b"])).mean(1) @ p["o"]  # noqa: E731
        space = pj.trace(fn, p, x, strict=True)
        assert space.num_hidden == 5
        ddp = [pj.ddp_kappa(space, p, x, alpha=a) for a in (0.5, 1.0)]  # the γ² recursion; per-example Jacobians
        return pj.path_norm(space, p), pj.path_kappa(space, p), ddp

    chex.assert_trees_all_close(quantities(running), quantities(windows), rtol=1e-12)


@pytest.mark.parametrize("op", ["stack", "tile"])
def test_stack_and_tile_are_their_concatenations(op):
    """``jnp.stack`` and ``jnp.tile`` are primitives of their own in the JAX versions supported: two ReLU layers
    stacked along a new axis and summed over it (branches merged), or their sum tiled along its units, then a head,
    have the structure, path norm, κ and DDP-SGD's κ (α 0.5) of the same network concatenated by hand. Before, both
    were unknown primitives and pinned their groups (H 0)."""
    ks = jax.random.split(jax.random.key(5), 6)
    p = {"a": _normal(ks[0], (3, 4)), "b": _normal(ks[1], (3, 4)), "o": _normal(ks[2], (4 if op == "stack" else 8, 2))}
    x = _normal(ks[3], (5, 3))
    written = {
        "stack": (
            lambda a, b: jnp.stack([a, b], 1).sum(1),
            lambda a, b: jnp.concatenate([a[:, None], b[:, None]], 1).sum(1),
        ),
        "tile": (lambda a, b: jnp.tile(a + b, (1, 2)), lambda a, b: jnp.concatenate([a + b, a + b], axis=1)),
    }[op]

    def quantities(join):
        fn = lambda p, x: join(jax.nn.relu(x @ p["a"]), jax.nn.relu(x @ p["b"])) @ p["o"]  # noqa: E731
        space = pj.trace(fn, p, x, strict=True)
        return space.num_hidden, pj.path_norm(space, p), pj.path_kappa(space, p), pj.ddp_kappa(space, p, x, alpha=0.5)

    (h, *rest), (h_ref, *rest_ref) = quantities(written[0]), quantities(written[1])
    assert h == h_ref == 4  # the two layers' units are summed: one node each
    chex.assert_trees_all_close(rest, rest_ref, rtol=1e-12)


def _dense(x, w):
    return x @ w


def _conv(x, w):
    return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))


def _attention(q, k, v, heads=2):
    """Softmax attention over the positions of (batch, positions, units) queries, keys and values, in heads."""
    split = lambda t: t.reshape(*t.shape[:2], heads, -1)  # noqa: E731
    a = jax.nn.softmax(jnp.einsum("bthd,bshd->bhts", split(q), split(k)), axis=-1)
    return jnp.einsum("bhts,bshd->bthd", a, split(v)).reshape(q.shape)


def _quantities(fn, p, x, fuse):
    """The space of ``fn``, its groups' kinds and sizes, and its path norm, κ and DDP-SGD's κ (α 0.5) at ``p``, the
    κs mapped by ``fuse`` (one kernel per piece as the fused kernel: the tests that compare the two). ``x``: the
    input, or a tuple of several."""
    space = pj.trace(fn, p, *(x if isinstance(x, tuple) else (x,)))
    out = {"norm": pj.path_norm(space, p), "kappa": fuse(pj.path_kappa(space, p))}
    out["ddp"] = fuse(pj.ddp_kappa(space, p, x, alpha=0.5))
    return space, sorted((g.kind, g.size) for g in space.groups), out


# name: (layer, input shape, piece sizes, the head's leaves, the network of the pieces ``z`` and of the layer's whole
# output, where the output is cut: "split", "slices", or "relu" (a split after a ReLU))
_FUSED = {
    "relu pieces": (_dense, (6, 3), (4, 3), {"u": (4, 2), "v": (3, 2)},
                    lambda z, whole, p: jax.nn.relu(z[0]) @ p["u"] + jax.nn.relu(z[1]) @ p["v"], "split"),
    "gated (split)": (_dense, (6, 3), (4, 4), {"u": (4, 2)},
                      lambda z, whole, p: (z[0] * jax.nn.sigmoid(z[1])) @ p["u"], "split"),
    "gated (slices)": (_dense, (6, 3), (4, 4), {"u": (4, 2)},
                       lambda z, whole, p: (z[0] * jax.nn.sigmoid(z[1])) @ p["u"], "slices"),
    "gated after a relu": (_dense, (6, 3), (4, 4), {"u": (4, 2)},
                           lambda z, whole, p: (z[0] * jnp.tanh(z[1])) @ p["u"], "relu"),
    "gated, read whole too": (_dense, (6, 3), (4, 4), {"u": (4, 2), "v": (8, 2)},
                              lambda z, whole, p: (jax.nn.sigmoid(z[0]) * jax.nn.relu(z[1])) @ p["u"]
                              + jax.nn.relu(whole) @ p["v"], "split"),  # (the gate first)
    "attention (q, k, v)": (_dense, (3, 5, 4), (4, 4, 4), {"u": (4, 3), "v": (3, 2)},
                            lambda z, whole, p: jax.nn.relu(_attention(*z) @ p["u"]).mean(1) @ p["v"], "split"),
    "attention (reshaped, moved, unpacked)": (_dense, (3, 5, 4), (4, 4, 4), {"u": (4, 3), "v": (3, 2)},
                                              lambda z, whole, p: jax.nn.relu(_attention(*z) @ p["u"]).mean(1)
                                              @ p["v"], "moved"),
    "attention (in heads, split)": (_dense, (3, 5, 4), (4, 4, 4), {"u": (4, 3), "v": (3, 2)},
                                    lambda z, whole, p: jax.nn.relu(_attention(*z) @ p["u"]).mean(1) @ p["v"],
                                    "heads"),
    "convolution, gated": (_conv, (2, 5, 5, 2), (3, 3), {"u": (3, 2)},
                           lambda z, whole, p: (jax.nn.relu(z[0]) * jax.nn.sigmoid(z[1])).mean((1, 2)) @ p["u"],
                           "split"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(_FUSED))
def test_a_fused_kernel_cut_into_pieces_is_one_kernel_per_piece(name):
    """One kernel and bias computing several layers at once, their output cut into pieces (``q, k, v =
    jnp.split(x @ w + b, 3, -1)``, a gated unit's linear half and gate ``a, g = jnp.split(h, 2, -1)``, or slices):
    each piece is a node group of its own, so the network has the structure, path norm, κ and DDP-SGD's κ (α 0.5)
    of the same network written with one kernel and bias per piece (the fused kernel's slices), also where the output
    is reshaped first and cut along the new axis (``jnp.moveaxis(qkv.reshape(b, t, 3, d), 2, 0)`` unpacked, or split
    along the heads).
    DDP-Normalization refuses it, saying so. Before, every piece was pinned ("split: splits an axis"); with the
    pieces as groups but the layer's output flagged pinned as a whole, the path norm counted a gate's paths and
    dropped the linear half's."""
    layer, in_shape, sizes, head, net, cut = _FUSED[name]
    ks = jax.random.split(jax.random.key(11), 4 + len(head))
    x = _normal(ks[0], in_shape)
    w = _normal(ks[1], (3, 3, in_shape[-1], sum(sizes)) if layer is _conv else (in_shape[-1], sum(sizes)))
    head = {name: _normal(k, shape) for k, (name, shape) in zip(ks[4:], head.items(), strict=True)}
    fused = {"w": w, "b": _normal(ks[2], (sum(sizes),), 0.1), **head}
    bounds = list(itertools.pairwise(np.cumsum((0, *sizes)).tolist()))
    apart = {"w": [w[..., a:b] for a, b in bounds], "b": [fused["b"][a:b] for a, b in bounds], **head}

    def fused_fn(p, x):
        z = layer(x, p["w"]) + p["b"]
        z = jax.nn.relu(z) if cut == "relu" else z
        if cut == "slices":
            return net([z[..., a:b] for a, b in bounds], z, p)
        if cut == "moved":  # q, k, v = jnp.moveaxis(qkv.reshape(b, t, 3, d), 2, 0), as PyTorch ports write it
            return net(list(jnp.moveaxis(z.reshape(*z.shape[:-1], len(sizes), -1), -2, 0)), z, p)
        if cut == "heads":  # qkv.reshape(b, t, 3 * heads, d // heads), split along the heads
            parts = jnp.split(z.reshape(*z.shape[:-1], 2 * len(sizes), -1), len(sizes), axis=-2)
            return net([t.reshape(z.shape[:-1] + (-1,)) for t in parts], z, p)
        return net(jnp.split(z, [b for _, b in bounds[:-1]], axis=-1), z, p)

    def apart_fn(p, x):
        z = [layer(x, w) + b for w, b in zip(p["w"], p["b"], strict=True)]
        z = [jax.nn.relu(t) for t in z] if cut == "relu" else z
        return net(z, jnp.concatenate(z, -1), p)

    def fuse(t):  # a tree like the apart params as one like the fused params
        return {**t, "w": jnp.concatenate(t["w"], -1), "b": jnp.concatenate(t["b"])}

    space, groups, got = _quantities(fused_fn, fused, x, lambda t: t)
    space_ref, groups_ref, expected = _quantities(apart_fn, apart, x, fuse)
    h = space.num_hidden
    assert (h, groups) == (space_ref.num_hidden, groups_ref) and h > 0
    chex.assert_trees_all_close(got, expected, rtol=1e-12)
    if name == "relu pieces":  # (the others have pinned groups, refused as such)
        with pytest.raises(pj.DDPNormalizationError, match="one kernel and bias per node group"):
            pj.ddp_normalize(pj.trace(fused_fn, fused, x), alpha=0.5)(fused, x)


# name: (the kernel's output axes, the pieces' first; how the pieces are read; the head's leaves; the network of the
# pieces, each flattened to one axis of units). The unstacked case first: the fast set runs it on the newest JAX,
# whose `list(z)` is an `unstack` (JAX 0.10: slices)
_PIECES_AXIS = {
    "gated (unstacked)": ((2, 4), "unstack", {"u": (4, 2)}, lambda z, p: (z[0] * jax.nn.sigmoid(z[1])) @ p["u"]),
    "attention (indexed)": ((3, 2, 2), "index", {"u": (4, 3), "v": (3, 2)},
                            lambda z, p: jax.nn.relu(_attention(*z) @ p["u"]).mean(1) @ p["v"]),
    "relu pieces, no bias (split)": ((2, 3), "split", {"u": (3, 2), "v": (3, 2)},
                                     lambda z, p: jax.nn.relu(z[0]) @ p["u"] + jax.nn.relu(z[1]) @ p["v"]),
    "attention (Gemma's einsum, no bias)": ((3, 2, 2), "einsum", {"u": (4, 3), "v": (3, 2)},
                                            lambda z, p: jax.nn.relu(_attention(*z) @ p["u"]).mean(1) @ p["v"]),
}  # fmt: skip


@pytest.mark.parametrize("name", list(_PIECES_AXIS))
def test_a_kernel_with_a_pieces_axis_is_one_kernel_per_piece(name):
    """A kernel with an axis of pieces of its own before the units (``nn.DenseGeneral(features=(3, heads, d))``,
    then ``q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]``, as MaxText's fused projection reads it; two halves
    unstacked or split along that axis; or Gemma's ``q, k, v = jnp.einsum("BTD,SNDH->SBTNH", x, w)``, the pieces
    axis first in the kernel, its units' axes apart) is the network with one kernel and bias per piece: the same
    structure, path norm, κ and DDP-SGD's κ (α 0.5), and the function is unchanged by rescalings of its groups.
    Before, the pieces shared the kernel's head and unit axes, so the pinned queries and keys pinned the values
    (and with the pieces apart, ``describe`` also called the queries and keys "node groups of different shapes")."""
    axes, read, head, net = _PIECES_AXIS[name]
    ks = jax.random.split(jax.random.key(15), 4 + len(head))
    x = _normal(ks[0], (3, 5, 4) if read in ("index", "einsum") else (6, 3))
    head = {n: _normal(k, shape) for k, (n, shape) in zip(ks[4:], head.items(), strict=True)}
    w = (*axes[:2], x.shape[-1], *axes[2:]) if read == "einsum" else (x.shape[-1], *axes)  # (3, heads, F, d)
    fused = {"w": _normal(ks[1], w), **head}
    if "no bias" not in name:
        fused["b"] = _normal(ks[2], axes, 0.1)
    at = 0 if read == "einsum" else 1  # the kernel's pieces axis
    apart = {k: list(v) if k == "b" else list(jnp.moveaxis(v, at, 0)) if k == "w" else v for k, v in fused.items()}
    dense = lambda x, w: jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())))  # noqa: E731  (DenseGeneral's)
    units = lambda t: t.reshape(*t.shape[: x.ndim - 1], -1)  # noqa: E731

    def fused_fn(p, x):
        if read == "einsum":
            return net([units(t) for t in jnp.einsum("btf,snfh->sbtnh", x, p["w"])], p)
        z, a = dense(x, p["w"]), x.ndim - 1
        z = z + p["b"] if "b" in p else z  # (nn.DenseGeneral(use_bias=False): no addition)
        if read == "index":
            parts = [z[(slice(None),) * a + (i,)] for i in range(axes[0])]
        elif read == "unstack":
            parts = list(jnp.moveaxis(z, a, 0))
        else:
            parts = [t.squeeze(a) for t in jnp.split(z, axes[0], axis=a)]
        return net([units(t) for t in parts], p)

    def apart_fn(p, x):
        if read == "einsum":
            return net([units(jnp.einsum("btf,nfh->btnh", x, w)) for w in p["w"]], p)
        z = [dense(x, w) + (p["b"][i] if "b" in p else 0.0) for i, w in enumerate(p["w"])]
        return net([units(t) for t in z], p)

    def fuse(t):  # a tree like the apart params as one like the fused params
        return {**t, "w": jnp.stack(t["w"], at)} | ({"b": jnp.stack(t["b"])} if "b" in t else {})

    space, groups, got = _quantities(fused_fn, fused, x, lambda t: t)
    space_ref, groups_ref, expected = _quantities(apart_fn, apart, x, fuse)
    assert (space.num_hidden, groups) == (space_ref.num_hidden, groups_ref) and space.num_hidden > 0
    chex.assert_trees_all_close(got, expected, rtol=1e-12)
    pj.testing.assert_function_invariant(fused_fn, space, fused, x, rtol=1e-10)
    # the queries and keys, pinned by the softmax, say so, not also that their heads (tied by the scores) clash
    assert "different shapes" not in pj.describe(space)


# name: how the pieces of a projection of 2 heads of 2 units interleave (the kernel's output as heads x pieces x d),
# whether it has a bias, and whether its output is also read whole
_INTERLEAVED = {
    "GPT-NeoX (split)": ("neox", True, False),
    "DenseGeneral((heads, 3, d)) (indexed)": ("heads first", True, False),
    "GPT-NeoX, no bias, read whole too": ("neox", False, True),
    "BLOOM (reshaped to heads, 3, d; indexed)": ("bloom", True, False),
    "DenseGeneral((heads, 3 * d)) (split)": ("heads, 3d", False, False),
}
# the kernel's shape after its input axis, and the pieces of its output z (batch, positions, ...)
_LAYOUTS = {
    "neox": ((12,), lambda z, h, d: jnp.split(z.reshape(*z.shape[:2], h, 3 * d), 3, axis=-1)),
    "bloom": ((12,), lambda z, h, d: [z.reshape(*z.shape[:2], h, 3, d)[..., i, :] for i in range(3)]),
    "heads first": (("h", 3, "d"), lambda z, h, d: [z[:, :, :, i] for i in range(3)]),
    "heads, 3d": (("h", "3d"), lambda z, h, d: jnp.split(z, 3, axis=-1)),
}


@pytest.mark.parametrize("name", list(_INTERLEAVED))
def test_pieces_that_interleave_are_one_kernel_per_piece(name):
    """Queries, keys and values whose units interleave in one projection's output (GPT-NeoX's ``qkv.reshape(b, t,
    heads, 3 * d)`` split on its last axis, BLOOM's ``(b, t, heads, 3, d)``, ``nn.DenseGeneral((heads, 3, d))`` read
    along its middle axis, ``nn.DenseGeneral((heads, 3 * d))`` split on its last) are the
    network with one kernel (and bias) per piece: the same structure, path norm, κ and DDP-SGD's κ (α 0.5), and the
    function is unchanged by rescalings of its groups. Before, the pieces shared the heads axis, so the pinned queries
    and keys pinned the values."""
    layout, bias, whole = _INTERLEAVED[name]
    heads, d = 2, 2
    ks = jax.random.split(jax.random.key(16), 6)
    x = _normal(ks[0], (3, 5, 4))
    head = {"u": _normal(ks[1], (4, 3)), "v": _normal(ks[2], (3, 2))}
    head |= {"r": _normal(ks[5], (12, 2))} if whole else {}
    out_shape = tuple({"h": heads, "d": d, "3d": 3 * d}.get(n, n) for n in _LAYOUTS[layout][0])
    fused = {"w": _normal(ks[3], (4, heads, 3, d)).reshape(4, *out_shape), **head}
    fused |= {"b": _normal(ks[4], (heads, 3, d), 0.1).reshape(out_shape)} if bias else {}
    parts = {"w": fused["w"].reshape(4, heads, 3, d)} | ({"b": fused["b"].reshape(heads, 3, d)} if bias else {})
    apart = head | {k: [t[..., i, :] for i in range(3)] for k, t in parts.items()}
    if whole:  # the rows of ``r`` that read each piece
        apart["r"] = [t.reshape(heads * d, 2) for t in jnp.moveaxis(fused["r"].reshape(heads, 3, d, 2), 1, 0)]
    dense = lambda x, w: jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())))  # noqa: E731
    units = lambda t: t.reshape(*t.shape[:2], -1)  # noqa: E731

    def net(z, p):
        return jax.nn.relu(_attention(*z, heads=heads) @ p["u"]).mean(1) @ p["v"]

    def fused_fn(p, x):
        z = dense(x, p["w"]) + p["b"] if "b" in p else dense(x, p["w"])
        out = net([units(t) for t in _LAYOUTS[layout][1](z, heads, d)], p)
        return out + jax.nn.relu(units(z)).mean(1) @ p["r"] if whole else out

    def apart_fn(p, x):
        z = [units(dense(x, w) + p["b"][i] if "b" in p else dense(x, w)) for i, w in enumerate(p["w"])]
        out = net(z, p)
        return out + sum(jax.nn.relu(t).mean(1) @ r for t, r in zip(z, p["r"], strict=True)) if whole else out

    def fuse(t):  # a tree like the apart params as one like the fused params
        out = t | {k: jnp.stack(t[k], -2).reshape(fused[k].shape) for k in ("w", "b") if k in t}
        return out | {"r": jnp.stack([r.reshape(heads, d, 2) for r in t["r"]], 1).reshape(12, 2)} if whole else out

    space, groups, got = _quantities(fused_fn, fused, x, lambda t: t)
    space_ref, groups_ref, expected = _quantities(apart_fn, apart, x, fuse)
    assert (space.num_hidden, groups) == (space_ref.num_hidden, groups_ref)
    assert space.num_hidden == heads * d + 3  # (the values' units and the output projection's)
    chex.assert_trees_all_close(got, expected, rtol=1e-12)
    pj.testing.assert_function_invariant(fused_fn, space, fused, x, rtol=1e-10)


# name: (the fused network of a kernel ``w`` (3 -> 8) cut into a linear half and a sigmoid gate, the same with one
# kernel per half, the leaves read per half in the second (by their columns or rows), and the input's shape)
_READ_WHOLE = {
    "through a mean over positions": (
        lambda p, x, z: jax.nn.relu(z).mean(1) @ p["r"],
        lambda p, x, a, g: jax.nn.relu(a).mean(1) @ p["r"][0] + jax.nn.relu(g).mean(1) @ p["r"][1],
        {"r": 0}, (3, 5, 3)),
    "with a residual added": (
        lambda p, x, z: jax.nn.relu(z + x @ p["c"]) @ p["r"],
        lambda p, x, a, g: jax.nn.relu(a + x @ p["c"][0]) @ p["r"][0] + jax.nn.relu(g + x @ p["c"][1]) @ p["r"][1],
        {"r": 0, "c": 1}, (6, 3)),
}  # fmt: skip


@pytest.mark.parametrize("name", list(_READ_WHOLE))
def test_a_cut_node_read_whole_through_other_operations_is_one_kernel_per_piece(name):
    """A fused kernel's output cut into a linear half and a sigmoid gate (pinned) and also read whole, through a mean
    over positions or with a residual added before a ReLU: the path norm, κ and DDP-SGD's κ (α 0.5) are those of
    one kernel per half. The gate's entries are boundary values there, entry by entry: 1 after the mean (as the
    mean of the gate alone is), and no path of the homogeneous part where the residual meets them (the gate plus
    the residual is a pinned node, a sink). Before, the mean was evaluated on the gate's ones (κ of the rows of
    ``r`` that read it 0.2 instead of 1), and the residual's sink also counted the gate's 1."""
    whole_fn, apart_whole_fn, split_leaves, in_shape = _READ_WHOLE[name]
    ks = jax.random.split(jax.random.key(18), 6)
    x = _normal(ks[0], in_shape)
    p = {"w": _normal(ks[1], (3, 8)), "u": _normal(ks[2], (4, 2)), "r": _normal(ks[3], (8, 2))}
    p |= {"c": _normal(ks[4], (3, 8))} if "c" in split_leaves else {}
    halves = lambda t, axis: [t[:4], t[4:]] if axis == 0 else [t[:, :4], t[:, 4:]]  # noqa: E731
    apart = p | {k: halves(p[k], axis) for k, axis in (split_leaves | {"w": 1}).items()}

    def fused_fn(p, x):
        z = x @ p["w"]
        a, g = jnp.split(z, 2, -1)
        return (a * jax.nn.sigmoid(g)).sum(range(1, x.ndim - 1)) @ p["u"] + whole_fn(p, x, z)

    def apart_fn(p, x):
        a, g = [x @ w for w in p["w"]]
        return (a * jax.nn.sigmoid(g)).sum(range(1, x.ndim - 1)) @ p["u"] + apart_whole_fn(p, x, a, g)

    def fuse(t):
        return t | {k: jnp.concatenate(t[k], axis) for k, axis in (split_leaves | {"w": 1}).items()}

    chex.assert_trees_all_close(fused_fn(p, x), apart_fn(apart, x), rtol=1e-12)
    space, groups, got = _quantities(fused_fn, p, x, lambda t: t)
    space_ref, groups_ref, expected = _quantities(apart_fn, apart, x, fuse)
    assert (space.num_hidden, groups) == (space_ref.num_hidden, groups_ref) and space.num_hidden == 4
    chex.assert_trees_all_close(got, expected, rtol=1e-12)


def test_pre_activations_concatenated_and_summed_with_a_layer_are_one_node_per_unit():
    """``relu(concatenate([x @ a, x @ b]) + x @ c) @ r``: each unit's pre-activation is the sum, as with ``c`` cut into
    a kernel per half; ``x @ a`` alone is no node. DDP-SGD's κ (α 0.5) is that of the network with one ``c`` per half.
    Before, ``x @ a`` and ``x @ b`` were nodes of their own, their statistics mixed in (κ of ``r`` 30.4 instead of
    31.1)."""
    ks = jax.random.split(jax.random.key(19), 5)
    x = _normal(ks[0], (6, 3))
    p = {"a": _normal(ks[1], (3, 4)), "b": _normal(ks[2], (3, 2)), "c": _normal(ks[3], (3, 6)),
         "r": _normal(ks[4], (6, 2))}  # fmt: skip
    apart = p | {"c": [p["c"][:, :4], p["c"][:, 4:]], "r": [p["r"][:4], p["r"][4:]]}

    def fused_fn(p, x):
        return jax.nn.relu(jnp.concatenate([x @ p["a"], x @ p["b"]], -1) + x @ p["c"]) @ p["r"]

    def apart_fn(p, x):
        return sum(jax.nn.relu(x @ p[k] + x @ c) @ r for k, c, r in zip("ab", p["c"], p["r"], strict=True))

    def fuse(t):
        return t | {"c": jnp.concatenate(t["c"], 1), "r": jnp.concatenate(t["r"])}

    space, groups, got = _quantities(fused_fn, p, x, lambda t: t)
    _, groups_ref, expected = _quantities(apart_fn, apart, x, fuse)
    assert groups == groups_ref and space.num_hidden == 6
    chex.assert_trees_all_close(got, expected, rtol=1e-12)


def test_a_class_token_put_before_the_positions_is_a_bias_at_the_first_position():
    """A ViT's class token (a parameter tiled along the batch and concatenated before the patches' embeddings) is a
    bias into the embedding's units at the first position: the units stay hidden (H 8 + 8), and the path norm, κ and
    DDP-SGD's κ (α 0.5) are those of the network with a learned per-position bias that is the token at the first
    position and 0 at the others. Before, the token was "other" and pinned the embedding's units (H 8)."""
    ks = jax.random.split(jax.random.key(20), 8)
    x = _normal(ks[0], (3, 5, 4))
    p = {"e": _normal(ks[1], (4, 8)), "eb": _normal(ks[2], (8,), 0.1), "cls": _normal(ks[3], (1, 1, 8)),
         "w": _normal(ks[4], (8, 8)), "wb": _normal(ks[5], (8,), 0.1), "o": _normal(ks[6], (8, 2))}  # fmt: skip
    ref = {k: v for k, v in p.items() if k != "cls"} | {"pos": jnp.zeros((1, 6, 8)).at[:, :1].set(p["cls"])}

    def head(p, h):
        h = jax.nn.relu(h @ p["w"] + p["wb"])
        return (h[:, 0] + h[:, 1:].mean(1)) @ p["o"]

    def fn(p, x):
        tokens = jnp.tile(p["cls"], (x.shape[0], 1, 1))
        return head(p, jnp.concatenate([tokens, x @ p["e"] + p["eb"]], axis=1))

    def ref_fn(p, x):  # (the token a bias at the first position; the patches' embeddings after a row of zeros)
        return head(p, jnp.concatenate([jnp.zeros((x.shape[0], 1, 8)), x @ p["e"] + p["eb"]], axis=1) + p["pos"])

    chex.assert_trees_all_close(fn(p, x), ref_fn(ref, x), rtol=1e-12)
    space, groups, got = _quantities(fn, p, x, lambda t: t)
    _, groups_ref, expected = _quantities(ref_fn, ref, x, lambda t: {k: v for k, v in t.items() if k != "pos"}
                                          | {"cls": t["pos"][:, :1]})  # fmt: skip
    assert groups == groups_ref and space.num_hidden == 16
    chex.assert_trees_all_close(got, expected, rtol=1e-12)
    pj.testing.assert_function_invariant(fn, space, p, x, rtol=1e-10)


def _coordinates(x):
    """CoordConv's coordinate channels for an NHWC batch ``x``: (batch, rows, columns, 2), each in [-1, 1]."""
    b, rows, cols, _ = x.shape
    yy, xx = jnp.meshgrid(jnp.linspace(-1, 1, rows), jnp.linspace(-1, 1, cols), indexing="ij")
    return jnp.broadcast_to(jnp.stack([yy, xx], -1), (b, rows, cols, 2)).astype(x.dtype)


@pytest.mark.parametrize("kind", ["coordconv", "feature", "zeros"])
def test_a_constant_concatenated_beside_a_layers_units_is_inputs(kind):
    """A constant concatenated beside a layer's units (CoordConv's coordinate channels, a constant feature) is a
    group of inputs of its own: the units stay hidden, and the path norm, κ and DDP-SGD's κ (α 0.5) are those of the
    network given the constant as an input. A constant of zeros (channels padded) carries no path: the same as the
    network without it, κ 0 on the kernel rows reading it. Before, the concatenation's axis was positions, the units
    pinned, the next kernel read as a bias per position, and the |·|^p network took the constant's raw values
    (CoordConv's negative coordinates among them)."""
    ks = jax.random.split(jax.random.key(24), 6)
    conv = functools.partial(jax.lax.conv_general_dilated, window_strides=(1, 1), padding="SAME",
                             dimension_numbers=("NHWC", "HWIO", "NHWC"))  # fmt: skip
    if kind == "coordconv":
        x = _normal(ks[0], (3, 5, 5, 2))
        p = {"a": _normal(ks[1], (3, 3, 2, 4)), "ab": _normal(ks[2], (4,), 0.1), "b": _normal(ks[3], (3, 3, 6, 3)),
             "o": _normal(ks[4], (3, 2))}  # fmt: skip
        const = _coordinates

        def net(p, x, c):
            h = jax.nn.relu(conv(x, p["a"]) + p["ab"])
            return jax.nn.relu(conv(jnp.concatenate([h, c], -1), p["b"])).mean((1, 2)) @ p["o"]
    else:
        x = _normal(ks[0], (6, 3))
        p = {"a": _normal(ks[1], (3, 4)), "ab": _normal(ks[2], (4,), 0.1), "b": _normal(ks[3], (6, 3)),
             "o": _normal(ks[4], (3, 2))}  # fmt: skip
        const = (lambda x: jnp.zeros((len(x), 2))) if kind == "zeros" else (lambda x: jnp.full((len(x), 2), 0.5))

        def net(p, x, c):
            return jax.nn.relu(jnp.concatenate([jax.nn.relu(x @ p["a"] + p["ab"]), c], -1) @ p["b"]) @ p["o"]

    fn = lambda p, x: net(p, x, const(x))  # noqa: E731
    if kind == "zeros":  # the network without the zero columns
        ref, ref_fn, ref_x = p | {"b": p["b"][:4]}, lambda p, x: net(p, x, jnp.zeros((len(x), 0))), x
        to_ref = lambda t: t | {"b": t["b"][:4]}  # noqa: E731
    else:
        ref, ref_fn, ref_x, to_ref = p, net, (x, const(x)), lambda t: t
    space, groups, got = _quantities(fn, p, x, to_ref)
    _, groups_ref, expected = _quantities(ref_fn, ref, ref_x, lambda t: t)
    assert groups == sorted(groups_ref + ([("input", 2)] if kind == "zeros" else [])) and space.num_hidden == 4 + 3
    chex.assert_trees_all_close(got, expected, rtol=1e-12)
    if kind == "zeros":
        assert not np.any(np.asarray(pj.path_kappa(space, p)["b"][4:]))
    pj.testing.assert_function_invariant(fn, space, p, x)


def test_a_constant_concatenated_beside_units_and_added_to_a_layer_is_an_offset():
    """``relu(h @ w + b + concatenate([h, ones]))``: the layer's first units are h's (a residual), its last ones get
    a constant offset, which pins them (the constant's group is no input where a layer writes into it). H, groups,
    path norm, κ and DDP-SGD's κ (α 0.5) are those of the network written apart (the offset 1.0 added to the last
    units alone). Before, the concatenation's axis was positions: every unit pinned, w and b "other"."""
    ks = jax.random.split(jax.random.key(25), 5)
    x = _normal(ks[0], (5, 3))
    p = {"a": _normal(ks[1], (3, 2)), "w": _normal(ks[2], (2, 4)), "b": _normal(ks[3], (4,), 0.1),
         "o": _normal(ks[4], (4, 2))}  # fmt: skip

    def fn(p, x):
        h = jax.nn.relu(x @ p["a"])
        return jax.nn.relu(h @ p["w"] + p["b"] + jnp.concatenate([h, jnp.ones((len(x), 2))], -1)) @ p["o"]

    def apart(q, x):
        h = jax.nn.relu(x @ q["a"])
        first = jax.nn.relu(h @ q["w"][0] + q["b"][0] + h)
        return first @ q["o"][0] + jax.nn.relu(h @ q["w"][1] + q["b"][1] + 1.0) @ q["o"][1]

    q = p | {"w": jnp.split(p["w"], 2, 1), "b": jnp.split(p["b"], 2), "o": jnp.split(p["o"], 2)}
    joined = lambda t: t | {"w": jnp.concatenate(t["w"], 1), "b": jnp.concatenate(t["b"]), "o": jnp.concatenate(t["o"])}  # noqa: E731
    chex.assert_trees_all_close(fn(p, x), apart(q, x), rtol=1e-12)
    space, groups, got = _quantities(fn, p, x, lambda t: t)
    _, groups_ref, expected = _quantities(apart, q, x, joined)
    assert groups == groups_ref == [("hidden", 2), ("input", 3), ("output", 2), ("pinned", 2)]
    chex.assert_trees_all_close(got, expected, rtol=1e-12)
    pj.testing.assert_function_invariant(fn, space, p, x)


@pytest.mark.parametrize("how", ["pad", "concatenate"])
def test_a_shortcut_padded_with_zero_channels_keeps_every_unit(how):
    """A CIFAR ResNet's parameter-free shortcut (option A): the block's input, subsampled and padded with zero
    channels (``jnp.pad`` or a concatenation of zeros), added to the block's output. The padded channels are the
    block's own units, the others tied to the input's (a residual): H 2 + 4 + 2, and the path norm, κ and DDP-SGD's
    κ at α = 1 are those of the network that adds the input to the middle channels alone (at 0 < α < 1 that network's
    statistic of the middle units is taken before the residual is added, where ``h[..., 1:3]`` is sliced off the
    kernel's output: not compared). Before, padding along the channels pinned the input's and the block's units
    (H 4, the padded zeros read as new nodes)."""
    ks = jax.random.split(jax.random.key(27), 6)
    conv = functools.partial(jax.lax.conv_general_dilated, padding="SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    x = _normal(ks[0], (3, 6, 6, 1))
    p = {"a": _normal(ks[1], (3, 3, 1, 2)), "b": _normal(ks[2], (3, 3, 2, 4)), "c": _normal(ks[3], (3, 3, 4, 4)),
         "o": _normal(ks[4], (4, 2))}  # fmt: skip

    def block(p, x):
        x = jax.nn.relu(conv(x, p["a"], (1, 1)))
        return x, conv(jax.nn.relu(conv(x, p["b"], (2, 2))), p["c"], (1, 1))

    def fn(p, x):
        x, h = block(p, x)
        if how == "pad":
            short = jnp.pad(x[:, ::2, ::2], ((0, 0), (0, 0), (0, 0), (1, 1)))
        else:
            zeros = jnp.zeros((*x[:, ::2, ::2].shape[:3], 1))
            short = jnp.concatenate([zeros, x[:, ::2, ::2], zeros], -1)
        return jax.nn.relu(h + short).mean((1, 2)) @ p["o"]

    def apart(p, x):
        x, h = block(p, x)
        s = [jax.nn.relu(h[..., :1]), jax.nn.relu(h[..., 1:3] + x[:, ::2, ::2]), jax.nn.relu(h[..., 3:])]
        return jnp.concatenate(s, -1).mean((1, 2)) @ p["o"]

    chex.assert_trees_all_close(fn(p, x), apart(p, x), rtol=1e-12)
    space, space_ref = pj.trace(fn, p, x), pj.trace(apart, p, x)
    assert sorted((g.kind, g.size) for g in space.groups) == sorted((g.kind, g.size) for g in space_ref.groups)
    assert space.num_hidden == 2 + 4 + 2
    for f in (pj.path_norm, pj.path_kappa, functools.partial(pj.ddp_kappa, inputs=x, alpha=1.0)):
        chex.assert_trees_all_close(f(space, p), f(space_ref, p), rtol=1e-12)
    pj.testing.assert_function_invariant(fn, space, p, x)


@pytest.mark.parametrize(
    "expand", [lambda t: t[:, None], lambda t: jnp.expand_dims(t, -1)], ids=["index", "expand_dims"]
)
def test_a_scalar_input_given_an_axis_of_one_entry_is_an_input(expand):
    """A scalar input per example given a feature axis (``t[:, None]``, a diffusion model's time step, read by a
    Dense) is an input group of one node: the path norm, κ and DDP-SGD's κ (α 0.5) of the network given ``t[:, None]``
    as its input. Before, the new axis was a node group that no edge enters (pinned), and path_kappa and ddp_kappa
    refused the network ("combines a value of the positively homogeneous part with a value of a pinned node
    group")."""
    ks = jax.random.split(jax.random.key(28), 5)
    t = _normal(ks[0], (6,))
    p = {"a": _normal(ks[1], (1, 4)), "ab": _normal(ks[2], (4,), 0.1), "o": _normal(ks[3], (4, 2))}
    net = lambda p, x: jax.nn.relu(x @ p["a"] + p["ab"]) @ p["o"]  # noqa: E731
    space, groups, got = _quantities(lambda p, t: net(p, expand(t)), p, t, lambda k: k)
    _, groups_ref, expected = _quantities(net, p, t[:, None], lambda k: k)
    assert groups == groups_ref == [("hidden", 4), ("input", 1), ("output", 2)]
    chex.assert_trees_all_close(got, expected, rtol=1e-12)


def test_an_input_masked_by_another_input_is_an_input():
    """``x * m`` with both inputs (features masked by a float mask given with them): a value computed from the inputs
    alone, a coefficient of the example that no rescaling changes. The path norm, κ and DDP-SGD's κ (α 0.5) are those
    of the network given ``x * m`` as its input. Before, path_kappa and ddp_kappa refused the product of two
    activations."""
    ks = jax.random.split(jax.random.key(29), 5)
    x, m = _normal(ks[0], (6, 3)), (_normal(ks[1], (6, 3)) > 0).astype(F64)
    p = {"a": _normal(ks[2], (3, 4)), "ab": _normal(ks[3], (4,), 0.1), "o": _normal(ks[4], (4, 2))}
    net = lambda p, x: jax.nn.relu(x @ p["a"] + p["ab"]) @ p["o"]  # noqa: E731
    _, groups, got = _quantities(lambda p, x, m: net(p, x * m), p, (x, m), lambda k: k)
    _, groups_ref, expected = _quantities(net, p, x * m, lambda k: k)
    assert groups == groups_ref == [("hidden", 4), ("input", 3), ("output", 2)]
    chex.assert_trees_all_close(got, expected, rtol=1e-12)


@pytest.mark.parametrize("offset", [lambda x: x - 0.5, lambda x: x + 0.5, lambda x: x - (-0.5)],
                         ids=["minus", "plus", "minus a negative"])  # fmt: skip
def test_an_input_offset_is_a_bias_of_fixed_weight(offset):
    """An input shifted by a constant (``x - mean`` in the model) is the input plus a bias of fixed weight c from the
    bias node: each input node carries 1 + |c|^p in the |·|^p network, whatever the offset's sign. Before, the offset
    entered raw: ``x - (-0.5)`` and ``x + 0.5`` had different path norms (1 - 0.5 and 1 + 0.5 per input)."""
    ks = jax.random.split(jax.random.key(30), 5)
    x = _normal(ks[0], (6, 3))
    p = {"a": _normal(ks[1], (3, 4)), "ab": _normal(ks[2], (4,), 0.1), "o": _normal(ks[3], (4, 2))}
    fn = lambda p, x: jax.nn.relu(offset(x) @ p["a"] + p["ab"]) @ p["o"]  # noqa: E731
    into = 1.25 * (p["a"] ** 2).sum(0) + p["ab"] ** 2  # per hidden unit: Σ_i a_ij² (1 + 0.5²) + b_j²
    want = np.sqrt((into * (p["o"] ** 2).sum(1)).sum())
    np.testing.assert_allclose(pj.path_norm(pj.trace(fn, p, x), p), want, rtol=1e-12)


class _TransposedConv(nn.Module):
    """A transposed convolution (stride 2) then a ReLU and a head; ``transpose_kernel`` as in ``nn.ConvTranspose``."""

    transpose_kernel: bool

    @nn.compact
    def __call__(self, x):
        conv = nn.ConvTranspose(4, (3, 3), strides=(2, 2), transpose_kernel=self.transpose_kernel, param_dtype=F64)
        return nn.Dense(2, param_dtype=F64)(nn.relu(conv(x)).mean((1, 2)))


def test_a_kernel_reversed_along_its_taps_is_the_same_kernel():
    """``nn.ConvTranspose(..., transpose_kernel=True)`` (PyTorch's convention) reverses the kernel along its taps
    and swaps its channel axes: an edge tensor as the kernel of ``transpose_kernel=False`` holding the same entries
    reversed (H 4, the same path norm, κ and DDP-SGD's κ at α 0.5, entry by entry). Before, the reversal made the
    kernel "other" and pinned the layer (H 0). Reversed along a Dense kernel's input axis, the kernel is "other"."""
    x = _normal(jax.random.key(31), (3, 4, 4, 2))
    model, ref = _TransposedConv(True), _TransposedConv(False)
    p = model.init(jax.random.key(32), x)["params"]
    swap = lambda k: jnp.flip(k, (0, 1)).swapaxes(2, 3)  # noqa: E731  (an involution)
    q = p | {"ConvTranspose_0": p["ConvTranspose_0"] | {"kernel": swap(p["ConvTranspose_0"]["kernel"])}}
    back = lambda t: t | {"ConvTranspose_0": t["ConvTranspose_0"] | {"kernel": swap(t["ConvTranspose_0"]["kernel"])}}  # noqa: E731
    fn, ref_fn = (lambda p, x: model.apply({"params": p}, x)), (lambda q, x: ref.apply({"params": q}, x))
    chex.assert_trees_all_close(fn(p, x), ref_fn(q, x), rtol=1e-12)
    space, groups, got = _quantities(fn, p, x, lambda t: t)
    _, groups_ref, expected = _quantities(ref_fn, q, x, back)
    assert groups == groups_ref and space.num_hidden == 4
    chex.assert_trees_all_close(got, expected, rtol=1e-12)
    w = {"w": _normal(jax.random.key(33), (3, 4)), "o": _normal(jax.random.key(34), (4, 2))}
    flipped = pj.trace(lambda w, x: jax.nn.relu(x @ jnp.flip(w["w"], 0)) @ w["o"], w, x[:, 0, 0, :1].repeat(3, 1))
    assert {leaf.path: leaf.kind for leaf in flipped.leaves}["w"] == "other"


@pytest.mark.parametrize("axis", [-1, 1], ids=["features", "steps"])
def test_inputs_stacked_are_an_input(axis):
    """Inputs stacked along a new axis, ``jnp.stack([x, y], -1)`` (two inputs as two features: an input group of 2,
    the kernel an edge from it) or ``jnp.stack(frames, 1)`` (steps a shared layer reads each of: positions), trace as
    the stacked array given as the input: the same groups, path norm, κ and DDP-SGD's κ (α 0.5). Before, a stack's
    new axis was always positions, and a kernel reading it was "a bias per position" (no input group; the steps
    case was right already, and stays so)."""
    ks = jax.random.split(jax.random.key(35), 6)
    xs = tuple(_normal(k, (6, 3) if axis == 1 else (6,)) for k in ks[:3])
    p = {"a": _normal(ks[3], (3, 4)), "ab": _normal(ks[4], (4,), 0.1), "o": _normal(ks[5], (4, 2))}
    net = lambda p, x: jax.nn.relu(x @ p["a"] + p["ab"]).mean(1) @ p["o"]  # noqa: E731  (steps: a Dense per step)
    if axis == -1:
        net = lambda p, x: jax.nn.relu(x @ p["a"] + p["ab"]) @ p["o"]  # noqa: E731
    _, groups, got = _quantities(lambda p, *xs: net(p, jnp.stack(xs, axis)), p, xs, lambda k: k)
    _, groups_ref, expected = _quantities(net, p, jnp.stack(xs, axis), lambda k: k)
    assert groups == groups_ref == [("hidden", 4), ("input", 3), ("output", 2)]
    chex.assert_trees_all_close(got, expected, rtol=1e-12)


def test_a_constant_offset_at_a_pinned_node_is_no_path():
    """``relu(h @ w + 1.0) @ o``: the offset pins the layer; the paths into it end there, and the constant is no path
    of its own. Its path norm is the definition's, Σ_paths into the sinks + Σ_paths from them. Before, the offset
    (a literal) crashed the |·|^p network at the sink, and once past that, entered it at the scale of the paths'
    exponent (the path norm depended on it)."""
    ks = jax.random.split(jax.random.key(26), 4)
    x, p = (
        _normal(ks[0], (5, 3)),
        {"a": _normal(ks[1], (3, 2)), "w": _normal(ks[2], (2, 2)), "o": _normal(ks[3], (2, 2))},
    )

    def fn(p, x):
        return jax.nn.relu(jax.nn.relu(x @ p["a"]) @ p["w"] + 1.0) @ p["o"]

    space = pj.trace(fn, p, x)
    for scale in (1.0, 2.0**-20):  # (a scale that moves the |·|^p network's exponents)
        q = p | {"a": scale * p["a"]}
        into = ((q["a"] ** 2).sum(0) @ (q["w"] ** 2)).sum()
        np.testing.assert_allclose(pj.path_norm(space, q) ** 2, into + (q["o"] ** 2).sum(), rtol=1e-12)


_CONV = functools.partial(jax.lax.conv_general_dilated, window_strides=(2, 2), padding="SAME",
                          dimension_numbers=("NHWC", "HWIO", "NHWC"))  # fmt: skip


@pytest.mark.parametrize("beside", ["inputs", "a layer", "inputs, the map of two branches"])
def test_a_flattened_feature_map_concatenated_with_other_features_keeps_its_units(beside):
    """A policy network's image encoder flattened and concatenated with a vector of other features (inputs, or a
    layer's units) before a Dense layer: the concatenation is the feature map's channels at every position beside
    the other group, and H, the groups, the path norm, κ and DDP-SGD's κ (α 0.5) are those of the network written
    with one kernel per part; G-SGD's steps are invariant. So where the map is itself two branches concatenated
    (Inception's). Before, the concatenation's axis was positions: the channels pinned, the Dense kernel "a bias per
    position", and G-SGD's steps not invariant."""
    ks = jax.random.split(jax.random.key(36), 10)
    img, vec = _normal(ks[0], (5, 6, 6, 2)), _normal(ks[1], (5, 3))
    two = beside.endswith("branches")
    p = {"c": _normal(ks[2], (3, 3, 2, 4)), "cb": _normal(ks[3], (4,), 0.1), "w": _normal(ks[4], (9 * 4 + 3, 6)),
         "wb": _normal(ks[5], (6,), 0.1), "o": _normal(ks[6], (6, 2))}  # fmt: skip
    if beside == "a layer":
        p |= {"d": _normal(ks[7], (3, 3))}
    if two:
        p |= {"c": _normal(ks[2], (3, 3, 2, 3)), "cb": _normal(ks[3], (3,), 0.1), "e": _normal(ks[8], (1, 1, 2, 1))}
    other = (lambda p, v: jax.nn.relu(v @ p["d"])) if beside == "a layer" else (lambda p, v: v)

    def flat(p, img):
        h = jax.nn.relu(_CONV(img, p["c"]) + p["cb"])
        h = jnp.concatenate([h, jax.nn.relu(_CONV(img, p["e"]))], -1) if two else h
        return h.reshape(len(img), -1)

    def head(p, z):
        return jax.nn.relu(z + p["wb"]) @ p["o"]

    def fn(p, img, vec):
        return head(p, jnp.concatenate([flat(p, img), other(p, vec)], -1) @ p["w"])

    def apart(q, img, vec):  # the kernel's rows for the feature map and for the vector: two leaves
        return head(q, flat(q, img) @ q["w"][0] + other(q, vec) @ q["w"][1])

    q = p | {"w": (p["w"][:36], p["w"][36:])}
    joined = lambda t: t | {"w": jnp.concatenate(t["w"])}  # noqa: E731
    chex.assert_trees_all_close(fn(p, img, vec), apart(q, img, vec), rtol=1e-12)
    space, groups, got = _quantities(fn, p, (img, vec), lambda t: t)
    _, groups_ref, expected = _quantities(apart, q, (img, vec), joined)
    assert groups == groups_ref and space.num_hidden == 4 + 6 + (3 if beside == "a layer" else 0)
    chex.assert_trees_all_close(got, expected, rtol=1e-12)
    loss = lambda p, b: jnp.mean((fn(p, *b) - 1.0) ** 2)  # noqa: E731
    assert_update_invariant(pj.g_sgd(space, 0.05), loss, space, p, (img, vec), inputs=(img, vec), rtol=1e-9)


@pytest.mark.parametrize("flat", [False, True], ids=["units", "a flattened feature map"])
def test_a_concatenation_read_back_in_its_operands_slices_is_those_operands(flat):
    """``z = concatenate([h, y])`` read as ``z[:, :n]`` and ``z[:, n:]`` by two layers: each slice is its operand (a
    layer's units, or a convolution's output flattened, beside an input), and the groups, path norm, κ and DDP-SGD's
    κ (α 0.5) are those of the network reading h and y directly. Before, the slices pinned every unit (H 0)."""
    ks = jax.random.split(jax.random.key(40), 7)
    x, y = _normal(ks[0], (5, 4, 4, 2) if flat else (5, 3)), _normal(ks[1], (5, 3))
    p = {"a": _normal(ks[2], (3, 3, 2, 3) if flat else (3, 4)), "ab": _normal(ks[3], (3 if flat else 4,), 0.1),
         "b": _normal(ks[4], (12 if flat else 4, 3)), "o": _normal(ks[5], (3, 2)),
         "c": _normal(ks[6], (3, 2))}  # fmt: skip

    def h(p, x):
        if flat:
            return jax.nn.relu(_CONV(x, p["a"]) + p["ab"]).reshape(len(x), -1)
        return jax.nn.relu(x @ p["a"] + p["ab"])

    def apart(p, x, y):
        return jax.nn.relu(h(p, x) @ p["b"]) @ p["o"] + y @ p["c"]

    def fn(p, x, y):
        z, n = jnp.concatenate([h(p, x), y], -1), p["b"].shape[0]
        return jax.nn.relu(z[:, :n] @ p["b"]) @ p["o"] + z[:, n:] @ p["c"]

    space, groups, got = _quantities(fn, p, (x, y), lambda t: t)
    _, groups_ref, expected = _quantities(apart, p, (x, y), lambda t: t)
    assert groups == groups_ref and space.num_hidden == (3 if flat else 4) + 3
    chex.assert_trees_all_close(got, expected, rtol=1e-12)


@pytest.mark.parametrize("beside", [False, True], ids=["alone", "beside numeric features"])
def test_a_table_looked_up_at_several_slots_and_flattened_is_shared_along_them(beside):
    """Categorical features looked up in one table and flattened (a tabular model's embeddings, Bengio's neural LM's
    context words), perhaps concatenated with numeric features, then a Dense layer: the table's columns are hidden
    units shared by the slots, as for the one-hot input times the table: the same groups, path norm, κ and
    DDP-SGD's κ (α 0.5). Before, the slots were no positions: the table's units were pinned (H 6 instead of 9)."""
    ks = jax.random.split(jax.random.key(37), 6)
    ids, num = jax.random.randint(ks[0], (6, 2), 0, 7), _normal(ks[1], (6, 3))
    p = {"e": _normal(ks[2], (7, 3)), "w": _normal(ks[3], (6 + 3 * beside, 6)), "wb": _normal(ks[4], (6,), 0.1),
         "o": _normal(ks[5], (6, 2))}  # fmt: skip

    def net(p, rows, num):
        h = rows.reshape(len(rows), -1)
        h = jnp.concatenate([h, num], -1) if beside else h
        return jax.nn.relu(h @ p["w"] + p["wb"]) @ p["o"]

    lookup = lambda p, ids, num: net(p, p["e"][ids], num)  # noqa: E731
    one_hot = lambda p, x, num: net(p, x @ p["e"], num)  # noqa: E731
    chex.assert_trees_all_close(lookup(p, ids, num), one_hot(p, jax.nn.one_hot(ids, 7, dtype=F64), num), rtol=1e-12)
    space, groups, got = _quantities(lookup, p, (ids, num), lambda t: t)
    _, groups_ref, expected = _quantities(one_hot, p, (jax.nn.one_hot(ids, 7, dtype=F64), num), lambda t: t)
    assert groups == groups_ref and space.num_hidden == 3 + 6
    chex.assert_trees_all_close(got, expected, rtol=1e-12)


@pytest.mark.parametrize("copied", ["token mixing bias", "one number", "one activation per example"])
def test_a_value_copied_along_a_layers_units_and_added_pins_them(copied):
    """A value added to every unit of a layer alike cannot follow the units' separate rescalings: those units are
    pinned, and the function is invariant under the rescalings of the others at non-zero biases. MLP-Mixer's token
    mixing (a Dense along the tokens: its biases are copied along the channels it is applied to), one learned number
    added to a layer's units (no edge: "other"), one activation per example added to them (a conditioning branch).
    Written with the copied value zero (no token-mixing biases; a constant 0), the units are hidden. Before, the
    channels were hidden (random rescalings changed the function), and one number added was "not used by fn"."""
    ks = jax.random.split(jax.random.key(38), 10)
    x = _normal(ks[0], (5, 4, 3))  # examples, tokens, features
    p = {"a": _normal(ks[1], (3, 3)), "ab": _normal(ks[2], (3,), 0.5), "c": _normal(ks[3], (3, 4)),
         "cb": _normal(ks[4], (4,), 0.5), "o": _normal(ks[5], (4, 2))}  # fmt: skip
    if copied == "token mixing bias":
        p |= {"t1": _normal(ks[6], (4, 5)), "t1b": _normal(ks[7], (5,), 0.5), "t2": _normal(ks[8], (5, 4)),
              "t2b": _normal(ks[9], (4,), 0.5)}  # fmt: skip
    elif copied == "one number":
        p |= {"s": jnp.asarray(0.7, F64)}
    else:
        p |= {"s": _normal(ks[6], (3, 1))}

    def fn(p, x):  # (the copied value left out where ``p`` lacks its leaves)
        h = x @ p["a"] + p["ab"]  # (the channels the copied value is added to)
        if copied == "token mixing bias":
            t = jax.nn.relu(jnp.swapaxes(h, 1, 2) @ p["t1"] + p.get("t1b", 0.0)) @ p["t2"] + p.get("t2b", 0.0)
            h = h + jnp.swapaxes(t, 1, 2)
        elif "s" in p:
            h = h + (p["s"] if copied == "one number" else x @ p["s"])  # (one activation per example and token)
        return (jax.nn.relu(jax.nn.relu(h) @ p["c"] + p["cb"])).mean(1) @ p["o"]

    space = pj.trace(fn, p, x)
    (into,) = {leaf.path: leaf for leaf in space.leaves}["ab"].dst_groups
    units = space.groups[into]
    hidden = 4 + 5 * (copied == "token mixing bias")
    assert space.num_hidden == hidden and units.kind == "pinned", pj.describe(space)
    pj.testing.assert_function_invariant(fn, space, p, x)
    zeroed = {k: v for k, v in p.items() if k not in ("t1b", "t2b", "s")}
    assert pj.trace(fn, zeroed, x).num_hidden == hidden + 3


@pytest.mark.parametrize("read", ["reshaped", "cast"])
def test_a_residual_sum_read_as_its_pinned_node_leaves_out_its_boundary_operand(read):
    """``z = h + relu(n(h) @ b) @ c`` with ``h`` pinned (normalised: ``n``), then flattened (or cast) into the head:
    the pinned node is the flattened ``z``, which continues the sum. Only the paths of the homogeneous part end at a
    sink, so ``h``'s entries (1 in the |·|^p network, as every boundary value) are left out there, as where the head
    reads ``z`` itself (an einsum): path norm, κ and DDP-SGD's κ equal. Before, the flattened sum's sink counted them
    (γ² larger by T × D, a constant: κ was equal already)."""
    t, d = 3, 4
    x = jax.random.normal(jax.random.key(0), (5, t, 2), F64)
    ka, kb, kc, ko = jax.random.split(jax.random.key(1), 4)
    p = {"a": jax.random.normal(ka, (2, d), F64), "b": jax.random.normal(kb, (d, 6), F64),
         "c": jax.random.normal(kc, (6, d), F64), "o": jax.random.normal(ko, (t, d, 2), F64)}  # fmt: skip

    def block(p, x):
        h = x @ p["a"]
        n = h - h.mean(-1, keepdims=True)
        return h + jax.nn.relu(n / jnp.sqrt((n * n).mean(-1, keepdims=True) + 1e-6) @ p["b"]) @ p["c"]

    def flat(p, x):
        z = block(p, x)
        z = z.reshape(len(x), -1) if read == "reshaped" else z.astype(jnp.float32).astype(F64).reshape(len(x), -1)
        return z @ p["o"].reshape(t * d, 2)

    def direct(p, x):
        return jnp.einsum("btd,tdo->bo", block(p, x), p["o"])

    np.testing.assert_allclose(flat(p, x), direct(p, x), rtol=1e-6)
    results = []
    for fn in (flat, direct):
        space = pj.trace(fn, p, x)
        assert any(g.kind == "pinned" for g in space.groups)
        results.append((pj.path_norm(space, p), pj.path_kappa(space, p), pj.ddp_kappa(space, p, x, alpha=0.5,
                                                                                      estimator="exact")))  # fmt: skip
    chex.assert_trees_all_close(*results, rtol=1e-12)


def test_an_additive_attention_mask_of_the_inputs_is_no_path():
    """``scores + (1 - mask) * -1e9`` (BERT's additive mask, a float input) enters the pinned scores as values of the
    inputs alone: no parameter, no path. The groups, path norm, κ and DDP-SGD's κ (α 0.5) are those of the mask
    applied with ``jnp.where``. Before, path_kappa refused it (``exp`` "not positively homogeneous": the sum was no
    boundary value), and so did the other optimisers where the scores were a node ("combines a value of the
    positively homogeneous part with a value of a pinned node group")."""
    ks = jax.random.split(jax.random.key(39), 7)
    x, mask = _normal(ks[0], (5, 7, 3)), (jax.random.uniform(ks[1], (5, 7)) > 0.3).astype(F64)
    p = {n: _normal(k, (3, 4) if n == "a" else (4, 2) if n == "o" else (4, 4)) for n, k in zip("aqkvo", ks[2:])}

    def net(p, x, mask, additive=True):
        h = jax.nn.relu(x @ p["a"])
        scores = jnp.einsum("bqd,bkd->bqk", h @ p["q"], h @ p["k"])
        if additive:
            scores = scores + (1.0 - mask)[:, None, :] * -1e9
        else:
            scores = jnp.where(mask[:, None, :] > 0, scores, -1e9)
        return jax.nn.relu(jax.nn.softmax(scores) @ (h @ p["v"])).mean(1) @ p["o"]

    where = functools.partial(net, additive=False)
    chex.assert_trees_all_close(net(p, x, mask), where(p, x, mask), rtol=1e-12)
    _, groups, got = _quantities(net, p, (x, mask), lambda t: t)
    _, groups_ref, expected = _quantities(where, p, (x, mask), lambda t: t)
    assert groups == groups_ref
    chex.assert_trees_all_close(got, expected, rtol=1e-12)


class _LearnedQueries(nn.Module):
    """Attention pooling with learned queries: big_vision's MAPHead (a ``probe`` parameter tiled along the batch
    attends to the sequence, then a LayerNorm and an MLP added to it; ``queries=1``) or a Perceiver's latents
    (``queries=3``, then a ReLU layer). With ``as_input``, the same network given the queries as an input (one copy
    per example)."""

    queries: int
    as_input: bool = False

    @nn.compact
    def __call__(self, x, probe=None):
        x = nn.relu(nn.Dense(4, param_dtype=F64)(x))
        if not self.as_input:
            probe = self.param("probe", nn.initializers.normal(1.0), (1, self.queries, 4), F64)
            probe = jnp.tile(probe, [len(x), 1, 1])
        h = nn.MultiHeadDotProductAttention(num_heads=2, param_dtype=F64)(probe, x)
        if self.queries == 1:
            mlp = nn.Dense(4, param_dtype=F64)(nn.relu(nn.Dense(6, param_dtype=F64)(nn.LayerNorm(param_dtype=F64)(h))))
            h = h + mlp
            return nn.Dense(2, param_dtype=F64)(h[:, 0])
        return nn.Dense(2, param_dtype=F64)(nn.relu(nn.Dense(5, param_dtype=F64)(h)).mean(1))


@pytest.mark.parametrize("queries", [1, 3])
def test_learned_queries_attend_as_queries_given_as_an_input(queries):
    """Queries that are parameters (MAPHead's probe, a Perceiver's latents) are fixed coefficients: the probe and
    the query projection are "other", and each query's attention output is the values' units times coefficients,
    shared by the queries (positions), as for queries given as an input. κ and DDP-SGD's κ (α 0.5) of every other
    leaf equal those of the network given the probe as an input (whose query projection then ends at the pinned
    query units). Before, the queries' axis was pinned nodes, and path_kappa and ddp_kappa refused the network
    ("combines a value of the positively homogeneous part with a value of a pinned node group")."""
    x = _normal(jax.random.key(22), (5, 6, 3))
    model, ref = _LearnedQueries(queries), _LearnedQueries(queries, as_input=True)
    p = model.init(jax.random.key(23), x)["params"]
    probe = jnp.tile(p["probe"], [len(x), 1, 1])  # (the input: one copy per example)
    q = {k: v for k, v in p.items() if k != "probe"}
    fn = lambda p, x: model.apply({"params": p}, x)  # noqa: E731
    ref_fn = lambda q, x, probe: ref.apply({"params": q}, x, probe)  # noqa: E731
    chex.assert_trees_all_close(fn(p, x), ref_fn(q, x, probe), rtol=1e-12)
    space, space_ref = pj.trace(fn, p, x), pj.trace(ref_fn, q, x, probe)
    assert {leaf.path: leaf.kind for leaf in space.leaves if leaf.kind == "other"} == {
        "probe": "other", "MultiHeadDotProductAttention_0/query/kernel": "other",
        "MultiHeadDotProductAttention_0/query/bias": "other"}  # fmt: skip
    assert space.num_hidden == space_ref.num_hidden == 4 + 4 + 4 + (6 if queries == 1 else 5)

    def shared(t):
        t = {k: v for k, v in t.items() if k != "probe"}
        return t | {"MultiHeadDotProductAttention_0": {k: v for k, v in t["MultiHeadDotProductAttention_0"].items()
                                                        if k != "query"}}  # fmt: skip

    chex.assert_trees_all_close(shared(pj.path_kappa(space, p)), shared(pj.path_kappa(space_ref, q)), rtol=1e-12)
    chex.assert_trees_all_close(shared(pj.ddp_kappa(space, p, x, alpha=0.5)),
                                shared(pj.ddp_kappa(space_ref, q, (x, probe), alpha=0.5)), rtol=1e-12)  # fmt: skip
    pj.testing.assert_function_invariant(fn, space, p, x)


@pytest.mark.parametrize("mix", ["sum", "gate"])
def test_experts_summed_after_their_layers_keep_their_inner_units_apart(mix):
    """Experts of two layers written with einsum (``h = relu(einsum("bd,edf->bef", x, w1))``, ``y = relu(einsum(
    "bef,efd->bed", h, w2))``) whose outputs are summed (or mixed by a softmax gate): each expert's inner units are
    nodes of their own (3 x 4), its output units shared by the experts (3), as with one kernel per expert; the
    same path norm, κ and DDP-SGD's κ (α 0.5). Before, the sum made the expert axis a position on both sides of
    w2, so the inner units were shared by the experts too (H 4 + 3)."""
    ks = jax.random.split(jax.random.key(21), 6)
    x = _normal(ks[0], (6, 5))
    p = {"w1": _normal(ks[1], (3, 5, 4)), "w2": _normal(ks[2], (3, 4, 3)), "o": _normal(ks[3], (3, 2))}
    p |= {"g": _normal(ks[4], (5, 3))} if mix == "gate" else {}
    apart = p | {k: list(p[k]) for k in ("w1", "w2")}

    def mixed(p, x, y):  # (batch, expert, unit) -> (batch, unit)
        return jnp.einsum("be,bed->bd", jax.nn.softmax(x @ p["g"], -1), y) if "g" in p else y.sum(1)

    def fused_fn(p, x):
        h = jax.nn.relu(jnp.einsum("bd,edf->bef", x, p["w1"]))
        return mixed(p, x, jax.nn.relu(jnp.einsum("bef,efd->bed", h, p["w2"]))) @ p["o"]

    def apart_fn(p, x):
        ys = [jax.nn.relu(jax.nn.relu(x @ w1) @ w2) for w1, w2 in zip(p["w1"], p["w2"], strict=True)]
        return mixed(p, x, jnp.stack(ys, 1)) @ p["o"]

    def fuse(t):
        return t | {k: jnp.stack(t[k]) for k in ("w1", "w2")}

    chex.assert_trees_all_close(fused_fn(p, x), apart_fn(apart, x), rtol=1e-12)
    space, _, got = _quantities(fused_fn, p, x, lambda t: t)
    space_ref, _, expected = _quantities(apart_fn, apart, x, fuse)  # (the inner units one group per expert there)
    assert space.num_hidden == space_ref.num_hidden == 3 * 4 + 3
    chex.assert_trees_all_close(got, expected, rtol=1e-12)
    pj.testing.assert_function_invariant(fused_fn, space, p, x, rtol=1e-10)


def test_a_fused_recurrent_kernel_cut_into_a_gate_and_a_relu_half_is_two_kernels():
    """A recurrent cell whose input and recurrent kernels each compute a ReLU half and a sigmoid gate at once
    (``a, g = jnp.split(x @ wx + h @ wh + b, 2, -1)``, ``h = relu(a) * sigmoid(g)``): the path norm, κ⁽¹⁾ + κ⁽²⁾ and
    DDP-SGD's κ (α 0.5) are those of the cell with one kernel per half."""
    ks = jax.random.split(jax.random.key(14), 5)
    n = 4
    fused = {"wx": _normal(ks[0], (3, 2 * n)), "wh": _normal(ks[1], (n, 2 * n), 0.4),
             "b": _normal(ks[2], (2 * n,), 0.1), "wo": _normal(ks[3], (n, 2))}  # fmt: skip
    apart = {k: [fused[k][..., :n], fused[k][..., n:]] for k in ("wx", "wh", "b")} | {"wo": fused["wo"]}
    x = _normal(ks[4], (5, 4, 3))

    def rnn(halves):
        def fn(p, xs):
            def step(h, xt):
                a, g = halves(p, h, xt)
                return jax.nn.relu(a) * jax.nn.sigmoid(g), None

            h, _ = jax.lax.scan(step, jnp.zeros((xs.shape[0], n), xs.dtype), jnp.swapaxes(xs, 0, 1))
            return h @ p["wo"]

        return fn

    fused_fn = rnn(lambda p, h, xt: jnp.split(xt @ p["wx"] + h @ p["wh"] + p["b"], 2, axis=-1))
    apart_fn = rnn(lambda p, h, xt: [xt @ p["wx"][i] + h @ p["wh"][i] + p["b"][i] for i in range(2)])

    def quantities(fn, p, fuse):
        space = pj.trace(fn, p, x)
        kappa, ddp = pj.path_kappa(space, p), pj.ddp_kappa(space, p, x, alpha=0.5)  # (κ⁽¹⁾ + κ⁽²⁾, the default)
        return space.num_hidden, [pj.path_norm(space, p), fuse(kappa), fuse(ddp)]

    (h, got), (h_ref, expected) = (
        quantities(fused_fn, fused, lambda t: t),
        quantities(
            apart_fn, apart, lambda t: {k: jnp.concatenate(v, -1) if isinstance(v, list) else v for k, v in t.items()}
        ),
    )
    assert h == h_ref == n
    chex.assert_trees_all_close(got, expected, rtol=1e-12)


@pytest.mark.parametrize("head", ["two heads side by side", "one kernel, cut and joined", "one kernel, returned whole"])
def test_an_output_pinned_in_part_is_its_heads_apart(head):
    """An output whose groups are pinned in part: ``concatenate([tanh(r @ a), r @ b])``; one kernel ``r @ w`` cut, its
    first units through tanh and joined again; or ``r @ w`` returned whole next to ``tanh`` of its first units. The
    path norm, κ and DDP-SGD's κ (α 0.5) are those of the same heads with one kernel each, returned apart. Before,
    the heads side by side were a boundary as a whole, and the path norm counted the tanh units once more, as ones
    (the one-kernel forms were right only because the whole kernel was pinned, its units never rescaled)."""
    ks = jax.random.split(jax.random.key(15), 4)
    h, w = _normal(ks[0], (3, 3)), _normal(ks[1], (3, 6))
    x = _normal(ks[2], (6, 3))
    joined_fn = {
        "two heads side by side": lambda p, r: jnp.concatenate([jnp.tanh(r @ p["w"][0]), r @ p["w"][1]], -1),
        "one kernel, cut and joined": lambda p, r: (lambda z: jnp.concatenate([jnp.tanh(z[:, :2]), z[:, 2:]], -1))(
            r @ p["w"]
        ),
        "one kernel, returned whole": lambda p, r: (lambda z: (jnp.tanh(z[:, :2]), z))(r @ p["w"]),
    }[head]
    apart_fn = {
        "one kernel, returned whole": lambda p, r: (lambda za: (jnp.tanh(za), za, r @ p["w"][1]))(r @ p["w"][0]),
    }.get(head, lambda p, r: (jnp.tanh(r @ p["w"][0]), r @ p["w"][1]))
    apart = {"h": h, "w": [w[:, :2], w[:, 2:]]}
    joined = apart if head == "two heads side by side" else {"h": h, "w": w}

    def quantities(fn, p):
        network = lambda p, x: fn(p, jax.nn.relu(x @ p["h"]))  # noqa: E731
        space = pj.trace(network, p, x)
        fuse = lambda t: {**t, "w": jnp.concatenate(t["w"], -1) if isinstance(t["w"], list) else t["w"]}  # noqa: E731
        return space.num_hidden, [pj.path_norm(space, p), fuse(pj.path_kappa(space, p)),
                                  fuse(pj.ddp_kappa(space, p, x, alpha=0.5))]  # fmt: skip

    (n, got), (n_ref, expected) = quantities(joined_fn, joined), quantities(apart_fn, apart)
    assert n == n_ref == 3
    chex.assert_trees_all_close(got, expected, rtol=1e-12)


class _RoutedMoE(nn.Module):
    """Three experts (``nn.vmap``'d Dense layers) on shared hidden units, weighted by a softmax gate, or by its
    ``top_k`` largest weights spread back over the experts with a one-hot (a routed mixture)."""

    top_k: int | None = None

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(6)(x))
        gate = jax.nn.softmax(nn.Dense(3)(h))
        if self.top_k is not None:
            weights, chosen = jax.lax.top_k(gate, self.top_k)
            gate = jnp.sum(jax.nn.one_hot(chosen, 3, dtype=gate.dtype) * weights[..., None], axis=-2)
        experts = nn.vmap(nn.Dense, variable_axes={"params": 0}, split_rngs={"params": True}, in_axes=None,
                          out_axes=1, axis_size=3)  # fmt: skip
        return nn.Dense(2)(jnp.einsum("be,bed->bd", gate, nn.relu(experts(4)(h))))


def test_a_top_k_routed_mixture_keeps_its_experts_units():
    """Top-2 routing (``jax.lax.top_k`` of the softmax gate, spread back with ``jax.nn.one_hot``): the routing weights
    are computed from pinned values and constants alone, so they are a gate, and the experts' units stay hidden as in
    the soft mixture. The |·|^p network takes a gate as 1, so the path norm and κ are the soft mixture's with the
    same parameters, and DDP-SGD's steps (on the routing weights' values) are invariant. Before, the one-hot's expert
    axis made the weights an activation that was not fully pinned: the experts' units and the layer reading them were
    pinned (H 6 instead of 10)."""
    x = _normal(jax.random.key(16), (6, 5))
    routed, soft = _RoutedMoE(top_k=2), _RoutedMoE()
    params = _tree_normal(routed.init(jax.random.key(0), x)["params"], 17)
    spaces = [pj.trace(lambda p, x, m=m: m.apply({"params": p}, x), params, x) for m in (routed, soft)]
    assert [space.num_hidden for space in spaces] == [10, 10]
    got, expected = ([pj.path_norm(space, params), pj.path_kappa(space, params)] for space in spaces)
    chex.assert_trees_all_close(got, expected, rtol=1e-12)
    y = _normal(jax.random.key(18), (6, 2))
    fn = spaces[0].fn
    loss = lambda p, batch: jnp.mean((fn(p, batch[0]) - batch[1]) ** 2)  # noqa: E731
    tx = pj.ddp_sgd(spaces[0], 0.05, alpha=0.5)  # (the optimiser that reads the routing weights' values)
    assert_update_invariant(tx, loss, spaces[0], params, (x, y), update_kwargs={"inputs": x}, num_steps=2, rtol=1e-8)


def test_a_concatenation_of_a_relu_group_and_a_pinned_one_is_its_two_layers():
    """``concatenate([relu(x @ a), tanh(x @ b)]) @ w``: the ReLU group keeps its paths into the head, the tanh group
    is a boundary; the path norm, κ and DDP-SGD's κ are those of the same network with the head in two halves
    (``relu(x @ a) @ w_top + tanh(x @ b) @ w_bottom``). Before, the concatenation was a boundary value as a whole,
    so the ReLU units' paths ended there."""
    ks = jax.random.split(jax.random.key(12), 4)
    p = {"a": _normal(ks[0], (3, 4)), "b": _normal(ks[1], (3, 5)), "w": _normal(ks[2], (9, 2))}
    halves = {"a": p["a"], "b": p["b"], "w": [p["w"][:4], p["w"][4:]]}
    x = _normal(ks[3], (6, 3))
    joined_fn = lambda p, x: jnp.concatenate([jax.nn.relu(x @ p["a"]), jnp.tanh(x @ p["b"])], -1) @ p["w"]  # noqa: E731
    halves_fn = lambda p, x: jax.nn.relu(x @ p["a"]) @ p["w"][0] + jnp.tanh(x @ p["b"]) @ p["w"][1]  # noqa: E731

    def quantities(fn, p, fuse):
        space = pj.trace(fn, p, x)
        norm, kappa, ddp = pj.path_norm(space, p), pj.path_kappa(space, p), pj.ddp_kappa(space, p, x, alpha=0.5)
        return space.num_hidden, [norm, fuse(kappa), fuse(ddp)]

    (h, got), (h_ref, expected) = (
        quantities(joined_fn, p, lambda t: t),
        quantities(halves_fn, halves, lambda t: {**t, "w": jnp.concatenate(t["w"])}),
    )
    assert h == h_ref == 4
    chex.assert_trees_all_close(got, expected, rtol=1e-12)


def test_a_value_computed_and_never_used_changes_no_kappa():
    """A jaxpr keeps what the function computes and drops (``_ = h + 1``): it read as one more consumer of the
    pre-activation, which made it a node of its own and changed DDP-SGD's κ (α 0.5) of a gated unit."""
    ks = jax.random.split(jax.random.key(13), 4)
    p = {"a": _normal(ks[0], (3, 4)), "g": _normal(ks[1], (3, 4)), "u": _normal(ks[2], (4, 2))}
    x = _normal(ks[3], (6, 3))

    def fn(p, x, dead=False):
        z = x @ p["a"]
        if dead:
            jnp.concatenate([z, x], -1)  # computed, never used
        return (z * jax.nn.sigmoid(x @ p["g"])) @ p["u"]

    spaces = [pj.trace(functools.partial(fn, dead=dead), p, x) for dead in (False, True)]
    got, expected = (pj.ddp_kappa(space, p, x, alpha=0.5) for space in spaces[::-1])
    chex.assert_trees_all_close(got, expected, rtol=1e-12)


def test_time_major_inputs_are_refused_not_misread():
    """κ runs the network on one example along the inputs' first axis, and DDP averages its statistics over it:
    an RNN that scans the first axis (``time_major=True``) would give κ of a one-step sequence and statistics over
    time steps, silently (relative errors 0.7-4.5 before this check). Path-SGD, DDP-SGD and DDP-Normalization say
    so; G-SGD, which needs no examples, runs; a function that transposes its batch-major input inside is fine."""

    class TimeMajor(nn.Module):
        transpose: bool = False  # take (examples, time, features) and transpose inside

        @nn.compact
        def __call__(self, x):
            x = jnp.swapaxes(x, 0, 1) if self.transpose else x
            h = nn.RNN(nn.SimpleCell(3, activation_fn=nn.relu, param_dtype=F64), time_major=True)(x)
            return nn.Dense(2, param_dtype=F64)(h[-1])

    x = _normal(jax.random.key(2), (2, 4, 2))  # (examples, time, features)
    xt = jnp.swapaxes(x, 0, 1)
    params = _tree_normal(jax.eval_shape(TimeMajor().init, jax.random.key(0), xt)["params"], 0, scale=0.6)
    space = pj.trace(lambda p, xt: TimeMajor().apply({"params": p}, xt), params, xt)
    for call in (lambda: pj.path_kappa(space, params), lambda: pj.path_sgd(space, 0.1),
                 lambda: pj.ddp_kappa(space, params, xt, alpha=1.0),
                 lambda: pj.ddp_normalize(space, alpha=1.0)):  # fmt: skip
        with pytest.raises(pj.PathSpaceError, match="first axis.*examples"):
            call()
    pj.g_sgd(space, 0.1).init(params)
    fn = lambda p, x: TimeMajor(transpose=True).apply({"params": p}, x)  # noqa: E731
    ref = _half_hessian_diag(_gamma2_reference("transposed", fn, x), params)
    chex.assert_trees_all_close(pj.path_kappa(pj.trace(fn, params, x), params), ref, rtol=1e-10, atol=1e-12)


def test_path_kappa_compiles_once_per_shape():
    from pathspace_jax import kappa as kappa_mod

    fn, params, x = _model("rnn_last")
    space = pj.trace(fn, params, x)
    pj.path_kappa(space, params)
    before = kappa_mod.kappa_canonical._cache_size()
    for s in range(3):
        pj.path_kappa(space, _tree_normal(params, 100 + s))
    assert kappa_mod.kappa_canonical._cache_size() == before


def test_rnn_written_with_fori_loop_is_the_scanned_rnn():
    """A ReLU RNN written with ``lax.fori_loop`` (the body reads step t of the inputs it closes over, ``xs[:, t]``,
    by the loop's counter) is the RNN that ``lax.scan`` runs over the same steps: the same κ⁽¹⁾ + κ⁽²⁾ (its
    probes of the recurrence once met the counter traced and raised a JAX error), path norm and DDP-SGD κ."""
    k = jax.random.split(jax.random.key(0), 5)
    q = {"wx": jax.random.normal(k[0], (4, 5), F64), "wh": 0.3 * jax.random.normal(k[1], (5, 5), F64),
         "b": jax.random.normal(k[2], (5,), F64), "wo": jax.random.normal(k[3], (5, 2), F64)}  # fmt: skip
    xs = jax.random.normal(k[4], (6, 7, 4), F64)

    def by_fori(q, xs):
        step = lambda t, h: jax.nn.relu(xs[:, t] @ q["wx"] + h @ q["wh"] + q["b"])  # noqa: E731
        return jax.lax.fori_loop(0, 7, step, jnp.zeros((xs.shape[0], 5), F64)) @ q["wo"]

    def by_scan(q, xs):
        step = lambda h, x: (jax.nn.relu(x @ q["wx"] + h @ q["wh"] + q["b"]), None)  # noqa: E731
        return jax.lax.scan(step, jnp.zeros((xs.shape[0], 5), F64), jnp.swapaxes(xs, 0, 1))[0] @ q["wo"]

    fori, scanned = pj.trace(by_fori, q, xs), pj.trace(by_scan, q, xs)
    assert fori.num_hidden == scanned.num_hidden == 5
    for what in (
        lambda s: pj.path_kappa(s, q),
        lambda s: pj.path_norm(s, q),
        lambda s: pj.ddp_kappa(s, q, xs, alpha=0.5),
    ):
        chex.assert_trees_all_close(what(fori), what(scanned), rtol=1e-12)


@pytest.mark.parametrize("readout", ["mean", "flatten", "per-step"])
def test_rnn_written_as_a_python_loop_from_a_zero_state_is_the_scanned_rnn(readout):
    """A ReLU RNN written as a Python loop from ``h = jnp.zeros(...)``, its states gathered with ``jnp.stack``, has the
    scanned RNN's structure, path norm and κ⁽¹⁾, whether the head reads the mean state, every state (flattened), or
    each step. Before, the zero state times the recurrent kernel was read as a constant input of the network, which
    made the hidden units inputs (H 0 for every readout), and ``jnp.stack`` an unknown primitive. (Its unrolled
    kernel is tied weights, for which κ⁽²⁾ and DDP-SGD's κ say that they are not implemented.)"""
    k = jax.random.split(jax.random.key(1), 5)
    q = {"wx": _normal(k[0], (4, 5)), "wh": _normal(k[1], (5, 5), 0.3), "b": _normal(k[2], (5,)),
         "wo": _normal(k[3], (5 * 7 if readout == "flatten" else 5, 2))}  # fmt: skip
    xs = _normal(k[4], (6, 7, 4))
    cell = lambda q, h, x: jax.nn.relu(x @ q["wx"] + h @ q["wh"] + q["b"])  # noqa: E731

    def by_loop(q, xs):
        h, states = jnp.zeros((xs.shape[0], 5), F64), []
        for t in range(xs.shape[1]):
            h = cell(q, h, xs[:, t])
            states.append(h)
        return head(q, jnp.stack(states, axis=1))

    def by_scan(q, xs):
        step = lambda h, x: (cell(q, h, x),) * 2  # noqa: E731
        return head(
            q, jnp.swapaxes(jax.lax.scan(step, jnp.zeros((xs.shape[0], 5), F64), jnp.swapaxes(xs, 0, 1))[1], 0, 1)
        )

    def head(q, states):
        if readout == "flatten":
            return states.reshape(states.shape[0], -1) @ q["wo"]
        return (states.mean(1) if readout == "mean" else states) @ q["wo"]

    loop, scanned = pj.trace(by_loop, q, xs, strict=True), pj.trace(by_scan, q, xs, strict=True)
    assert loop.num_hidden == scanned.num_hidden == 5
    np.testing.assert_allclose(by_loop(q, xs), by_scan(q, xs), rtol=1e-12)
    for what in (lambda s: pj.path_kappa(s, q, second_order=False), lambda s: pj.path_norm(s, q)):
        chex.assert_trees_all_close(what(loop), what(scanned), rtol=1e-12)


class _PReLUNet(nn.Module):
    shared: bool

    @nn.compact
    def __call__(self, x):
        acts = [nn.PReLU()] * 2 if self.shared else [nn.PReLU(), nn.PReLU()]
        x = acts[0](nn.Dense(7)(x))
        x = acts[1](nn.Dense(5)(x))
        return nn.Dense(3)(x)


def test_a_shared_prelu_slope_is_no_weight_tying():
    """One ``nn.PReLU`` applied after two layers reads its slope twice on a path. The slope is a coefficient (a
    leaf of kind "other"), not an edge: no path crosses an edge twice, so the exact κ⁽²⁾ and DDP-SGD's κ are
    defined (they refused it as weight tying) and equal those of the same network with two slopes of that value."""
    x = jax.random.normal(jax.random.key(0), (8, 6), F64)
    shared, twice = _PReLUNet(shared=True), _PReLUNet(shared=False)
    p = jax.tree_util.tree_map(lambda a: a.astype(F64), shared.init(jax.random.key(1), x)["params"])
    p = {**p, "PReLU_0": {"negative_slope": jnp.asarray(0.25, F64)}}  # a slope of 0.25: leaky on every unit
    q = {**p, "PReLU_1": p["PReLU_0"]}
    s_shared = pj.trace(lambda p, x: shared.apply({"params": p}, x), p, x)
    s_twice = pj.trace(lambda p, x: twice.apply({"params": p}, x), q, x)
    dense = lambda k: {n: v for n, v in k.items() if n.startswith("Dense")}  # noqa: E731
    got, want = [pj.path_kappa(s_shared, p)], [pj.path_kappa(s_twice, q)]
    for alpha in (0.5, 1.0):
        got.append(pj.ddp_kappa(s_shared, p, x, alpha=alpha))
        want.append(pj.ddp_kappa(s_twice, q, x, alpha=alpha))
    for g, w in zip(got, want):
        chex.assert_trees_all_close(dense(g), dense(w), rtol=1e-12)


class _ComputedCoefficient(nn.Module):
    """Three ReLU layers with a coefficient computed from parameters: a learned gain ``exp(s)`` (a scalar) or
    ``softplus(s)`` (one per unit) after the first layer, or the second layer weight-normalised (``nn.WeightNorm``:
    its kernel g·v/‖v‖). ``const``: the same network with the coefficient's value (the gain, or the normalised
    kernel; for weight normalisation v/‖v‖, and g a per-unit scale after it) as a constant."""

    kind: str
    const: Any = None

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(6, param_dtype=F64)(x))
        if self.kind.startswith("weight_norm") or self.kind in ("spectral_norm", "unit_columns"):
            if self.const is None and self.kind == "weight_norm":
                h = nn.relu(nn.WeightNorm(nn.Dense(5, param_dtype=F64))(h))
            elif self.const is None and self.kind in ("weight_norm_g_first", "weight_norm_torch"):  # by hand
                v = self.param("v", nn.initializers.lecun_normal(), (6, 5), F64)
                g = self.param("g", nn.initializers.ones, (5,), F64)
                bias = self.param("Dense_1_bias", nn.initializers.normal(0.1), (5,), F64)
                if self.kind == "weight_norm_g_first":  # (g * v) / ‖v‖
                    kernel = g * v / jnp.linalg.norm(v, axis=0, keepdims=True)
                else:  # v * (g / ‖v‖), as torch.nn.utils.weight_norm computes it
                    kernel = v * (g / jnp.linalg.norm(v, axis=0))
                h = nn.relu(h @ kernel + bias)
            elif self.const is None and self.kind == "unit_columns":  # a kernel of unit columns, no gain
                v = self.param("Dense_1_kernel", nn.initializers.lecun_normal(), (6, 5), F64)
                bias = self.param("Dense_1_bias", nn.initializers.normal(0.1), (5,), F64)
                h = nn.relu(h @ (v / jnp.linalg.norm(v, axis=0)) + bias)
            elif self.const is None:
                h = nn.relu(nn.SpectralNorm(nn.Dense(5, param_dtype=F64))(h, update_stats=False))
            else:
                if self.kind.startswith("weight_norm"):
                    h = (h @ self.const) * self.param("scale", nn.initializers.ones, (5,), F64)
                else:
                    h = h @ self.const
                h = nn.relu(h + self.param("Dense_1_bias", nn.initializers.zeros, (5,), F64))
        else:
            if self.const is not None:
                h = h * self.const
            else:
                s = self.param("s", nn.initializers.normal(1.0), (6,) if self.kind == "softplus" else (), F64)
                h = h * (jnp.exp(s) if self.kind == "exp" else jax.nn.softplus(s))
            h = nn.relu(nn.Dense(5, param_dtype=F64, name="Dense_1")(h))
        return nn.Dense(3, param_dtype=F64, name="Dense_2")(h)


@pytest.mark.parametrize(
    "kind",
    ["exp", "softplus", "weight_norm", "weight_norm_g_first", "weight_norm_torch", "spectral_norm", "unit_columns"],
)
def test_coefficients_computed_from_parameters_are_raised_where_they_are_read(kind):
    """A coefficient computed from parameters (a gain exp(s) or softplus(s), weight normalisation's g·v/‖v‖ in
    Flax's order, as ``(g * v) / ‖v‖`` or as PyTorch's ``v * (g / ‖v‖)``, spectral normalisation's W/σ(W), a kernel of
    unit columns v/‖v‖) is computed from the parameters as they are and
    raised to p where the |·|^p network reads it: the path norm, κ and DDP-SGD's κ (α 0.5: its γ² recursion) equal
    those of the same network with the coefficient's value as a constant. Before, the |·|^p network raised
    the parameters first and refused ``exp``, or the product g·v, as "not positively homogeneous"; the trace read
    v/‖v‖ as a view of v (an edge), and spectral normalisation's power iteration (from the float32 vector u) left a
    tracer in the cached program."""
    x = jax.random.normal(jax.random.key(0), (8, 4), F64)
    model = _ComputedCoefficient(kind)
    variables = model.init(jax.random.key(1), x)
    p, stats = variables["params"], {k: v for k, v in variables.items() if k != "params"}  # (the power iteration's u)
    if kind == "weight_norm":
        v, g = p["Dense_1"]["kernel"], p["WeightNorm_0"]["Dense_1/kernel/scale"]
        g = g * jnp.asarray([0.5, 2.0, 1.5, 0.75, 1.25], F64)  # not all ones: a scale the paths do go through
        p = {**p, "WeightNorm_0": {"Dense_1/kernel/scale": g}}
        value = v * jax.lax.rsqrt(jnp.sum(v * v, axis=0) + 1e-12)  # flax's normalisation written out, before g
    if kind in ("weight_norm_g_first", "weight_norm_torch"):
        v, g = p["v"], p["g"] * jnp.asarray([0.5, 2.0, 1.5, 0.75, 1.25], F64)
        p = {**p, "g": g}
        value = v / jnp.linalg.norm(v, axis=0)
    if kind == "spectral_norm":  # one step of power iteration from u (float32), written out
        w, u = p["Dense_1"]["kernel"], stats["batch_stats"]["SpectralNorm_0"]["Dense_1/kernel/u"].astype(F64)
        v = u @ w.T
        v = v * jax.lax.rsqrt(jnp.sum(v * v) + 1e-12)
        u = v @ w
        u = u * jax.lax.rsqrt(jnp.sum(u * u) + 1e-12)
        value = w / (v @ w @ u.T)[0, 0]
    if kind == "unit_columns":
        value = p["Dense_1_kernel"] / jnp.linalg.norm(p["Dense_1_kernel"], axis=0)
        q = {k: v for k, v in p.items() if k != "Dense_1_kernel"}
        shared = shared_ref = lambda k: {n: v for n, v in k.items() if n != "Dense_1_kernel"}  # noqa: E731
    elif kind in ("weight_norm_g_first", "weight_norm_torch"):  # g: a per-unit scale of v/‖v‖'s outputs
        q = {"Dense_0": p["Dense_0"], "Dense_1_bias": p["Dense_1_bias"], "Dense_2": p["Dense_2"], "scale": g}
        shared = lambda k: {n: k[n] for n in ("Dense_0", "Dense_1_bias", "Dense_2", "g")}  # noqa: E731
        shared_ref = lambda k: {**{n: k[n] for n in ("Dense_0", "Dense_1_bias", "Dense_2")}, "g": k["scale"]}  # noqa: E731
    elif kind in ("weight_norm", "spectral_norm"):
        q = {"Dense_0": p["Dense_0"], "Dense_1_bias": p["Dense_1"]["bias"], "Dense_2": p["Dense_2"]}
        shared = lambda k: {"Dense_0": k["Dense_0"], "Dense_1/bias": k["Dense_1"]["bias"], "Dense_2": k["Dense_2"]}  # noqa: E731
        shared_ref = lambda k: {"Dense_0": k["Dense_0"], "Dense_1/bias": k["Dense_1_bias"], "Dense_2": k["Dense_2"]}  # noqa: E731
        if kind == "weight_norm":  # g: a per-unit scale of v/‖v‖'s outputs
            q["scale"] = g
            shared = lambda k, s=shared: {**s(k), "g": k["WeightNorm_0"]["Dense_1/kernel/scale"]}  # noqa: E731
            shared_ref = lambda k, s=shared_ref: {**s(k), "g": k["scale"]}  # noqa: E731
    else:
        value = jnp.exp(p["s"]) if kind == "exp" else jax.nn.softplus(p["s"])
        q = {k: v for k, v in p.items() if k != "s"}
        shared = shared_ref = lambda k: {n: v for n, v in k.items() if n != "s"}  # noqa: E731
    ref = _ComputedCoefficient(kind, const=value)
    fn, fn_ref = (lambda p, x: model.apply({"params": p, **stats}, x)), (lambda q, x: ref.apply({"params": q}, x))
    np.testing.assert_allclose(fn(p, x), fn_ref(q, x), rtol=1e-12)
    space, space_ref = pj.trace(fn, p, x), pj.trace(fn_ref, q, x)
    hidden = {"exp": 11, "softplus": 11}.get(kind, 5 if kind.startswith("weight_norm") else 0)
    assert space.num_hidden == space_ref.num_hidden == hidden
    np.testing.assert_allclose(pj.path_norm(space, p), pj.path_norm(space_ref, q), rtol=1e-12)
    kappa = shared(pj.path_kappa(space, p))
    chex.assert_trees_all_close(kappa, shared_ref(pj.path_kappa(space_ref, q)), rtol=1e-12)
    assert all(np.all(np.asarray(k) > 0) for k in jax.tree_util.tree_leaves(kappa))  # every edge on some path
    k, k_ref = pj.ddp_kappa(space, p, x, alpha=0.5), pj.ddp_kappa(space_ref, q, x, alpha=0.5)  # the γ² recursion
    chex.assert_trees_all_close(shared(k), shared_ref(k_ref), rtol=1e-12)
    if space.num_hidden:  # the gain's parameter is an "other" leaf: the updates stay invariant
        y = jnp.zeros((8, 3), F64)
        for tx, kw in ((pj.path_sgd(space, 0.05), {}), (pj.ddp_sgd(space, 0.05, alpha=0.5), {"inputs": x})):
            assert_update_invariant(tx, jax.jit(_loss(fn)), space, p, (x, y), update_kwargs=kw, num_steps=2,
                                    rtol=1e-8, atol=1e-10)  # fmt: skip


class _InputGate(nn.Module):
    """Two ReLU layers whose first one's units are gated by a function of the input alone (``sigmoid(x[:, :1])``),
    the second's unit 0 zeroed (``.at[:, 0].set(0)``)."""

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(6, param_dtype=F64)(x)) * jax.nn.sigmoid(x[:, :1])
        h = nn.relu(nn.Dense(5, param_dtype=F64)(h)).at[:, 0].set(0.0)
        return nn.Dense(2, param_dtype=F64)(h)


def test_a_gate_from_the_inputs_alone_is_one_and_a_zeroed_unit_carries_no_path():
    """A gate computed from the inputs alone is a coefficient of the examples that no rescaling changes: the units
    it multiplies stay hidden, and the |·|^p network takes it as 1 (as attention's weights); a unit set to zero
    with ``.at[...].set(0)`` stays a hidden unit and carries no path. κ is the half Hessian of that
    γ², written by hand; Path-SGD's and DDP-SGD's steps are invariant. Before, ``.at[].set`` pinned the second
    layer's units (a "scatter" not known to be homogeneous) and κ refused the sigmoid."""
    x = jax.random.normal(jax.random.key(0), (8, 3), F64)
    model = _InputGate()
    p = model.init(jax.random.key(1), x)["params"]
    fn = lambda p, x: model.apply({"params": p}, x)  # noqa: E731
    space = pj.trace(fn, p, x)
    assert space.num_hidden == 6 + 5

    def gamma2(p):
        q = _squared(p)
        h = jnp.ones(3) @ q["Dense_0"]["kernel"] + q["Dense_0"]["bias"]  # the gate: 1
        h = (h @ q["Dense_1"]["kernel"] + q["Dense_1"]["bias"]).at[0].set(0.0)
        return jnp.sum(h @ q["Dense_2"]["kernel"] + q["Dense_2"]["bias"])

    np.testing.assert_allclose(pj.path_norm(space, p) ** 2, gamma2(p), rtol=1e-12)
    ref = _half_hessian_diag(gamma2, p)
    chex.assert_trees_all_close(pj.path_kappa(space, p), ref, rtol=1e-10, atol=1e-12)
    y = jnp.zeros((8, 2), F64)
    g = jax.grad(_loss(fn))(p, (x, y))
    for tx, kw in ((pj.path_sgd(space, 0.05), {}), (pj.ddp_sgd(space, 0.05, alpha=0.5), {"inputs": x})):
        assert_update_invariant(tx, jax.jit(_loss(fn)), space, p, (x, y), update_kwargs=kw, num_steps=2,
                                rtol=1e-8, atol=1e-10)  # fmt: skip
        u = tx.update(g, tx.init(p), p, **kw)[0]  # the zeroed unit's κ and gradient are 0: its step too, not NaN
        assert np.all(np.asarray(u["Dense_1"]["kernel"][:, 0]) == 0.0)
        assert all(np.all(np.isfinite(a)) for a in jax.tree_util.tree_leaves(u))


class _Preprocessed(nn.Module):
    pre: bool

    @nn.compact
    def __call__(self, x):
        x = jnp.log1p(jnp.abs(x)) if self.pre else x
        return nn.Dense(2, param_dtype=F64)(nn.relu(nn.Dense(5, param_dtype=F64)(x)))


def test_inputs_preprocessed_by_a_nonlinear_function_are_the_network_s_inputs():
    """``log1p(|x|)`` inside the traced function, before the first layer: Path-SGD's κ and DDP-SGD's κ (α 0.5) are
    those of the same network given the preprocessed inputs (they refused the log1p as not positively
    homogeneous)."""
    x = jax.random.normal(jax.random.key(0), (6, 3), F64)
    pre, plain = _Preprocessed(True), _Preprocessed(False)
    p = pre.init(jax.random.key(1), x)["params"]
    s_pre = pj.trace(lambda p, x: pre.apply({"params": p}, x), p, x)
    s_plain = pj.trace(lambda p, x: plain.apply({"params": p}, x), p, x)
    assert s_pre.num_hidden == s_plain.num_hidden == 5
    chex.assert_trees_all_close(pj.path_kappa(s_pre, p), pj.path_kappa(s_plain, p), rtol=1e-12)
    got, want = pj.ddp_kappa(s_pre, p, x, alpha=0.5), pj.ddp_kappa(s_plain, p, jnp.log1p(jnp.abs(x)), alpha=0.5)
    chex.assert_trees_all_close(got, want, rtol=1e-12)


def test_weight_tying_refused_for_second_order_only():
    def tied_fn(p, x):  # the same W on two layers: a path crosses it twice outside any recurrence
        h = jax.nn.relu(x @ p["w"])
        return jax.nn.relu(h @ p["w"]) @ p["v"]

    p = {"w": _normal(jax.random.key(0), (3, 3)), "v": _normal(jax.random.key(1), (3, 2))}
    x = jnp.ones((2, 3), F64)
    space = pj.trace(tied_fn, p, x)
    with pytest.raises(pj.PathKappaUnsupportedError, match="tying"):
        pj.path_kappa(space, p)
    # κ⁽¹⁾ = ∂G/∂p̃ with G(p̃) the model on squared params and an all-ones input
    g_tilde = jax.grad(lambda q: jnp.sum(tied_fn(q, jnp.ones((1, 3), F64))))(_squared(p))
    chex.assert_trees_all_close(pj.path_kappa(space, p, second_order=False), g_tilde, rtol=1e-10)
    with pytest.raises(pj.DDPUnsupportedError, match="tying, at .*test_kappa.py"):  # DDP's κ: the same
        pj.ddp_kappa(space, p, x, alpha=1.0)


def _tied_lm(p, ids):  # the table looked up, then read again as the decoder (``nn.Embed.attend``)
    h = jax.nn.relu(p["emb"][ids] @ p["w0"] + p["b0"])
    return jax.nn.relu(h @ p["w1"] + p["b1"]) @ p["emb"].T


def test_tied_embedding_is_no_tying_for_kappa():
    """A tied embedding is no edge tensor: the embedding dimension is a pinned group, so the paths into it end
    there and those out of it start at 1; no path crosses the table twice. κ⁽¹⁾ + κ⁽²⁾ (the default) is then
    exact: ½ diag ∇² of γ² with those boundaries, written out by hand, and κ⁽²⁾ adds nothing."""
    shapes = {"emb": (7, 3), "w0": (3, 4), "b0": (4,), "w1": (4, 3), "b1": (3,)}
    params = _tree_normal({k: jax.ShapeDtypeStruct(v, F64) for k, v in shapes.items()}, 7, scale=0.8)
    space = pj.trace(_tied_lm, params, jnp.arange(3))
    assert [g.kind for g in space.groups].count("hidden") == 1 and space.num_hidden == 4

    def gamma2(p):  # one-hot inputs -> table (ends at the pinned group); 1 -> w0, b0 -> w1, b1 (ends); 1 -> table
        q = _squared(p)
        lookups = jnp.sum(jnp.ones(7) @ q["emb"])
        middle = jnp.sum((jnp.ones(3) @ q["w0"] + q["b0"]) @ q["w1"] + q["b1"])
        return lookups + middle + jnp.sum(jnp.ones(3) @ q["emb"].T)

    np.testing.assert_allclose(float(pj.path_norm(space, params)) ** 2, float(gamma2(params)), rtol=1e-12)
    ref = _half_hessian_diag(gamma2, params)
    chex.assert_trees_all_close(pj.path_kappa(space, params), ref, rtol=1e-10, atol=1e-12)
    chex.assert_trees_all_close(pj.path_kappa(space, params, second_order=False), ref, rtol=1e-10, atol=1e-12)
    ids = jnp.arange(5) % 7  # DDP-SGD's κ at α = 0 is Path-SGD's
    chex.assert_trees_all_close(pj.ddp_kappa(space, params, ids, alpha=0.0), ref, rtol=1e-10, atol=1e-12)


def test_tied_embedding_rnn_takes_default_path_sgd_and_ddp_steps_invariantly():
    """The zoo's tied-embedding LM (a ReLU RNN between the lookup and the decoder): Path-SGD with its default
    κ⁽¹⁾ + κ⁽²⁾ (the recurrent kernel's κ⁽²⁾ exact, the table no tying) and DDP-SGD step invariantly."""
    case = ZOO["tied_embedding_rnn"]
    space, x = pj.trace(case.fn, case.params, case.inputs(2)), case.inputs(3)
    kappa = pj.path_kappa(space, case.params)
    first = pj.path_kappa(space, case.params, second_order=False)
    np.testing.assert_array_equal(kappa["Embed_0"]["embedding"], first["Embed_0"]["embedding"])
    k_rec, f_rec = kappa["SimpleCell_0"]["h"]["kernel"], first["SimpleCell_0"]["h"]["kernel"]
    assert float(jnp.min(k_rec - f_rec)) >= 0 and float(jnp.max(k_rec - f_rec)) > 1e-3 * float(jnp.max(k_rec))
    y = jnp.zeros_like(case.fn(case.params, x))
    for tx, kw in ((pj.path_sgd(space, 0.05), {}), (pj.ddp_sgd(space, 0.05, alpha=0.5), {"inputs": x})):
        assert_update_invariant(tx, jax.jit(_loss(case.fn)), space, case.params, (x, y), update_kwargs=kw,
                                num_steps=2, rtol=1e-8, atol=1e-10)  # fmt: skip


def test_ensemble_members_have_their_own_kappa_and_steps():
    """The zoo's ``nn.vmap`` ensemble (three MLPs, averaged): each member's κ and DDP κ are those of the member
    traced alone, and G-SGD, Path-SGD and DDP-SGD steps commute with rescaling one member's hidden unit alone
    (nodes shared by the members would not see that rescaling)."""
    case = ZOO["vmap_ensemble_mean"]
    x = case.inputs(6)
    space, params = pj.trace(case.fn, case.params, x), case.params
    mlp = MLP(widths=(4,), out=2)
    one = lambda p, x: mlp.apply({"params": p}, x)  # noqa: E731
    for m in range(3):
        member = jax.tree_util.tree_map(lambda a, m=m: a[m], params["VmapMLP_0"])
        alone = pj.trace(one, member, x)
        for mine, its in (
            (pj.path_kappa(space, params), pj.path_kappa(alone, member)),
            (pj.ddp_kappa(space, params, x, alpha=0.5), pj.ddp_kappa(alone, member, x, alpha=0.5)),
        ):
            chex.assert_trees_all_close(jax.tree_util.tree_map(lambda a, m=m: a[m], mine["VmapMLP_0"]), its,
                                        rtol=1e-10, atol=1e-14)  # fmt: skip
    first, second = params["VmapMLP_0"]["Dense_0"], params["VmapMLP_0"]["Dense_1"]
    scaled = {"VmapMLP_0": {  # member 1's hidden unit 2 times 4, its outgoing weights divided by 4
        "Dense_0": {"kernel": first["kernel"].at[1, :, 2].multiply(4.0), "bias": first["bias"].at[1, 2].multiply(4.0)},
        "Dense_1": {"kernel": second["kernel"].at[1, 2, :].multiply(0.25), "bias": second["bias"]},
    }}  # fmt: skip
    chex.assert_trees_all_close(case.fn(scaled, x), case.fn(params, x), rtol=1e-12)
    y, loss = jnp.ones_like(case.fn(params, x)), jax.jit(_loss(case.fn))
    for tx, kw in ((pj.g_sgd(space, 0.05), {}), (pj.path_sgd(space, 0.05), {}),
                   (pj.ddp_sgd(space, 0.05, alpha=0.5), {"inputs": x})):  # fmt: skip

        @jax.jit
        def step(p, state, tx=tx, kw=kw):
            u, state = tx.update(jax.grad(loss)(p, (x, y)), state, p, **kw)
            return optax.apply_updates(p, u), state

        outs = []
        for p in (params, scaled):
            state = tx.init(p)
            for _ in range(2):
                p, state = step(p, state)
            outs.append(case.fn(p, x))
        chex.assert_trees_all_close(outs[1], outs[0], rtol=1e-9, atol=1e-12)
        assert not np.allclose(outs[0], case.fn(params, x))


def test_bidirectional_rnn_with_sequence_lengths():
    """``nn.Bidirectional`` with ``seq_lengths`` reverses each sequence within its length (``take_along_axis``: a
    gather batched over the examples): both directions are hidden groups, κ is that of the network without
    lengths (every position, as on the all-ones input), and Path-SGD and DDP-SGD steps are invariant."""

    class Bi(nn.Module):
        lengths: bool = True

        @nn.compact
        def __call__(self, x, lengths=None):
            rnn = lambda: nn.RNN(nn.SimpleCell(4, activation_fn=nn.relu, param_dtype=F64))  # noqa: E731
            h = nn.Bidirectional(rnn(), rnn())(x, seq_lengths=lengths if self.lengths else None)
            return nn.Dense(2, param_dtype=F64)(h.sum(1))

    x, lengths = _normal(jax.random.key(3), (5, 6, 3)), jnp.array([6, 3, 4, 2, 5])
    fn = lambda p, x, n: Bi().apply({"params": p}, x, n)  # noqa: E731
    params = _tree_normal(jax.eval_shape(Bi().init, jax.random.key(0), x, lengths)["params"], 0, scale=0.6)
    space = pj.trace(fn, params, x, lengths)
    assert space.num_hidden == 2 * 4
    full = pj.trace(lambda p, x: Bi(lengths=False).apply({"params": p}, x), params, x)
    chex.assert_trees_all_close(pj.path_kappa(space, params), pj.path_kappa(full, params), rtol=1e-12, atol=1e-14)
    y, loss = jnp.zeros((5, 2)), lambda p, b: jnp.mean((fn(p, *b[0]) - b[1]) ** 2)
    for tx, kw in ((pj.path_sgd(space, 0.05), {}), (pj.ddp_sgd(space, 0.05, alpha=0.5), {"inputs": (x, lengths)})):
        assert_update_invariant(tx, loss, space, params, ((x, lengths), y), inputs=(x, lengths), update_kwargs=kw,
                                rtol=1e-8, atol=1e-10)  # fmt: skip


def test_recurrence_other_than_single_entries_refused_for_second_order_only():
    """A two-layer recurrence (a kernel entry joins a carry unit to every next carry unit, through the middle
    layer) has no exact κ⁽²⁾ here: refused, while κ⁽¹⁾ still equals ∂G/∂p̃ (the model on squared params and
    an all-ones input)."""

    def deep_rnn(p, x):  # h_t = relu(relu(h_{t-1} W1) W2 + x_t U)
        def cell(h, xt):
            h = jax.nn.relu(jax.nn.relu(h @ p["w1"]) @ p["w2"] + xt @ p["u"])
            return h, h

        h, _ = jax.lax.scan(cell, jnp.zeros((x.shape[0], 5), x.dtype), jnp.swapaxes(x, 0, 1))
        return h @ p["v"]

    ks = jax.random.split(jax.random.key(0), 4)
    p = {"w1": _normal(ks[0], (5, 4)), "w2": _normal(ks[1], (4, 5)), "u": _normal(ks[2], (2, 5)),
         "v": _normal(ks[3], (5, 2))}  # fmt: skip
    x = jnp.ones((2, 4, 2), F64)
    space = pj.trace(deep_rnn, p, x)
    with pytest.raises(pj.PathKappaUnsupportedError, match="other than single entries"):
        pj.path_kappa(space, p)
    g_tilde = jax.grad(lambda q: jnp.sum(deep_rnn(q, jnp.ones((1, 4, 2), F64))))(_squared(p))
    chex.assert_trees_all_close(pj.path_kappa(space, p, second_order=False), g_tilde, rtol=1e-10)
