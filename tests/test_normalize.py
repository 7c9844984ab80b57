"""DDP-Normalization against hand-written forward passes of its definition, in float64.

References are written out independently of pathspace_jax.normalize (Neyshabur, Salakhutdinov, Tomioka,
Srebro, "Data-dependent path normalization in neural networks", ICLR 2016, eqs. 8-10): an MLP and a CNN
whose every hidden pre-activation is divided by γ̃_v, γ̃_v² = α S(z̃_v) + (1 − α) Σ w̃²_{→v}; batch
normalisation itself (``flax.linen.BatchNorm``); γ_v = 1 by the recursion of eq. 4 written out; the
orthogonality of Theorem 1 and the invariance to scaling a node's incoming weights.
"""

from __future__ import annotations

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import pathspace_jax as pj

F64 = jnp.float64
CASES = [(0.0, "second"), (0.5, "second"), (1.0, "second"), (0.0, "variance"), (0.5, "variance"), (1.0, "variance")]


def _stat(z, moment, axes):
    return jnp.mean(z * z, axis=axes) if moment == "second" else jnp.var(z, axis=axes)


def mlp_fn(p, x):
    h = jax.nn.relu(x @ p["w0"] + p["b0"])
    h = jax.nn.relu(h @ p["w1"] + p["b1"])
    return h @ p["w2"] + p["b2"]


def mlp_tilde(p, x, alpha, moment):
    """Eqs. 8-10 for `mlp_fn`: each hidden layer divided by γ̃ on the batch, the output layer as it is."""
    h = x
    for i in range(2):
        z = h @ p[f"w{i}"] + p[f"b{i}"]
        g2 = alpha * _stat(z, moment, 0) + (1 - alpha) * (jnp.sum(p[f"w{i}"] ** 2, 0) + p[f"b{i}"] ** 2)
        h = jax.nn.relu(z / jnp.sqrt(g2))
    return h @ p["w2"] + p["b2"]


def _conv(x, k):
    return jax.lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))


def cnn_fn(p, x):
    h = jax.nn.relu(_conv(x, p["k0"]) + p["c0"])
    h = jax.nn.relu(_conv(h, p["k1"]) + p["c1"])
    return h.reshape(h.shape[0], -1) @ p["w"] + p["b"]


def cnn_tilde(p, x, alpha, moment):
    """Channels are the nodes: statistics over the batch and every position; Σ w̃² over taps and inputs."""
    h = x
    for i in range(2):
        z = _conv(h, p[f"k{i}"]) + p[f"c{i}"]
        g2 = alpha * _stat(z, moment, (0, 1, 2)) + (1 - alpha) * (jnp.sum(p[f"k{i}"] ** 2, (0, 1, 2)) + p[f"c{i}"] ** 2)
        h = jax.nn.relu(z / jnp.sqrt(g2))
    return h.reshape(h.shape[0], -1) @ p["w"] + p["b"]


def mlp_gamma2(p, x, alpha, moment):
    """γ_v² (eq. 4) of `mlp_fn`'s pre-activations, layer by layer: α S(z_v) + (1 − α) Σ_u γ_u² w²_{u→v}, with
    γ² = 1 on the inputs and the bias node."""
    h, g2, out = x, jnp.ones(x.shape[1], x.dtype), []
    for i in range(3):
        z = h @ p[f"w{i}"] + p[f"b{i}"]
        g2 = alpha * _stat(z, moment, 0) + (1 - alpha) * (g2 @ p[f"w{i}"] ** 2 + p[f"b{i}"] ** 2)
        out.append(g2)
        h = jax.nn.relu(z)
    return out


def _params(shapes, seed):
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return {n: (0.3 if n[0] in "bc" else 1.0) * jax.random.normal(k, s, F64) for k, (n, s) in zip(keys, shapes.items())}


def _case(name):
    if name == "mlp":
        p = _params({"w0": (3, 5), "b0": (5,), "w1": (5, 4), "b1": (4,), "w2": (4, 2), "b2": (2,)}, 0)
        return mlp_fn, mlp_tilde, p, jax.random.normal(jax.random.key(9), (8, 3), F64)
    p = _params({"k0": (3, 3, 2, 3), "c0": (3,), "k1": (3, 3, 3, 4), "c1": (4,), "w": (4 * 4 * 4, 2), "b": (2,)}, 1)
    return cnn_fn, cnn_tilde, p, jax.random.normal(jax.random.key(8), (5, 4, 4, 2), F64)


