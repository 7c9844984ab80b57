"""DDP-SGD (issue 5): κ against its definitions by autodiff, in float64, and the optax contract.

Every reference below is computed independently of pathspace_jax.ddp: per-example Jacobians of the
model itself (``jax.vmap(jax.jacrev(...))``), and hand-written γ² recursions (Neyshabur et al.,
"Data-dependent path normalization in neural networks", eq. 4) for specific small networks
differentiated twice by ``jax.hessian``.
"""

from __future__ import annotations

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.flatten_util import ravel_pytree
from zoo import ZOO, LocalCNN

import pathspace_jax as pj
from pathspace_jax.frames import kappa_from_frame

# ----------------------------------------------------------------------------- Flax / plain-JAX models
# (importing tests/zoo.py builds its whole zoo, about 10 s, so the models are repeated here, small.)


class LinenCNN(nn.Module):
    """Strided, padded conv, max pool, SAME conv, average pool, flatten, dense."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(3, (3, 3), strides=(2, 2), padding=((1, 0), (0, 1)))(x))
        x = nn.max_pool(x, (2, 2), (1, 1))
        x = nn.relu(nn.Conv(4, (2, 2), padding="SAME")(x))
        x = nn.avg_pool(x, (2, 2), (2, 2))
        return nn.Dense(3)(x.reshape(x.shape[0], -1))


class LinenResCNN(nn.Module):
    """Stem, one residual block, global average pooling, readout."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(4, (3, 3), padding="SAME")(x))
        h = nn.relu(nn.Conv(3, (3, 3), padding="SAME")(x))
        x = nn.relu(x + nn.Conv(4, (3, 3), padding="SAME")(h))
        return nn.Dense(2)(x.mean(axis=(1, 2)))


class LinenSeparable(nn.Module):
    """A depthwise convolution (one filter per channel), a grouped pointwise one (two groups of two channels)."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(4, (2, 2))(x))
        x = nn.relu(nn.Conv(4, (2, 2), feature_group_count=4)(x))
        x = nn.relu(nn.Conv(4, (1, 1), feature_group_count=2)(x))
        return nn.Dense(2)(x.reshape(x.shape[0], -1))


class LinenRNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.RNN(nn.SimpleCell(4, activation_fn=nn.relu, param_dtype=jnp.float64))(x)
        return nn.Dense(2)(h[:, -1])


class NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(4, 6, rngs=rngs, param_dtype=jnp.float64)
        self.l2 = nnx.Linear(6, 3, rngs=rngs, param_dtype=jnp.float64)

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


@jax.custom_vjp
def _my_relu(x):
    return jnp.maximum(x, 0.0)


_my_relu.defvjp(lambda x: (_my_relu(x), x), lambda x, g: (g * (x > 0),))


def _plain_nested_fn(ps, x):
    """jit, checkpoint (remat) and custom_vjp around parts of the network."""

    @jax.jit
    def layer(p, x):
        return x @ p["w"] + p["b"]

    @jax.checkpoint
    def block(p, x):
        return _my_relu(layer(p, x))

    x = jax.nn.relu(layer(ps[0], x))
    x = block(ps[1], x)
    return x @ ps[2]["w"]


def _plain_seq_fn(p, x):  # x: [B, T, 3]; a Dense per time step, transposed, last step read out
    h = jnp.maximum(jnp.einsum("btf,fh->bth", x, p["w1"]) + p["b1"], 0.0)
    return jnp.transpose(h, (0, 2, 1))[:, :, -1] @ p["w2"]


def _plain_graph_fn(p, x):  # x: [B, graph nodes 4, 3]; messages summed into their receivers (a segment sum)
    senders, receivers = jnp.array([0, 1, 2, 3, 0]), jnp.array([1, 2, 3, 0, 2])
    agg = jax.vmap(lambda m: jax.ops.segment_sum(m, receivers, num_segments=4))(x[:, senders] @ p["w_msg"])
    return jax.nn.relu(agg + x @ p["w_self"] + p["b"]).sum(1) @ p["w"]


def _perturb(params, key=None, scale=0.1):
    """Concrete float64 values for a params pytree (or its shapes): ``params + scale * normal``."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    ks = jax.random.split(jax.random.key(99) if key is None else key, len(leaves))
    out = []
    for a, k in zip(leaves, ks, strict=True):
        base = jnp.asarray(a, jnp.float64) if not isinstance(a, jax.ShapeDtypeStruct) else 0.0
        out.append(base + scale * jax.random.normal(k, jnp.shape(a), jnp.float64))
    return jax.tree_util.tree_unflatten(treedef, out)


def _linen(module, xshape, seed=0):
    x = jax.random.normal(jax.random.key(seed + 1), xshape, jnp.float64)
    # shapes only (flax's initialisers are slow to compile here): the values are random normals
    params = _perturb(
        jax.eval_shape(module.init, jax.random.key(seed), x)["params"], key=jax.random.key(seed), scale=0.5
    )
    return (lambda p, x: module.apply({"params": p}, x)), params, x


_FROM_ZOO = {  # models of tests/zoo.py
    "layer_scale": "layer_scale_mlp",  # learned per-unit scales
    "prelu": "prelu_mlp_scalar_gain",  # learned scalar coefficients
    "shared_head": "vmap_members_shared_head",  # nn.vmap'd members read by one head
    "positionwise": "positionwise_dense_flatten_head",  # a Dense at every position, a head over them all
    "plain_graph_max": "plain_graph_segment_max",  # jax.ops.segment_max
}


def _flax_model(name):
    if name == "linen_cnn":
        return _linen(LinenCNN(), (5, 8, 8, 1))
    if name == "linen_res_cnn":
        return _linen(LinenResCNN(), (5, 5, 5, 2))
    if name == "linen_rnn":
        return _linen(LinenRNN(), (3, 4, 2))
    if name == "linen_separable":
        return _linen(LinenSeparable(), (5, 4, 4, 1))
    if name == "linen_local":  # nn.ConvLocal
        return _linen(LocalCNN(), (5, 5, 5, 1))
    if name in _FROM_ZOO:
        case = ZOO[_FROM_ZOO[name]]
        return case.fn, case.params, case.inputs(5)
    if name == "plain_graph":
        shapes = {"w_msg": (3, 4), "b": (4,), "w_self": (3, 4), "w": (4, 2)}
        params = _perturb({k: jax.ShapeDtypeStruct(s, jnp.float64) for k, s in shapes.items()}, scale=1.0)
        return _plain_graph_fn, params, jax.random.normal(jax.random.key(4), (5, 4, 3), jnp.float64)
    if name == "nnx_mlp":
        graphdef, state, rest = nnx.split(NnxMLP(nnx.Rngs(0)), nnx.Param, ...)
        x = jax.random.normal(jax.random.key(2), (5, 4), jnp.float64)
        return (lambda s, x: nnx.merge(graphdef, s, rest)(x)), _perturb(state), x
    if name == "plain_nested":
        k = jax.random.split(jax.random.key(6), 5)
        params = [
            {"w": jax.random.normal(k[0], (4, 5), jnp.float64), "b": jax.random.normal(k[1], (5,), jnp.float64)},
            {"w": jax.random.normal(k[2], (5, 3), jnp.float64), "b": jax.random.normal(k[3], (3,), jnp.float64)},
            {"w": jax.random.normal(k[4], (3, 2), jnp.float64)},
        ]
        return _plain_nested_fn, params, jax.random.normal(jax.random.key(3), (5, 4), jnp.float64)
    if name == "plain_seq":
        k = jax.random.split(jax.random.key(5), 3)
        params = {
            "w1": jax.random.normal(k[0], (3, 4), jnp.float64),
            "b1": jax.random.normal(k[1], (4,), jnp.float64),
            "w2": jax.random.normal(k[2], (4, 2), jnp.float64),
        }
        return _plain_seq_fn, params, jax.random.normal(jax.random.key(4), (5, 6, 3), jnp.float64)
    raise KeyError(name)


# ----------------------------------------------------------------------------- small hand-built networks


def _mlp_params(key, sizes=(3, 4, 3, 2)):
    ks = jax.random.split(key, 2 * len(sizes))
    p = {}
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        p[f"w{i}"] = jax.random.normal(ks[2 * i], (a, b), jnp.float64)
        p[f"b{i}"] = 0.3 * jax.random.normal(ks[2 * i + 1], (b,), jnp.float64)
    return p


def mlp_fn(p, x):
    h = jax.nn.relu(x @ p["w0"] + p["b0"])
    h = jax.nn.relu(h @ p["w1"] + p["b1"])
    return h @ p["w2"] + p["b2"]