@pytest.mark.parametrize("alpha,moment", CASES)
@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_fn_tilde_is_the_definition(name, alpha, moment):
    fn, ref, p, x = _case(name)
    space = pj.trace(fn, p, x)
    fn_tilde = pj.ddp_normalize(space, alpha=alpha, moment=moment, eps=0.0)
    chex.assert_trees_all_close(fn_tilde(p, x), ref(p, x, alpha, moment), rtol=1e-12, atol=1e-12)
    # the plain weights of eq. 10 on this batch compute the same function as an ordinary network
    w = pj.ddp_normalized_weights(space, p, x, alpha=alpha, moment=moment, eps=0.0)
    chex.assert_trees_all_close(fn(w, x), fn_tilde(p, x), rtol=1e-12, atol=1e-12)
    assert not np.allclose(fn(p, x), fn_tilde(p, x))  # not vacuous: normalisation changes the function


@pytest.mark.parametrize("alpha,moment", [(0.5, "second"), (1.0, "variance")])
def test_integer_pixels_cast_to_floats_are_an_input_like_the_others(alpha, moment):
    """uint8 inputs that the function casts to floats: the same normalised network as on the float pixels."""
    _, _, p, x = _case("mlp")
    pixels = jnp.asarray(np.round(jnp.abs(x) * 80), jnp.uint8)
    fn = lambda q, u: mlp_fn(q, u.astype(F64) / 255.0)  # noqa: E731
    got = pj.ddp_normalize(pj.trace(fn, p, pixels), alpha=alpha, moment=moment, eps=0.0)(p, pixels)
    want = mlp_tilde(p, pixels.astype(F64) / 255.0, alpha, moment)
    chex.assert_trees_all_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("alpha,moment", [(0.5, "second"), (1.0, "variance")])