def _stat(z, moment):
    return jnp.mean(z * z, axis=0) if moment == "second" else jnp.var(z, axis=0)


def mlp_gamma_net(p, x, alpha, moment):
    """Neyshabur et al. (ICLR 2016), eq. (4)-(5), written out for `mlp_fn`."""
    g = jnp.ones(x.shape[1])
    h = x
    for i in range(3):
        z = h @ p[f"w{i}"] + p[f"b{i}"]
        g = alpha * _stat(z, moment) + (1 - alpha) * (g @ p[f"w{i}"] ** 2 + p[f"b{i}"] ** 2)
        h = jax.nn.relu(z)
    return jnp.sum(g)


def res_fn(p, x):
    """A residual MLP: the skip adds h to the second layer's output."""
    h = jax.nn.relu(x @ p["w0"] + p["b0"])
    r = jax.nn.relu(h @ p["w1"] + p["b1"])
    s = h + r @ p["w2"] + p["b2"]
    return jax.nn.relu(s) @ p["w3"] + p["b3"]


def res_gamma_net(p, x, alpha, moment):
    z0 = x @ p["w0"] + p["b0"]
    g0 = alpha * _stat(z0, moment) + (1 - alpha) * (jnp.ones(x.shape[1]) @ p["w0"] ** 2 + p["b0"] ** 2)
    h = jax.nn.relu(z0)
    z1 = h @ p["w1"] + p["b1"]
    g1 = alpha * _stat(z1, moment) + (1 - alpha) * (g0 @ p["w1"] ** 2 + p["b1"] ** 2)
    s = h + jax.nn.relu(z1) @ p["w2"] + p["b2"]
    gs = alpha * _stat(s, moment) + (1 - alpha) * (g0 + g1 @ p["w2"] ** 2 + p["b2"] ** 2)
    z3 = jax.nn.relu(s) @ p["w3"] + p["b3"]
    g3 = alpha * _stat(z3, moment) + (1 - alpha) * (gs @ p["w3"] ** 2 + p["b3"] ** 2)
    return jnp.sum(g3)


def _res_params(key):
    ks = jax.random.split(key, 8)
    shapes = [(3, 4), (4, 5), (5, 4), (4, 2)]
    p = {}
    for i, s in enumerate(shapes):
        p[f"w{i}"] = jax.random.normal(ks[2 * i], s, jnp.float64)
        p[f"b{i}"] = 0.3 * jax.random.normal(ks[2 * i + 1], (s[1],), jnp.float64)
    return p


_DN = ("NHWC", "HWIO", "NHWC")


def cnn_fn(p, x):
    """conv(3x3, SAME) - relu - conv(2x2, VALID) - relu - flatten - dense, shared kernels."""
    h = jax.lax.conv_general_dilated(x, p["k0"], (1, 1), "SAME", dimension_numbers=_DN) + p["c0"]
    h = jax.nn.relu(h)
    h = jax.lax.conv_general_dilated(h, p["k1"], (1, 1), "VALID", dimension_numbers=_DN) + p["c1"]
    h = jax.nn.relu(h)
    return h.reshape(h.shape[0], -1) @ p["w"] + p["b"]


def cnn_gamma_net(p, x, alpha, moment):
    """The recursion on the unrolled conv net: one node per channel and position, S over the batch."""

    def conv(a, k, pad):
        return jax.lax.conv_general_dilated(a, k, (1, 1), pad, dimension_numbers=_DN)

    z0 = conv(x, p["k0"], "SAME") + p["c0"]
    g0 = alpha * _stat(z0, moment) + (1 - alpha) * (conv(jnp.ones_like(x[:1]), p["k0"] ** 2, "SAME")[0] + p["c0"] ** 2)
    z1 = conv(jax.nn.relu(z0), p["k1"], "VALID") + p["c1"]
    g1 = alpha * _stat(z1, moment) + (1 - alpha) * (conv(g0[None], p["k1"] ** 2, "VALID")[0] + p["c1"] ** 2)
    z2 = jax.nn.relu(z1).reshape(x.shape[0], -1) @ p["w"] + p["b"]
    g2 = alpha * _stat(z2, moment) + (1 - alpha) * (g1.reshape(-1) @ p["w"] ** 2 + p["b"] ** 2)
    return jnp.sum(g2)


def _cnn_params(key):
    ks = jax.random.split(key, 6)
    return {
        "k0": 0.7 * jax.random.normal(ks[0], (3, 3, 2, 3), jnp.float64),
        "c0": 0.2 * jax.random.normal(ks[1], (3,), jnp.float64),
        "k1": 0.7 * jax.random.normal(ks[2], (2, 2, 3, 2), jnp.float64),
        "c1": 0.2 * jax.random.normal(ks[3], (2,), jnp.float64),
        "w": 0.5 * jax.random.normal(ks[4], (3 * 3 * 2, 2), jnp.float64),
        "b": 0.2 * jax.random.normal(ks[5], (2,), jnp.float64),
    }


def block_fn(p, x):
    """``h + relu(Dense(h))``: the block's kernel is an edge from a node group to itself, used once per path."""
    h = jax.nn.relu(x @ p["w0"] + p["b0"])
    s = h + jax.nn.relu(h @ p["w1"] + p["b1"])
    return s @ p["w2"] + p["b2"]


def block_gamma_net(p, x, alpha, moment):
    z0 = x @ p["w0"] + p["b0"]
    g0 = alpha * _stat(z0, moment) + (1 - alpha) * (jnp.ones(x.shape[1]) @ p["w0"] ** 2 + p["b0"] ** 2)
    z1 = jax.nn.relu(z0) @ p["w1"] + p["b1"]
    g1 = alpha * _stat(z1, moment) + (1 - alpha) * (g0 @ p["w1"] ** 2 + p["b1"] ** 2)
    z2 = (jax.nn.relu(z0) + jax.nn.relu(z1)) @ p["w2"] + p["b2"]  # the sum h + relu(z1) is not a node
    g2 = alpha * _stat(z2, moment) + (1 - alpha) * ((g0 + g1) @ p["w2"] ** 2 + p["b2"] ** 2)
    return jnp.sum(g2)


def _block_params(key):
    ks = jax.random.split(key, 6)
    shapes = [(3, 4), (4, 4), (4, 2)]
    p = {}
    for i, s in enumerate(shapes):
        p[f"w{i}"] = 0.6 * jax.random.normal(ks[2 * i], s, jnp.float64) - 0.1
        p[f"b{i}"] = 0.2 * jax.random.normal(ks[2 * i + 1], s[1:], jnp.float64)
    return p


def _layer_norm(z):
    return (z - jnp.mean(z, axis=-1, keepdims=True)) * jax.lax.rsqrt(jnp.var(z, axis=-1, keepdims=True) + 1e-6)


def ln_fn(p, x):
    """A LayerNorm after the second layer and a tanh head: two node groups that are not homogeneous."""
    h = jax.nn.relu(x @ p["w0"] + p["b0"])
    y = _layer_norm(h @ p["w1"] + p["b1"]) * p["s"] + p["beta"]
    h2 = jax.nn.relu(y @ p["w2"] + p["b2"])
    return jnp.tanh(h2 @ p["w3"] + p["b3"])


def ln_flax_fn(p, x):
    """`ln_fn` with the scale multiplied into rsqrt(var + eps) before the centred value, as Flax's LayerNorm does:
    the same function, the same recursion (the trace reassociates the product)."""
    h = jax.nn.relu(x @ p["w0"] + p["b0"])
    z = h @ p["w1"] + p["b1"]
    inv = jax.lax.rsqrt(jnp.var(z, axis=-1, keepdims=True) + 1e-6)
    y = (z - jnp.mean(z, axis=-1, keepdims=True)) * (inv * p["s"]) + p["beta"]
    h2 = jax.nn.relu(y @ p["w2"] + p["b2"])
    return jnp.tanh(h2 @ p["w3"] + p["b3"])


def ln_gamma_net(p, x, alpha, moment):
    """Pinned groups as boundaries: the paths of the homogeneous part end at the LayerNorm's input and at tanh's
    input, whose γ_v² count in γ²_net; downstream, the normalised value is an input (γ² = 1, its value held
    fixed), and the LayerNorm's scale an edge from it into hidden units of their own (its offset their bias)."""
    sg = jax.lax.stop_gradient
    z0 = x @ p["w0"] + p["b0"]
    g0 = alpha * _stat(z0, moment) + (1 - alpha) * (jnp.ones(x.shape[1]) @ p["w0"] ** 2 + p["b0"] ** 2)
    z1 = jax.nn.relu(z0) @ p["w1"] + p["b1"]
    g1 = alpha * _stat(z1, moment) + (1 - alpha) * (g0 @ p["w1"] ** 2 + p["b1"] ** 2)
    y = sg(_layer_norm(z1)) * p["s"] + p["beta"]
    gy = alpha * _stat(y, moment) + (1 - alpha) * (p["s"] ** 2 + p["beta"] ** 2)
    z2 = y @ p["w2"] + p["b2"]
    g2 = alpha * _stat(z2, moment) + (1 - alpha) * (gy @ p["w2"] ** 2 + p["b2"] ** 2)
    z3 = jax.nn.relu(z2) @ p["w3"] + p["b3"]
    g3 = alpha * _stat(z3, moment) + (1 - alpha) * (g2 @ p["w3"] ** 2 + p["b3"] ** 2)
    return jnp.sum(g1) + jnp.sum(g3)