def test_a_boolean_mask_is_an_input_like_the_others(alpha, moment):
    """A padding mask passed as booleans and applied with ``jnp.where`` (here to the first hidden layer's
    activations, per example) is an input of the normalised network: the masked examples' zeros enter the next
    layer's statistics, as in the definition written by hand (it was refused as a non-float input)."""
    _, _, p, x = _case("mlp")
    mask = jnp.arange(x.shape[0]) % 3 != 0

    def fn(p, x, m):
        h = jnp.where(m[:, None], jax.nn.relu(x @ p["w0"] + p["b0"]), 0.0)
        return jax.nn.relu(h @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]

    def ref(p, x, m):
        h = x
        for i in range(2):
            z = h @ p[f"w{i}"] + p[f"b{i}"]
            g2 = alpha * _stat(z, moment, 0) + (1 - alpha) * (jnp.sum(p[f"w{i}"] ** 2, 0) + p[f"b{i}"] ** 2)
            h = jax.nn.relu(z / jnp.sqrt(g2))
            h = jnp.where(m[:, None], h, 0.0) if i == 0 else h
        return h @ p["w2"] + p["b2"]

    space = pj.trace(fn, p, x, mask)
    fn_tilde = pj.ddp_normalize(space, alpha=alpha, moment=moment, eps=0.0)
    chex.assert_trees_all_close(fn_tilde(p, x, mask), ref(p, x, mask), rtol=1e-12, atol=1e-12)
    assert not np.allclose(ref(p, x, mask), ref(p, x, jnp.ones_like(mask)))  # the mask matters
    w = pj.ddp_normalized_weights(space, p, x, mask, alpha=alpha, moment=moment, eps=0.0)
    chex.assert_trees_all_close(fn(w, x, mask), fn_tilde(p, x, mask), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("alpha,moment", CASES)
def test_normalised_network_has_unit_gamma_orthogonal_gradients_and_incoming_scale_invariance(alpha, moment):
    fn, _, p, x = _case("mlp")
    space = pj.trace(fn, p, x)
    w = pj.ddp_normalized_weights(space, p, x, alpha=alpha, moment=moment, eps=0.0)
    gammas = mlp_gamma2(w, x, alpha, moment)
    for g in gammas[:2]:  # the two hidden layers (the last pre-activation is the output)
        np.testing.assert_allclose(g, 1.0, rtol=1e-12)
    assert not np.allclose(gammas[2], 1.0)

    fn_tilde = pj.ddp_normalize(space, alpha=alpha, moment=moment, eps=0.0)
    y = jax.random.normal(jax.random.key(3), (8, 2), F64)
    grads = jax.grad(lambda q: jnp.mean((fn_tilde(q, x) - y) ** 2))(p)
    for i in range(2):  # Theorem 1: <w̃_{->v}, dL/dw̃_{->v}> = 0 at every hidden node v
        inner = jnp.sum(p[f"w{i}"] * grads[f"w{i}"], 0) + p[f"b{i}"] * grads[f"b{i}"]
        scale = jnp.sqrt(jnp.sum(p[f"w{i}"] ** 2, 0) + p[f"b{i}"] ** 2) * jnp.sqrt(
            jnp.sum(grads[f"w{i}"] ** 2, 0) + grads[f"b{i}"] ** 2
        )
        assert float(jnp.max(jnp.abs(inner) / scale)) < 1e-10
    # scaling the incoming weights of one hidden node by c > 0 leaves fn_tilde unchanged
    q = dict(p, w1=p["w1"].at[:, 2].multiply(3.7), b1=p["b1"].at[2].multiply(3.7))
    chex.assert_trees_all_close(fn_tilde(q, x), fn_tilde(p, x), rtol=1e-12)
    # node-wise rebalancing is not an invariance of DDP-Normalization (§6)
    scaled = pj.random_rescale(space, p, jax.random.key(4))
    assert not np.allclose(fn_tilde(scaled, x), fn_tilde(p, x))


class _BatchNormNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        for width in (5, 4):
            z = nn.Dense(width, use_bias=False, param_dtype=F64)(x)
            x = nn.relu(nn.BatchNorm(use_running_average=False, use_scale=False, param_dtype=F64)(z))
        return nn.Dense(2, param_dtype=F64)(x)


def test_covariance_with_shift_is_batch_normalisation():
    """Eq. 9 with c_v = 1 (``center=True``) and R_v = Cov at α = 1 is flax's BatchNorm (training mode, scale 1,
    offset = the bias edge), and the exported plain weights reproduce it on that batch."""
    _, _, _, x = _case("mlp")
    model = _BatchNormNet()
    variables = model.init(jax.random.key(1), x)
    params = jax.tree_util.tree_map(lambda a: a + 0.2, variables["params"])
    expected, _ = model.apply({"params": params, "batch_stats": variables["batch_stats"]}, x, mutable=["batch_stats"])
    p = {
        "w0": params["Dense_0"]["kernel"], "b0": params["BatchNorm_0"]["bias"],
        "w1": params["Dense_1"]["kernel"], "b1": params["BatchNorm_1"]["bias"],
        "w2": params["Dense_2"]["kernel"], "b2": params["Dense_2"]["bias"],
    }  # fmt: skip
    space = pj.trace(mlp_fn, p, x)
    eps = 1e-5  # BatchNorm's default epsilon
    got = pj.ddp_normalize(space, alpha=1.0, moment="variance", eps=eps, center=True)(p, x)
    chex.assert_trees_all_close(got, expected, rtol=1e-10, atol=1e-12)
    w = pj.ddp_normalized_weights(space, p, x, alpha=1.0, moment="variance", eps=eps, center=True)
    chex.assert_trees_all_close(mlp_fn(w, x), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.slow
def test_linen_model_jit_vmap_and_dtype():
    model = nn.Sequential([nn.Dense(16), nn.relu, nn.Dense(16), nn.relu, nn.Dense(3)])
    x = jax.random.normal(jax.random.key(0), (32, 8), jnp.float32)
    params = model.init(jax.random.key(1), x)["params"]
    space = pj.trace(lambda p, x: model.apply({"params": p}, x), params, x)
    fn_tilde = pj.ddp_normalize(space, alpha=0.5)
    out = fn_tilde(params, x)
    assert out.dtype == jnp.float32 and out.shape == (32, 3)
    chex.assert_trees_all_close(jax.jit(fn_tilde)(params, x), out, rtol=1e-5, atol=1e-6)
    members = jax.vmap(lambda k: model.init(k, x)["params"])(jax.random.split(jax.random.key(2), 3))
    batched = jax.vmap(fn_tilde, in_axes=(0, None))(members, x)
    for i in range(3):
        member = jax.tree_util.tree_map(lambda a, i=i: a[i], members)
        chex.assert_trees_all_close(batched[i], fn_tilde(member, x), rtol=1e-5, atol=1e-6)
    # a few steps of plain SGD on w̃ train the normalised network
    y = jax.random.normal(jax.random.key(3), (32, 3))
    loss = jax.jit(lambda w: jnp.mean((fn_tilde(w, x) - y) ** 2))
    w, first = params, float(loss(params))
    for _ in range(30):
        w = jax.tree_util.tree_map(lambda a, g: a - 0.1 * g, w, jax.grad(loss)(w))
    assert float(loss(w)) < 0.7 * first
    assert ravel_pytree(w)[0].dtype == jnp.float32


def test_errors():
    fn, _, p, x = _case("mlp")
    space = pj.trace(fn, p, x)
    with pytest.raises(pj.DDPNormalizationError, match="at least 2 examples"):
        pj.ddp_normalize(space, alpha=1.0, moment="variance")(p, x[:1])
    zero = dict(p, w1=p["w1"].at[:, 1].set(0.0), b1=p["b1"].at[1].set(0.0))
    with pytest.raises(pj.DDPNormalizationError, match=r"node\(s\) \[1\] of group g2 have all-zero incoming"):
        pj.ddp_normalize(space, alpha=0.5, eps=0.0)(zero, x)
    assert np.all(np.isfinite(pj.ddp_normalize(space, alpha=0.5)(zero, x)))  # eps > 0 keeps it finite
    with pytest.raises(ValueError, match="alpha"):
        pj.ddp_normalize(space, alpha=1.5)

    def residual_fn(q, x):  # the skip adds h to the next pre-activation: a fixed edge eq. 10 cannot rescale
        h = jax.nn.relu(x @ q["w0"] + q["b0"])
        return jax.nn.relu(h + h @ q["w1"] + q["b1"]) @ q["w2"]

    rp = {"w0": p["w0"], "b0": p["b0"], "w1": jnp.ones((5, 5), F64), "b1": jnp.ones(5, F64), "w2": jnp.ones((5, 2))}
    with pytest.raises(pj.DDPNormalizationError, match="residual"):
        pj.ddp_normalize(pj.trace(residual_fn, rp, x), alpha=0.5)(rp, x)

    def embed_fn(q, ids):
        return jax.nn.relu(q["emb"][ids]) @ q["w"]

    ep = {"emb": jnp.ones((5, 3), F64), "w": jnp.ones((3, 2), F64)}
    with pytest.raises(pj.DDPNormalizationError, match="looks up embeddings by token ids"):
        pj.ddp_normalize(pj.trace(embed_fn, ep, jnp.array([0, 1, 2])), alpha=0.5)(ep, jnp.array([0, 1, 2]))

    def rnn_fn(q, xs):  # a recurrent kernel feeds its nodes at every step: no one statistic per node divides it
        step = lambda h, xt: (jax.nn.relu(xt @ q["w0"] + h @ q["u"] + q["b0"]), None)
        return jax.lax.scan(step, jnp.zeros((xs.shape[0], 5), F64), xs.swapaxes(0, 1))[0] @ q["w2"]

    qp = {"w0": p["w0"], "b0": p["b0"], "u": jnp.eye(5, dtype=F64), "w2": jnp.ones((5, 2), F64)}
    xs = jnp.stack([x, x], axis=1)  # examples first, two steps
    with pytest.raises(pj.DDPNormalizationError, match=r"scan at .*test_normalize.py.*feed-forward networks"):
        pj.ddp_normalize(pj.trace(rnn_fn, qp, xs), alpha=0.5)(qp, xs)


@pytest.mark.parametrize("read", ["loop", "fori_loop"])
def test_layers_stacked_in_one_leaf_are_normalised_layer_by_layer(read):
    """Three layers stacked in one leaf (``ws``, ``bs``), read one by one in a loop or by ``lax.fori_loop``'s
    counter: each layer's slice is normalised by its own nodes' statistics, so the normalised network and the
    plain weights for inference equal those of the same network with one leaf per layer (it was refused)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((16, 4)))
    p = {"w0": rng.standard_normal((4, 5)), "b0": 0.3 * rng.standard_normal(5), "ws": rng.standard_normal((3, 5, 5)),
         "bs": 0.3 * rng.standard_normal((3, 5)), "w2": rng.standard_normal((5, 2))}  # fmt: skip
    p = jax.tree_util.tree_map(jnp.asarray, p)

    def layer(h, w, b):
        return jax.nn.relu(h @ w + b)

    def stacked(q, x):
        h = layer(x, q["w0"], q["b0"])
        if read == "loop":
            for w, b in zip(q["ws"], q["bs"], strict=True):
                h = layer(h, w, b)
        else:
            h = jax.lax.fori_loop(0, 3, lambda i, h: layer(h, q["ws"][i], q["bs"][i]), h)
        return h @ q["w2"]

    def one_leaf_each(q, x):
        h = layer(x, q["w0"], q["b0"])
        for w, b in zip(q["ws"], q["bs"], strict=True):
            h = layer(h, w, b)
        return h @ q["w2"]

    unstack = lambda q: {**q, "ws": list(q["ws"]), "bs": list(q["bs"])}  # noqa: E731
    s_stacked, s_each = pj.trace(stacked, p, x), pj.trace(one_leaf_each, unstack(p), x)
    for alpha, moment, center in ((0.5, "second", False), (1.0, "variance", True), (0.0, "second", False)):
        kw = dict(alpha=alpha, moment=moment, center=center)
        got = pj.ddp_normalize(s_stacked, **kw)(p, x)
        chex.assert_trees_all_close(got, pj.ddp_normalize(s_each, **kw)(unstack(p), x), rtol=1e-12)
        w = pj.ddp_normalized_weights(s_stacked, p, x, **kw)
        chex.assert_trees_all_close(unstack(w), pj.ddp_normalized_weights(s_each, unstack(p), x, **kw), rtol=1e-12)
        chex.assert_trees_all_close(stacked(w, x), got, rtol=1e-10)