def _ln_params(key):
    ks = jax.random.split(key, 10)
    p = {}
    for i, s in enumerate([(3, 4), (4, 4), (4, 3), (3, 2)]):
        p[f"w{i}"] = 0.6 * jax.random.normal(ks[2 * i], s, jnp.float64) - 0.1
        p[f"b{i}"] = 0.2 * jax.random.normal(ks[2 * i + 1], s[1:], jnp.float64)
    p["s"] = 1.0 + 0.3 * jax.random.normal(ks[8], (4,), jnp.float64)
    p["beta"] = 0.2 * jax.random.normal(ks[9], (4,), jnp.float64)
    return p


def attention_fn(p, x):
    """Single-head self-attention between a ReLU layer and a per-position readout: the weights come from pinned
    values (q and k), the values' units are hidden."""
    h = jax.nn.relu(x @ p["w0"] + p["b0"])  # x: [B, T, 3]
    q, k, v = h @ p["wq"], h @ p["wk"], h @ p["wv"] + p["bv"]
    a = jax.nn.softmax(jnp.einsum("btd,bsd->bts", q, k), axis=-1)
    return jax.nn.relu(jnp.einsum("bts,bsd->btd", a, v)) @ p["wo"] + p["bo"]


def attention_gamma_net(p, x, alpha, moment):
    """The recursion on the network unrolled over positions (S over the batch): q and k are pinned nodes whose γ²
    count in γ²_net; the weights are boundary values, 1 in the recursion (every value position reaches every query)
    and held fixed in the statistics of the readout."""
    sg = jax.lax.stop_gradient
    z0 = x @ p["w0"] + p["b0"]
    g0 = alpha * _stat(z0, moment) + (1 - alpha) * (jnp.ones(3) @ p["w0"] ** 2 + p["b0"] ** 2)
    h = jax.nn.relu(z0)
    q, k, v = h @ p["wq"], h @ p["wk"], h @ p["wv"] + p["bv"]
    gq = alpha * _stat(q, moment) + (1 - alpha) * (g0 @ p["wq"] ** 2)
    gk = alpha * _stat(k, moment) + (1 - alpha) * (g0 @ p["wk"] ** 2)
    gv = alpha * _stat(v, moment) + (1 - alpha) * (g0 @ p["wv"] ** 2 + p["bv"] ** 2)
    a = sg(jax.nn.softmax(jnp.einsum("btd,bsd->bts", q, k), axis=-1))
    z = jax.nn.relu(jnp.einsum("bts,bsd->btd", a, v)) @ p["wo"] + p["bo"]
    gz = alpha * _stat(z, moment) + (1 - alpha) * (jnp.sum(gv, axis=0) @ p["wo"] ** 2 + p["bo"] ** 2)
    return jnp.sum(gq) + jnp.sum(gk) + jnp.sum(gz)


def gated_fn(p, x):
    """A sigmoid gate on a linear branch (SwiGLU's form with a sigmoid): the gate's input is a pinned node, the
    branch's units are hidden, gated."""
    h = jax.nn.relu(x @ p["w0"] + p["b0"])
    return (jax.nn.sigmoid(h @ p["wq"]) * (h @ p["wv"] + p["bv"])) @ p["wo"] + p["bo"]


def gated_gamma_net(p, x, alpha, moment):
    """The recursion written out for `gated_fn`: the gate's input is a pinned node (its γ² counts in γ²_net), the
    gate a boundary value, 1 in the recursion and held fixed in the statistics; the node of a branch unit is its
    gated value."""
    sg = jax.lax.stop_gradient
    z0 = x @ p["w0"] + p["b0"]
    g0 = alpha * _stat(z0, moment) + (1 - alpha) * (jnp.ones(3) @ p["w0"] ** 2 + p["b0"] ** 2)
    h = jax.nn.relu(z0)
    zq = h @ p["wq"]
    gq = alpha * _stat(zq, moment) + (1 - alpha) * (g0 @ p["wq"] ** 2)
    y = sg(jax.nn.sigmoid(zq)) * (h @ p["wv"] + p["bv"])
    gy = alpha * _stat(y, moment) + (1 - alpha) * (g0 @ p["wv"] ** 2 + p["bv"] ** 2)
    z = y @ p["wo"] + p["bo"]
    gz = alpha * _stat(z, moment) + (1 - alpha) * (gy @ p["wo"] ** 2 + p["bo"] ** 2)
    return jnp.sum(gq) + jnp.sum(gz)


def _projection_params(key, keys=True):
    """A ReLU layer's, query, key and value projections' and a readout's; without ``keys`` (the gate's kernel is
    the query's)."""
    shapes = {"w0": (3, 5), "b0": (5,), "wq": (5, 4), "wk": (5, 4), "wv": (5, 4), "bv": (4,), "wo": (4, 2), "bo": (2,)}
    shapes = {n: s for n, s in shapes.items() if keys or n != "wk"}
    ks = jax.random.split(key, len(shapes))
    return {n: 0.6 * jax.random.normal(k, s, jnp.float64) for k, (n, s) in zip(ks, shapes.items())}


_SENDERS, _RECEIVERS = np.array([0, 1, 2, 0]), np.array([1, 2, 0, 2])  # graph node 3 receives no message


def graph_fn(p, x):
    """A graph layer with max aggregation (``jax.ops.segment_max``, a scatter-max into −∞) and a self term; graph
    node 3 receives no message, so its pre-activation is −∞ (−∞ plus its self term) and its ReLU gives 0."""
    msg = x[:, _SENDERS] @ p["w_msg"]  # x: [batch, 4 graph nodes, 3]
    agg = jax.vmap(lambda m: jax.ops.segment_max(m, _RECEIVERS, num_segments=4))(msg)
    return jax.nn.relu(agg + x @ p["w_self"] + p["b"]).sum(1) @ p["w"]


def graph_gamma_net(p, x, alpha, moment):
    """The recursion written out for `graph_fn`: the messages are nodes, the max aggregation takes the largest γ²
    of the messages into a graph node (as max pooling does). Graph node 3 has no value (−∞ before its ReLU, 0
    after): it has no statistic, and its γ² is the squared sum of its self term alone."""
    reached = [0, 1, 2]
    msg = x[:, _SENDERS] @ p["w_msg"]
    g_msg = alpha * _stat(msg, moment) + (1 - alpha) * jnp.sum(p["w_msg"] ** 2, axis=0)
    agg = jnp.stack([jnp.max(msg[:, _RECEIVERS == v], axis=1) for v in reached], axis=1)
    g_agg = jnp.stack([jnp.max(g_msg[_RECEIVERS == v], axis=0) for v in reached])
    g_self = jnp.sum(p["w_self"] ** 2, axis=0) + p["b"] ** 2
    z = agg + x[:, reached] @ p["w_self"] + p["b"]
    g_z = alpha * _stat(z, moment) + (1 - alpha) * (g_agg + g_self)
    g_dead = (1 - alpha) * g_self
    out = jax.nn.relu(z).sum(1) @ p["w"]
    g_out = alpha * _stat(out, moment) + (1 - alpha) * ((g_z.sum(0) + g_dead) @ p["w"] ** 2)
    return jnp.sum(g_out)


def _graph_params(key):
    ks = jax.random.split(key, 4)
    shapes = {"w_msg": (3, 5), "w_self": (3, 5), "b": (5,), "w": (5, 2)}
    return {k: 0.6 * jax.random.normal(kk, s, jnp.float64) for kk, (k, s) in zip(ks, shapes.items())}


CASES = {
    "mlp": (mlp_fn, mlp_gamma_net, lambda: _mlp_params(jax.random.key(0)), (6, 3)),
    "residual": (res_fn, res_gamma_net, lambda: _res_params(jax.random.key(1)), (6, 3)),
    "residual_block": (block_fn, block_gamma_net, lambda: _block_params(jax.random.key(3)), (6, 3)),
    "cnn": (cnn_fn, cnn_gamma_net, lambda: _cnn_params(jax.random.key(2)), (4, 4, 4, 2)),
    "layer_norm_tanh": (ln_fn, ln_gamma_net, lambda: _ln_params(jax.random.key(4)), (6, 3)),
    "layer_norm_flax_order": (ln_flax_fn, ln_gamma_net, lambda: _ln_params(jax.random.key(4)), (6, 3)),
    "graph_empty_segment": (graph_fn, graph_gamma_net, lambda: _graph_params(jax.random.key(5)), (6, 4, 3)),
    "attention": (attention_fn, attention_gamma_net, lambda: _projection_params(jax.random.key(6)), (6, 3, 3)),
    "gated": (gated_fn, gated_gamma_net, lambda: _projection_params(jax.random.key(7), keys=False), (6, 3)),
}


def _case(name):
    fn, gnet, mk, xshape = CASES[name]
    params = mk()
    x = jax.random.normal(jax.random.key(7), xshape, jnp.float64)
    return fn, gnet, params, x, pj.trace(fn, params, x)


def _hessian_diag(f, params):
    flat, unravel = ravel_pytree(params)
    h = jax.jit(jax.hessian(lambda v: f(unravel(v))))(flat)
    return unravel(0.5 * jnp.diag(h))


def _fishers(fn, params, x, moments):
    """mean_i Σ_out (∂f_out(x_i)/∂w)² (centred over i for the variance), per-example Jacobians: one tree per
    moment."""
    jac = jax.jit(jax.vmap(lambda xi: jax.jacrev(lambda p: fn(p, xi[None])[0])(params)))(x)
    nout = np.ndim(fn(params, x[:1])[0])

    def reduce(j, moment):  # (n, outs..., *leaf)
        j = j.reshape(j.shape[0], -1, *j.shape[j.ndim - (j.ndim - 1 - nout) :])
        if moment == "variance":
            j = j - j.mean(axis=0, keepdims=True)
        return jnp.mean(jnp.sum(j * j, axis=1), axis=0)

    return [jax.tree_util.tree_map(lambda j, m=m: reduce(j, m), jac) for m in moments]


def _fisher(fn, params, x, moment):
    return _fishers(fn, params, x, (moment,))[0]


# ----------------------------------------------------------------------------- κ against its definitions


@pytest.mark.parametrize("name", list(CASES))
def test_kappa_is_half_hessian_diagonal_of_the_recursion(name):
    """At α = 0, 0.3 and 1 (second moment) and 0.6 (variance): the Hessian of the written-out recursion is compiled
    once per moment, α an argument."""
    fn, gnet, params, x, space = _case(name)
    flat, unravel = ravel_pytree(params)
    for moment, alphas in (("second", (0.0, 0.3, 1.0)), ("variance", (0.6,))):
        hessian = jax.jit(jax.hessian(lambda v, a, moment=moment: gnet(unravel(v), x, a, moment)))
        for alpha in alphas:
            expected = unravel(0.5 * jnp.diag(hessian(flat, alpha)))
            got = pj.ddp_kappa(space, params, x, alpha=alpha, moment=moment)
            chex.assert_trees_all_close(got, expected, rtol=1e-10, atol=1e-12)
            # not vacuous: every kernel has a positive κ (a bias can have κ = 0: at α = 1 the variance
            # does not see the output bias, and the check above agrees)
            assert all(float(jnp.max(v)) > 0 for v in jax.tree_util.tree_leaves(got) if v.ndim > 1), alpha


_BOTH = ("second", "variance")


@pytest.mark.parametrize(
    "name,moments",
    [("linen_cnn", _BOTH), ("linen_res_cnn", ("second",)), ("nnx_mlp", ("second",)), ("plain_nested", ("variance",)),
     ("plain_seq", ("second",)), ("linen_rnn", _BOTH), ("linen_separable", ("second",)), ("plain_graph", _BOTH),
     ("linen_local", _BOTH), ("plain_graph_max", _BOTH), ("layer_scale", _BOTH), ("prelu", ("second",)),
     ("shared_head", _BOTH), ("positionwise", ("second",))],
)  # fmt: skip
def test_alpha_one_is_the_fisher_diagonal_on_flax_models(name, moments):
    fn, params, x = _flax_model(name)
    space = pj.trace(fn, params, x)
    for moment, expected in zip(moments, _fishers(fn, params, x, moments), strict=True):
        got = pj.ddp_kappa(space, params, x, alpha=1.0, moment=moment)
        chex.assert_trees_all_close(got, expected, rtol=1e-10, atol=1e-12)


_BOUNDARIES = ("layer_norm_tanh", "layer_norm_flax_order", "attention", "gated")


@pytest.mark.parametrize("name", [n for n in CASES if n not in _BOUNDARIES])  # boundaries: not f's Fisher
def test_alpha_one_is_the_fisher_diagonal_hand_models(name):
    fn, _, params, x, space = _case(name)
    got = pj.ddp_kappa(space, params, x, alpha=1.0)
    chex.assert_trees_all_close(got, _fisher(fn, params, x, "second"), rtol=1e-10, atol=1e-12)
    # the variance version is centred: it differs from the second moment (the outputs have a mean)
    var = pj.ddp_kappa(space, params, x, alpha=1.0, moment="variance")
    assert not np.allclose(ravel_pytree(var)[0], ravel_pytree(got)[0])


def _squared_network_kappa(fn, params, x):
    """Path-SGD's κ⁽¹⁾ = ∂/∂p̃ Σ outputs of the network with squared params on an all-ones input."""
    ones = jnp.ones((1, *x.shape[1:]), x.dtype)
    sq = jax.tree_util.tree_map(lambda a: a * a, params)
    return jax.grad(lambda q: jnp.sum(fn(q, ones)))(sq)


class MaxPoolCNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(3, (3, 3))(x))
        x = nn.max_pool(x, (2, 2), (2, 2))
        x = nn.relu(nn.Conv(2, (2, 2), padding="VALID")(x))
        return nn.Dense(2)(x.reshape(x.shape[0], -1))


@pytest.mark.parametrize("name", ["mlp", "residual", "cnn", "maxpool_cnn", "nnx_mlp", "plain_nested"])
def test_alpha_zero_is_path_sgd_kappa(name):
    if name == "maxpool_cnn":
        m = MaxPoolCNN()
        x = jax.random.normal(jax.random.key(3), (3, 6, 6, 2), jnp.float64)
        params = _perturb(jax.eval_shape(m.init, jax.random.key(4), x)["params"], scale=0.5)

        def fn(p, x):
            return m.apply({"params": p}, x)
    elif name in ("nnx_mlp", "plain_nested"):
        fn, params, x = _flax_model(name)
    else:
        fn, _, params, x, _ = _case(name)
    space = pj.trace(fn, params, x)
    expected = _squared_network_kappa(fn, params, x)
    got = pj.ddp_kappa(space, params, x, alpha=0.0)
    chex.assert_trees_all_close(got, expected, rtol=1e-10, atol=1e-12)
    chex.assert_trees_all_close(got, pj.path_kappa(space, params, second_order=False), rtol=1e-8, atol=1e-12)


def test_functions_with_one_graph_are_not_confused():
    """Two functions with the same reduction graph (here f and 3·f) get their own κ: the caches of the
    compiled program are keyed on the traced function, not on the graph alone."""
    fn, _, params, x, space = _case("mlp")
    tripled = pj.trace(lambda p, x: 3.0 * fn(p, x), params, x)
    assert tripled != space
    a = pj.ddp_kappa(space, params, x, alpha=0.0)
    b = pj.ddp_kappa(tripled, params, x, alpha=0.0)
    chex.assert_trees_all_close(b, jax.tree_util.tree_map(lambda k: 9.0 * k, a), rtol=1e-12)
    b = pj.ddp_kappa(tripled, params, x, alpha=1.0)
    a = pj.ddp_kappa(space, params, x, alpha=1.0)
    chex.assert_trees_all_close(b, jax.tree_util.tree_map(lambda k: 9.0 * k, a), rtol=1e-12)


def test_kappa_does_not_depend_on_the_data_at_alpha_zero():
    fn, _, params, x, space = _case("cnn")
    a = pj.ddp_kappa(space, params, x, alpha=0.0)
    b = pj.ddp_kappa(space, params, 3.0 * x[:2] + 1.0, alpha=0.0)
    chex.assert_trees_all_close(a, b, rtol=1e-12)


def _draws(draw, key, count):
    """``draw(k)`` for ``count`` keys split from ``key``, stacked: one compiled loop (a vmapped convolution's
    backward pass runs several times slower on XLA:CPU)."""
    return jax.jit(lambda ks: jax.lax.map(draw, ks))(jax.random.split(key, count))


@pytest.mark.parametrize(
    "name,alpha,moment,one_draw_max",
    [
        ("mlp", 0.5, "second", None),
        ("cnn", 1.0, "variance", None),
        ("cnn", 0.4, "second", None),
        ("mlp", 1.0, "second", 0),
    ],
)
@pytest.mark.slow
def test_probe_estimator_is_unbiased(name, alpha, moment, one_draw_max, monkeypatch, request):
    """One probe estimates κ without bias. The small probe nodes take their signs from one draw, large ones
    (over `pathspace_jax.ddp._ONE_DRAW_MAX` entries) apart; ``one_draw_max=0`` makes every node large (a wide
    LM's hidden nodes at batch 32: that case raised a ``ValueError`` once)."""
    from pathspace_jax import ddp

    if one_draw_max is not None:  # read when a program is traced: none traced under the patch outlives it
        monkeypatch.setattr(ddp, "_ONE_DRAW_MAX", one_draw_max)
        jax.clear_caches()
        request.addfinalizer(jax.clear_caches)
    fn, _, params, x, space = _case(name)
    exact = ravel_pytree(pj.ddp_kappa(space, params, x, alpha=alpha, moment=moment))[0]
    draws = _draws(
        lambda k: ravel_pytree(
            pj.ddp_kappa(
                space, params, x, alpha=alpha, moment=moment, estimator="probes", num_probes=1, probe_damping=0.0, key=k
            )
        )[0],
        jax.random.key(11),
        2000,
    )
    mean, std = draws.mean(0), draws.std(0)
    # the mean of 2000 probes is within 5 standard errors of the exact value, entry by entry
    np.testing.assert_array_less(np.abs(mean - exact), 5 * std / np.sqrt(2000) + 1e-12)
    # a single probe is noisy (so the check above is not vacuous) and its variance is bounded:
    # Var[(Σ r a)²] = 2 (Σ a²)² − 2 Σ a⁴ ≤ 2·exact² for the second-order term
    assert float(jnp.max(std / jnp.maximum(exact, 1e-300))) > 0.05
    assert float(jnp.max(std / jnp.maximum(exact, 1e-300))) < np.sqrt(2) * 1.15
    # more probes average: num_probes=64 has about 1/8 of the spread
    kw = dict(alpha=alpha, moment=moment, estimator="probes", num_probes=64, probe_damping=0.0)
    many = _draws(lambda k: ravel_pytree(pj.ddp_kappa(space, params, x, key=k, **kw))[0], jax.random.key(12), 200)
    ratio = float(jnp.median(many.std(0) / jnp.maximum(std, 1e-300)))
    assert 0.08 < ratio < 0.18, ratio


@pytest.mark.parametrize("name", ["mlp", "cnn"])
@pytest.mark.parametrize("loop_max", [8, 0])  # on the CPU: straight-line probes (the default), and vmapped
def test_several_probes_average_single_probes(name, loop_max, monkeypatch):
    """num_probes=4 is the mean of the four one-probe estimates drawn with the keys split from ``key``, however
    the probes are batched (`pathspace_jax.ddp._PROBE_LOOP_MAX`)."""
    from pathspace_jax import ddp

    monkeypatch.setattr(ddp, "_PROBE_LOOP_MAX", loop_max)
    fn, _, params, x, space = _case(name)
    key = jax.random.key(5)
    kw = dict(alpha=1.0, estimator="probes", probe_damping=0.0)
    four = pj.ddp_kappa(space, params, x, num_probes=4, key=key, **kw)
    singles = [pj.ddp_kappa(space, params, x, num_probes=1, key=k, **kw) for k in jax.random.split(key, 4)]
    mean = jax.tree_util.tree_map(lambda *k: sum(k) / 4, *singles)
    chex.assert_trees_all_close(four, mean, rtol=1e-12)
    assert not np.allclose(ravel_pytree(singles[0])[0], ravel_pytree(singles[1])[0])  # the probes differ


@pytest.mark.parametrize(
    "name,alpha,moment,b", [("mlp", 1.0, "second", 2), ("cnn", 0.5, "variance", 2), ("mlp", 0.4, "variance", 3)]
)
def test_probes_on_a_random_subset_of_the_batch_are_unbiased(name, alpha, moment, b):
    """probe_batch_size=b: the probes run on b examples drawn without replacement; κ stays unbiased (with the
    finite-population factor (n − 1)/(n (b − 1)) for the variance) and is noisier than on the whole batch.
    (Without the factor, or with the first b examples instead of a random subset, the mean check fails.)"""
    fn, _, params, x, space = _case(name)
    n = x.shape[0]
    assert b < n
    exact = ravel_pytree(pj.ddp_kappa(space, params, x, alpha=alpha, moment=moment))[0]

    def draw(size):
        def one(k):
            kappa = pj.ddp_kappa(space, params, x, alpha=alpha, moment=moment, estimator="probes",
                                 probe_damping=0.0, probe_batch_size=size, key=k)  # fmt: skip
            return ravel_pytree(kappa)[0]

        return one

    sub, full = _draws(draw(b), jax.random.key(21), 2000), _draws(draw(None), jax.random.key(22), 1000)
    mean, std = sub.mean(0), sub.std(0)
    np.testing.assert_array_less(np.abs(mean - exact), 5 * std / np.sqrt(len(sub)) + 1e-12)
    # the subset adds the sampling of the examples to the probes' noise
    noisy = full.std(0) > 0  # the (1 − α) term is exact
    assert float(jnp.median(std[noisy] / full.std(0)[noisy])) > 1.1
    # a size of at least the batch is the whole batch: the same κ as the default, bit for bit
    k = jax.random.key(3)
    kw = dict(alpha=alpha, moment=moment, estimator="probes", key=k)
    chex.assert_trees_all_equal(
        pj.ddp_kappa(space, params, x, probe_batch_size=n, **kw), pj.ddp_kappa(space, params, x, **kw)
    )
    # DDP-SGD's step with a subset stays rescaling invariant (the subset depends on the key alone)
    tx = pj.ddp_sgd(space, 0.05, alpha=alpha, moment=moment, probe_batch_size=b)

    def step(p):
        g = jax.grad(lambda q: jnp.sum(fn(q, x) ** 2))(p)
        updates, _ = tx.update(g, tx.init(p), p, inputs=x, key=k)
        return optax.apply_updates(p, updates)

    _assert_update_invariant(jax.jit(step), space, params, jax.random.key(5), num_draws=1)


def test_probe_batch_size_is_checked():
    fn, _, params, x, space = _case("mlp")
    k = jax.random.key(0)
    with pytest.raises(ValueError, match="estimator='probes' only"):
        pj.ddp_kappa(space, params, x, alpha=1.0, estimator="exact", probe_batch_size=2)
    with pytest.raises(ValueError, match="two examples"):
        pj.ddp_sgd(space, 0.1, alpha=1.0, moment="variance", probe_batch_size=1)
    p, xr, rnn_space = _rnn_case()
    with pytest.raises(ValueError, match="recurrence"):
        pj.ddp_kappa(rnn_space, p, xr, alpha=0.5, estimator="probes", probe_batch_size=2, key=k)
    # at α = 1 a recurrence is fine: the estimate is the per-example Fisher of a random subset
    kappa = pj.ddp_kappa(rnn_space, p, xr, alpha=1.0, estimator="probes", probe_batch_size=2, key=k)
    assert all(bool(jnp.all(jnp.isfinite(v))) for v in jax.tree_util.tree_leaves(kappa))


# ----------------------------------------------------------------------------- invariance


def _ddp_step(space, alpha, moment, x, lr=0.05):
    tx = pj.ddp_sgd(space, lr, alpha=alpha, moment=moment, eps=0.0, estimator="exact")

    def step(params):
        g = jax.grad(lambda p: jnp.sum(space.fn(p, x) ** 2))(params)
        updates, _ = tx.update(g, tx.init(params), params, inputs=x)
        return optax.apply_updates(params, updates)

    return step


def _assert_update_invariant(step, space, params, key, num_draws=3):
    """step(T(w)) == T(step(w)) for power-of-two rescalings T (Neyshabur et al., ICLR 2016, §6.1)."""
    base = step(params)
    for k in jax.random.split(key, num_draws):
        alphas = pj.random_alphas(space, k, max_exponent=3)
        scaled = pj.rescale(space, params, alphas)
        assert not np.allclose(ravel_pytree(scaled)[0], ravel_pytree(params)[0])
        chex.assert_trees_all_close(step(scaled), pj.rescale(space, base, alphas), rtol=1e-9, atol=1e-12)


_STEPS = [(0.0, "second"), (0.5, "second"), (1.0, "second"), (0.7, "variance")]


# two of the four (α, moment) per model, in turn: each pair runs on half of the models (κ is checked against its
# definition at four (α, moment) on every model above; the step divides the gradient by it)
@pytest.mark.parametrize("name,alpha,moment", [(n, *_STEPS[(i + k) % 4]) for i, n in enumerate(CASES) for k in (0, 2)])
def test_update_is_rescaling_invariant(name, alpha, moment):
    fn, _, params, x, space = _case(name)
    step = jax.jit(_ddp_step(space, alpha, moment, x))
    _assert_update_invariant(step, space, params, jax.random.key(5))
    # and it is not plain SGD: the update differs from the gradient step
    sgd = optax.apply_updates(params, jax.tree_util.tree_map(lambda g: -0.05 * g, jax.grad(
        lambda p: jnp.sum(fn(p, x) ** 2))(params)))  # fmt: skip
    assert not np.allclose(ravel_pytree(step(params))[0], ravel_pytree(sgd)[0])


def test_sgd_is_not_rescaling_invariant():
    """The invariance check can fail: plain SGD does."""
    fn, _, params, x, space = _case("mlp")

    def step(p):
        g = jax.grad(lambda q: jnp.sum(fn(q, x) ** 2))(p)
        return jax.tree_util.tree_map(lambda a, b: a - 0.05 * b, p, g)

    with pytest.raises(AssertionError):
        _assert_update_invariant(step, space, params, jax.random.key(5))


# ----------------------------------------------------------------------------- optax contract


def _setup(dtype=jnp.float64):
    fn, _, params, x, space = _case("mlp")
    params = jax.tree_util.tree_map(lambda a: a.astype(dtype), params)
    x = x.astype(dtype)
    space = pj.trace(fn, params, x)
    grads = jax.grad(lambda p: jnp.sum(fn(p, x) ** 2))(params)
    return fn, params, x, space, grads


def test_errors_are_clear():
    fn, params, x, space, grads = _setup()
    tx = pj.scale_by_ddp(space, alpha=0.5)
    state = tx.init(params)
    with pytest.raises(TypeError, match="inputs=x"):
        tx.update(grads, state, params)
    with pytest.raises(ValueError, match="needs params"):
        tx.update(grads, state, None, inputs=x)
    with pytest.raises(ValueError, match="PRNG key"):
        pj.ddp_kappa(space, params, x, alpha=0.5, estimator="probes")
    with pytest.raises(ValueError, match="alpha"):
        pj.ddp_kappa(space, params, x, alpha=1.5)
    with pytest.raises(ValueError, match="w0"):
        pj.ddp_kappa(space, {**params, "w0": params["w0"][:2]}, x, alpha=0.5)
    # unknown extra arguments are ignored, inside optax.chain too
    chained = optax.chain(pj.scale_by_ddp(space, alpha=0.5), optax.scale(-0.1))
    u, _ = chained.update(grads, chained.init(params), params, inputs=x, labels=jnp.zeros(3), foo=1)
    assert jax.tree_util.tree_structure(u) == jax.tree_util.tree_structure(params)


def _rnn_fn(p, x, act=jax.nn.relu, cut=False):
    """A one-layer RNN (lax.scan) read out at the last step; ``cut`` holds h_{t-1} and h_T fixed and returns
    every pre-activation too (the boundary nodes of a tanh RNN)."""
    sg = jax.lax.stop_gradient if cut else (lambda v: v)

    def step(h, xt):
        z = xt @ p["wi"] + sg(h) @ p["wh"] + p["b"]
        return act(z), z

    h, zs = jax.lax.scan(step, jnp.zeros((x.shape[0], 4), x.dtype), x.swapaxes(0, 1))
    y = sg(h) @ p["wo"] + p["bo"]
    return jnp.concatenate([zs.swapaxes(0, 1).reshape(x.shape[0], -1), y], axis=1) if cut else y


def _rnn_gamma_gn(q, p, x, alpha, moment):
    """γ²_net of the ReLU `_rnn_fn` written out step by step (γ² of the zero initial state is 0), with the node
    statistics S taken on the pre-activations linearised in the weights at p (the Gauss–Newton recursion)."""

    def pre_activations(r):
        def step(h, xt):
            z = xt @ r["wi"] + h @ r["wh"] + r["b"]
            return jax.nn.relu(z), z

        h, zs = jax.lax.scan(step, jnp.zeros((x.shape[0], 4), x.dtype), x.swapaxes(0, 1))
        return zs, h @ r["wo"] + r["bo"]

    dq = jax.tree_util.tree_map(jnp.subtract, q, p)
    (zs, y), (dzs, dy) = jax.jvp(pre_activations, (p,), (dq,))
    s = (lambda z: jnp.mean(z * z, 0)) if moment == "second" else (lambda z: jnp.var(z, 0))
    g = jnp.zeros(4, x.dtype)
    for t in range(x.shape[1]):
        g = alpha * s(zs[t] + dzs[t]) + (1 - alpha) * (jnp.sum(q["wi"] ** 2, 0) + g @ q["wh"] ** 2 + q["b"] ** 2)
    return jnp.sum(alpha * s(y + dy) + (1 - alpha) * (g @ q["wo"] ** 2 + q["bo"] ** 2))


def _rnn_case():
    ks = jax.random.split(jax.random.key(0), 5)
    shapes = {"wi": (3, 4), "wh": (4, 4), "b": (4,), "wo": (4, 2), "bo": (2,)}
    p = {n: 0.6 * jax.random.normal(k, s, jnp.float64) for k, (n, s) in zip(ks, shapes.items(), strict=True)}
    x = jax.random.normal(jax.random.key(5), (6, 5, 3), jnp.float64)
    return p, x, pj.trace(_rnn_fn, p, x)


@pytest.mark.parametrize("unrolled", [False, True])
def test_recurrent_networks_at_every_alpha(unrolled, monkeypatch):
    """Recurrences: α = 1 is the diagonal Fisher (of the outputs, and of the boundary nodes of a pinned
    recurrent group: every pre-activation of a tanh RNN, h_{t-1} held fixed), α = 0 is Path-SGD's κ with
    its κ⁽²⁾, and 0 < α < 1 is ½ diag ∇² of the Gauss–Newton recursion (jax.hessian of it written out by
    hand), continuous at both ends; with DDP's scans rolled (the CPU's default) and, for the α that run them
    (the per-example scans at α > 0, the γ² recursion at α < 1), unrolled (other backends')."""
    from pathspace_jax import forward

    monkeypatch.setattr(forward, "unrolled", lambda: unrolled)
    jax.clear_caches()  # traces cached under the other setting would hide it
    p, x, relu_space = _rnn_case()
    assert any(leaf.recurrent for leaf in relu_space.leaves)
    chex.assert_trees_all_close(pj.ddp_kappa(relu_space, p, x, alpha=1.0), _fisher(_rnn_fn, p, x, "second"),
                                rtol=1e-10, atol=1e-12)  # fmt: skip
    for alpha, moment in [(0.5, "second"), (0.3, "variance")][: 1 if unrolled else 2]:
        expected = _hessian_diag(lambda q, a=alpha, m=moment: _rnn_gamma_gn(q, p, x, a, m), p)
        assert min(float(jnp.min(e)) for e in jax.tree_util.tree_leaves(expected)) > 0  # the clamp at 0 is idle
        got = pj.ddp_kappa(relu_space, p, x, alpha=alpha, moment=moment)
        chex.assert_trees_all_close(got, expected, rtol=1e-10, atol=1e-12)
    if unrolled:
        return
    chex.assert_trees_all_close(pj.ddp_kappa(relu_space, p, x, alpha=0.0), pj.path_kappa(relu_space, p), rtol=1e-12)
    for near, end in [(1e-9, 0.0), (1 - 1e-9, 1.0)]:
        chex.assert_trees_all_close(pj.ddp_kappa(relu_space, p, x, alpha=near),
                                    pj.ddp_kappa(relu_space, p, x, alpha=end), rtol=1e-7, atol=1e-7)  # fmt: skip

    def tanh_fn(q, x):
        return _rnn_fn(q, x, jnp.tanh)

    tanh_space = pj.trace(tanh_fn, p, x)
    boundary = _fisher(functools.partial(_rnn_fn, act=jnp.tanh, cut=True), p, x, "variance")
    got = pj.ddp_kappa(tanh_space, p, x, alpha=1.0, moment="variance")
    chex.assert_trees_all_close(got, boundary, rtol=1e-10, atol=1e-12)


@pytest.mark.slow
def test_recurrent_probes_are_unbiased_and_the_step_invariant():
    p, x, space = _rnn_case()
    exact = ravel_pytree(pj.ddp_kappa(space, p, x, alpha=0.5))[0]

    def draw(k):
        kappa = pj.ddp_kappa(space, p, x, alpha=0.5, estimator="probes", probe_damping=0.0, key=k)
        return ravel_pytree(kappa)[0]

    draws = jax.jit(jax.vmap(draw))(jax.random.split(jax.random.key(11), 2000))
    mean, std = draws.mean(0), draws.std(0)
    np.testing.assert_array_less(np.abs(mean - exact), 5 * std / np.sqrt(2000) + 1e-12)
    assert float(jnp.max(std / exact)) > 0.05  # not vacuous
    for name in ["linen_rnn"]:  # a Flax RNN: DDP-SGD's step at α = 0.5 is rescaling-invariant
        fn, params, xf = _flax_model(name)
        flax_space = pj.trace(fn, params, xf)
        _assert_update_invariant(jax.jit(_ddp_step(flax_space, 0.5, "second", xf)), flax_space, params,
                                 jax.random.key(5))  # fmt: skip


def test_unsupported_models_raise():
    def nested(p, x):  # a scan inside a scan body
        def outer(h, xt):
            h2, _ = jax.lax.scan(
                lambda c, _: (jax.nn.relu(c @ p["wh"] + p["b"]), None), h + xt @ p["wi"], None, length=2
            )
            return h2, None

        h, _ = jax.lax.scan(outer, jnp.zeros((x.shape[0], 4), x.dtype), x.swapaxes(0, 1))
        return h @ p["wo"] + p["bo"]

    p, x, _ = _rnn_case()
    space = pj.trace(nested, p, x)
    with pytest.raises(pj.DDPUnsupportedError, match="nested scan"):
        pj.ddp_kappa(space, p, x, alpha=0.5)

    # a branch or a loop of run-time length: the paths depend on the data; both κ say so, and what to write instead
    q = {"a": p["wi"], "u": p["wh"], "o": p["wo"]}
    xs = x[:, 0]

    def branch(q, x):
        h = jax.nn.relu(x @ q["a"])
        return jax.lax.cond(jnp.sum(x) > 0, lambda h: jax.nn.relu(h @ q["u"]), lambda h: 2 * h, h) @ q["o"]

    def loop(q, x):
        h = jax.nn.relu(x @ q["a"])
        return jax.lax.fori_loop(0, jnp.sum(x > 0), lambda i, h: jax.nn.relu(h @ q["u"]), h) @ q["o"]

    for fn, match in ((branch, r"cond at .*test_ddp.py.*in Python"), (loop, r"while at .*test_ddp.py.*lax.scan")):
        space = pj.trace(fn, q, xs)
        with pytest.raises(pj.DDPUnsupportedError, match=match):
            pj.ddp_kappa(space, q, xs, alpha=0.5)
        with pytest.raises(pj.PathKappaUnsupportedError, match=match):
            pj.path_kappa(space, q)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_dtype_preserved_and_no_recompilation(dtype):
    fn, params, x, space, grads = _setup(dtype)
    tx = pj.ddp_sgd(space, 0.1, alpha=0.5, estimator="probes", momentum=0.9)
    state = tx.init(params)
    traces = []

    @jax.jit
    def step(params, state, x):
        traces.append(1)
        g = jax.grad(lambda p: jnp.sum(fn(p, x) ** 2))(params)
        u, state = tx.update(g, state, params, inputs=x)
        return optax.apply_updates(params, u), state, u

    for _ in range(3):
        params, state, u = step(params, state, x)
    assert len(traces) == 1
    for a in jax.tree_util.tree_leaves(u):
        assert a.dtype == dtype
        assert bool(jnp.all(jnp.isfinite(a)))


def _state_kappa(space, st):
    """κ of the params from a DDP state (which keeps κ in the canonical frame)."""
    kept = st.kept.unpack()
    leaves = kappa_from_frame(space, jax.tree_util.tree_leaves(kept.kappa), kept.log2_gauge)
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(kept.kappa), leaves)


@pytest.mark.slow
def test_every_k_reuses_kappa():
    fn, params, x, space, grads = _setup()
    tx = pj.scale_by_ddp(space, alpha=0.5, every=3, normalize=False, floor=0.0, estimator="exact")
    state = tx.init(params)
    upd = jax.jit(lambda g, s, p, x: tx.update(g, s, p, inputs=x))
    k0 = pj.ddp_kappa(space, params, x, alpha=0.5)
    _, state = upd(grads, state, params, x)
    chex.assert_trees_all_close(_state_kappa(space, state), k0)
    other = jax.tree_util.tree_map(lambda a: 1.5 * a, params)
    _, state = upd(grads, state, other, x)  # step 1: κ kept
    chex.assert_trees_all_close(_state_kappa(space, state), k0)
    _, state = upd(grads, state, other, x)  # step 2: κ kept
    u, state = upd(grads, state, other, x)  # step 3: recomputed at the new params
    k3 = pj.ddp_kappa(space, other, x, alpha=0.5)
    chex.assert_trees_all_close(_state_kappa(space, state), k3)
    chex.assert_trees_all_close(u, jax.tree_util.tree_map(lambda g, k: jnp.where(k > 0, g / k, 0), grads, k3))


@pytest.mark.slow
def test_a_boolean_mask_is_a_constant_of_the_network():
    """A padding mask passed as booleans and applied with jnp.where: Path-SGD's κ is that of every position valid
    (½ diag ∇²γ² with the mask all True), DDP's κ at α = 1 the masked batch's Fisher diagonal, and both steps
    commute with rescaling."""

    def fn(p, x, mask):  # x: [B, T, 3], mask: [B, T]
        h = jax.nn.relu(x @ p["w1"] + p["b1"])
        return jnp.where(mask[..., None], h, 0.0).sum(1) @ p["w2"]

    k = jax.random.split(jax.random.key(8), 4)
    params = {"w1": jax.random.normal(k[0], (3, 5), jnp.float64), "b1": jax.random.normal(k[1], (5,), jnp.float64),
              "w2": jax.random.normal(k[2], (5, 2), jnp.float64)}  # fmt: skip
    x = jax.random.normal(k[3], (6, 4, 3), jnp.float64)
    mask = jnp.arange(4)[None] < jnp.array([4, 1, 3, 2, 4, 2])[:, None]
    space = pj.trace(fn, params, x, mask)
    assert space.num_hidden == 5
    squared = lambda p: jax.tree_util.tree_map(lambda a: a * a, p)  # noqa: E731
    gamma2 = lambda p: jnp.sum(fn(squared(p), jnp.ones((1, 4, 3)), jnp.ones((1, 4), bool)))  # noqa: E731
    chex.assert_trees_all_close(pj.path_kappa(space, params), _hessian_diag(gamma2, params), rtol=1e-10, atol=1e-12)
    jac = jax.vmap(lambda xi, mi: jax.jacrev(lambda p: fn(p, xi[None], mi[None])[0])(params))(x, mask)
    fisher = jax.tree_util.tree_map(lambda j: jnp.mean(jnp.sum(j * j, axis=1), axis=0), jac)
    chex.assert_trees_all_close(pj.ddp_kappa(space, params, (x, mask), alpha=1.0), fisher, rtol=1e-10, atol=1e-12)

    def by_product(p, x, mask):  # the mask cast to floats and multiplied in: still a constant, not an input
        return (jax.nn.relu(x @ p["w1"] + p["b1"]) * mask[..., None].astype(x.dtype)).sum(1) @ p["w2"]

    product = pj.trace(by_product, params, x, mask)
    chex.assert_trees_all_close(pj.path_kappa(product, params), pj.path_kappa(space, params), rtol=1e-12)
    chex.assert_trees_all_close(pj.ddp_kappa(product, params, (x, mask), alpha=1.0), fisher, rtol=1e-10, atol=1e-12)
    y, loss = jnp.zeros((6, 2)), lambda p, b: jnp.mean((fn(p, *b[0]) - b[1]) ** 2)
    for tx, kw in ((pj.path_sgd(space, 0.05), {}), (pj.ddp_sgd(space, 0.05, alpha=0.5), {"inputs": (x, mask)})):
        pj.testing.assert_update_invariant(tx, loss, space, params, ((x, mask), y), inputs=(x, mask),
                                           update_kwargs=kw, rtol=1e-9, atol=1e-12)  # fmt: skip


def test_integer_features_cast_to_float_are_an_input():
    """Pixels passed as uint8 and cast to float in the model (``x.astype(f) / 255``) are the input's values, not
    token ids: Path-SGD's κ is ½ diag ∇²γ² on the all-ones input (the fixed coefficient 1/255 on every path,
    squared), DDP's at α = 1 the Fisher diagonal of the pixels, and DDP's at α = ½ that of the same network given
    the pixels as floats. Both raised before ("multiplies two parameters": the cast pixels were read as ids)."""

    def fn(p, x):  # x: uint8 [B, 4]
        h = jax.nn.relu(x.astype(jnp.float64) / 255.0 @ p["w1"] + p["b1"])
        return h @ p["w2"]

    k = jax.random.split(jax.random.key(9), 4)
    params = {"w1": jax.random.normal(k[0], (4, 5), jnp.float64), "b1": jax.random.normal(k[1], (5,), jnp.float64),
              "w2": jax.random.normal(k[2], (5, 2), jnp.float64)}  # fmt: skip
    x = jax.random.randint(k[3], (6, 4), 0, 256).astype(jnp.uint8)
    space = pj.trace(fn, params, x)
    assert space.num_hidden == 5

    def gamma2(p):  # the squared network on the all-ones input, the fixed coefficient 1/255 squared too
        q = jax.tree_util.tree_map(lambda a: a * a, p)
        return jnp.sum(jax.nn.relu(jnp.ones((1, 4)) / 255.0**2 @ q["w1"] + q["b1"]) @ q["w2"])

    chex.assert_trees_all_close(pj.path_kappa(space, params), _hessian_diag(gamma2, params), rtol=1e-10, atol=1e-12)
    jac = jax.vmap(lambda xi: jax.jacrev(lambda p: fn(p, xi[None])[0])(params))(x)
    fisher = jax.tree_util.tree_map(lambda j: jnp.mean(jnp.sum(j * j, axis=1), axis=0), jac)
    chex.assert_trees_all_close(pj.ddp_kappa(space, params, x, alpha=1.0), fisher, rtol=1e-10, atol=1e-12)
    as_float = lambda p, xf: jax.nn.relu(xf / 255.0 @ p["w1"] + p["b1"]) @ p["w2"]  # noqa: E731
    xf = x.astype(jnp.float64)
    chex.assert_trees_all_close(
        pj.ddp_kappa(space, params, x, alpha=0.5),
        pj.ddp_kappa(pj.trace(as_float, params, xf), params, xf, alpha=0.5),
        rtol=1e-12,
    )


def test_vmap_over_an_ensemble():
    fn, params, x, space, grads = _setup()
    ens = jax.tree_util.tree_map(lambda a: jnp.stack([a, 2.0 * a, -a]), params)
    ens_g = jax.vmap(lambda p: jax.grad(lambda q: jnp.sum(fn(q, x) ** 2))(p))(ens)
    tx = pj.scale_by_ddp(space, alpha=0.3)
    states = jax.vmap(tx.init)(ens)
    u, _ = jax.vmap(lambda g, s, p: tx.update(g, s, p, inputs=x))(ens_g, states, ens)
    for i in range(3):
        pi, gi, want = (jax.tree_util.tree_map(lambda a, i=i: a[i], t) for t in (ens, ens_g, u))
        ui, _ = tx.update(gi, tx.init(pi), pi, inputs=x)
        chex.assert_trees_all_close(want, ui, rtol=1e-10)


def test_dead_unit_gives_no_nan():
    fn, params, x, space, grads = _setup()
    # hidden unit 0 of the first layer never fires: zero incoming weights and a negative bias;
    # unit 1 is exactly zero everywhere (zero weights, zero bias, zero outgoing weights)
    params = dict(params)
    params["w0"] = params["w0"].at[:, 0].set(0.0).at[:, 1].set(0.0)
    params["b0"] = params["b0"].at[0].set(-1.0).at[1].set(0.0)
    params["w1"] = params["w1"].at[1, :].set(0.0)
    grads = jax.grad(lambda p: jnp.sum(fn(p, x) ** 2))(params)
    for alpha in [0.0, 0.5, 1.0]:
        for est in ["exact", "probes"]:
            tx = pj.scale_by_ddp(space, alpha=alpha, estimator=est)
            u, _ = jax.jit(lambda g, s, p, tx=tx: tx.update(g, s, p, inputs=x))(grads, tx.init(params), params)
            for a in jax.tree_util.tree_leaves(u):
                assert bool(jnp.all(jnp.isfinite(a)))
    k = pj.ddp_kappa(space, params, x, alpha=1.0)
    assert float(k["w0"][:, 0].max()) == 0.0  # no output depends on a weight into a dead unit


def _strided_conv_fn(p, x):  # x: [N, C, H, W]; strided convolutions in two layouts, uneven padding
    h = jax.lax.conv_general_dilated(x, p["k1"], (2, 1), ((1, 2), (0, 1)), dimension_numbers=("NCHW", "OIHW", "NCHW"))
    h = jax.nn.relu(h + p["b1"][None, :, None, None])
    h = jax.lax.conv_general_dilated(h, p["k2"], (1, 3), "VALID", dimension_numbers=("NCHW", "HWIO", "NHWC"))
    return jax.nn.relu(h).reshape(h.shape[0], -1) @ p["w"]


@pytest.mark.parametrize("estimator", ["exact", "probes"])
def test_strided_convolutions_inside_a_cond(estimator):
    """Inside a ``cond`` on the CPU (DDP-SGD's refresh at ``every > 1``) DDP takes a plain convolution's
    gradients in XLA's top-level form (`forward.conv`): κ is what autodiff's own gradients give with the same
    probes, which at α = 1 with the exact estimator is the per-example Fisher; strided convolutions in
    NCHW / OIHW and NCHW / HWIO / NHWC, uneven padding."""
    from pathspace_jax import ddp

    ks = jax.random.split(jax.random.key(3), 4)
    p = {
        "k1": 0.7 * jax.random.normal(ks[0], (3, 2, 3, 2), jnp.float64),
        "b1": 0.1 * jax.random.normal(ks[1], (3,), jnp.float64),
        "k2": 0.7 * jax.random.normal(ks[2], (2, 3, 3, 2), jnp.float64),
        "w": 0.7 * jax.random.normal(ks[3], (12, 2), jnp.float64),
    }
    x = jax.random.normal(jax.random.key(4), (5, 2, 7, 6), jnp.float64)
    space = pj.trace(_strided_conv_fn, p, x)
    alpha = 0.5 if estimator == "probes" else 1.0
    leaves = space.leaves_of(p, "params")

    def kappa(in_cond):
        k, lg = ddp.ddp_kappa_canonical(space, leaves, [x], jax.random.key(6), alpha, "second", estimator, 2, 0.0,
                                        False, None, in_cond)  # fmt: skip
        return space.unflatten_like(p, kappa_from_frame(space, k, lg))

    got = kappa(True)
    chex.assert_trees_all_close(got, kappa(False), rtol=1e-12, atol=1e-14)
    if estimator == "exact":
        chex.assert_trees_all_close(got, _fisher(_strided_conv_fn, p, x, "second"), rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize(
    "dims,x_shape,w_shape,strides,padding",
    [
        (("NWC", "WIO", "NWC"), (3, 11, 2), (4, 2, 3), (3,), ((2, 1),)),
        (("NCHW", "OIHW", "NHWC"), (2, 3, 9, 8), (4, 3, 3, 2), (2, 2), "SAME"),
        (("NCDHW", "DHWIO", "NDHWC"), (2, 2, 5, 6, 4), (2, 3, 2, 2, 3), (1, 2, 1), "VALID"),
    ],
)
def test_conv_gradients_in_top_level_form(dims, x_shape, w_shape, strides, padding):
    """`forward.conv`'s two gradients (forward convolutions in the axis order XLA:CPU's library takes) equal
    autodiff's, for 1-, 2- and 3-D convolutions with strides, padding and mixed layouts (float64)."""
    import types

    from pathspace_jax import forward

    def conv(x, w):
        return jax.lax.conv_general_dilated(x, w, strides, padding, dimension_numbers=dims)

    x = jax.random.normal(jax.random.key(0), x_shape, jnp.float64)
    w = jax.random.normal(jax.random.key(1), w_shape, jnp.float64)
    (eqn,) = jax.make_jaxpr(conv)(x, w).jaxpr.eqns
    e = types.SimpleNamespace(prim=eqn.primitive, params=eqn.params)
    y, vjp = jax.vjp(conv, x, w)
    got_y, got_vjp = jax.vjp(lambda x, w: forward.conv(e, x, w), x, w)
    dy = jax.random.normal(jax.random.key(2), y.shape, jnp.float64)
    chex.assert_trees_all_close(got_y, y, rtol=1e-14)
    chex.assert_trees_all_close(got_vjp(dy), vjp(dy), rtol=1e-12, atol=1e-12)
