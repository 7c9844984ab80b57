"""DDP-SGD's inputs (issue 76): any pytree the traced function takes, its examples where ``batch_axes`` says.

References are independent of pathspace_jax: per-example Jacobians of the model itself (``jax.vmap(jax.jacrev)``),
the model closed over its shared arguments, and the Jacobian of a whole graph batch (``jax.jacrev``), in float64.
"""

from __future__ import annotations

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import pathspace_jax as pj

jraph = pytest.importorskip("jraph")


def _params(key, sizes=(3, 5, 2), dtype=jnp.float64):
    ks = jax.random.split(key, 2 * len(sizes))
    p = {}
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        p[f"w{i}"] = jax.random.normal(ks[2 * i], (a, b), dtype)
        p[f"b{i}"] = 0.3 * jax.random.normal(ks[2 * i + 1], (b,), dtype)
    return p


def _fisher(fn, params, x, moment="second"):
    """mean_i Σ_out (∂f_out(x_i)/∂w)² (centred over i for the variance), from per-example Jacobians."""
    jac = jax.vmap(lambda xi: jax.jacrev(lambda p: fn(p, xi[None])[0])(params))(x)

    def reduce(j):
        j = j.reshape(j.shape[0], -1, *j.shape[2:])
        if moment == "variance":
            j = j - j.mean(axis=0, keepdims=True)
        return jnp.mean(jnp.sum(j * j, axis=1), axis=0)

    return jax.tree_util.tree_map(reduce, jac)


def _masked_mlp(p, x, scale, mask):
    """An MLP with two arguments shared by the batch: a scale of the hidden pre-activations and a unit mask."""
    h = jax.nn.relu(scale * (x @ p["w0"]) + p["b0"])
    return jnp.where(mask, h, 0.0) @ p["w1"] + p["b1"]


def _mlp_case():
    k = jax.random.split(jax.random.key(3), 2)
    params = _params(k[0])
    x = jax.random.normal(k[1], (7, 3), jnp.float64)
    scale, mask = jnp.asarray(1.7), jnp.array([[True, False, True, True, False]])
    return params, x, scale, mask


_CASES = [(1.0, "second", "exact"), (1.0, "variance", "exact"), (0.5, "second", "exact"), (0.3, "variance", "exact"),
          (0.0, "second", "exact"), (1.0, "second", "probes"), (0.5, "variance", "probes")]  # fmt: skip


@pytest.mark.parametrize("alpha,moment,estimator", _CASES)
def test_shared_arguments_are_the_closure_over_them(alpha, moment, estimator):
    """κ with a scale and a unit mask passed as arguments shared by the batch (``batch_axes=(0, None, None)``) is
    that of the function closed over them, for every α and both estimators (the probes with the same key): the
    shared inputs are constants of the network. At α = 1 it is the per-example Fisher diagonal, at α = 0 Path-SGD's
    κ of the closed function."""
    params, x, scale, mask = _mlp_case()
    space = pj.trace(_masked_mlp, params, x, scale, mask)
    closed = lambda p, x: _masked_mlp(p, x, scale, mask)  # noqa: E731
    closed_space = pj.trace(closed, params, x)
    opts = {"alpha": alpha, "moment": moment, "estimator": estimator, "key": jax.random.key(5)}
    got = pj.ddp_kappa(space, params, (x, scale, mask), batch_axes=(0, None, None), **opts)
    chex.assert_trees_all_close(got, pj.ddp_kappa(closed_space, params, x, **opts), rtol=1e-10, atol=1e-14)
    assert float(jnp.max(got["w0"])) > 0 and float(jnp.max(got["w0"][:, 1])) == 0.0  # the masked unit: no paths
    if alpha == 1.0 and estimator == "exact":
        chex.assert_trees_all_close(got, _fisher(closed, params, x, moment), rtol=1e-10, atol=1e-12)
    if alpha == 0.0:
        chex.assert_trees_all_close(got, pj.path_kappa(closed_space, params), rtol=1e-10)


def test_a_prng_key_argument_is_accepted():
    """A key among the arguments, shared by the batch: κ is that of the function closed over it, and a jitted
    DDP-SGD step takes it (the function does not draw from it here: trace's business where it does)."""
    params, x, _, _ = _mlp_case()

    def fn(p, key, x, deterministic=True):
        h = jax.nn.relu(x @ p["w0"] + p["b0"])
        if not deterministic:
            h = h * jax.random.bernoulli(key, 0.5, h.shape)
        return h @ p["w1"] + p["b1"]

    key = jax.random.key(7)
    space = pj.trace(fn, params, key, x)
    got = pj.ddp_kappa(space, params, (key, x), alpha=0.5, batch_axes=(None, 0))
    closed = pj.trace(lambda p, x: fn(p, key, x), params, x)
    chex.assert_trees_all_close(got, pj.ddp_kappa(closed, params, x, alpha=0.5), rtol=1e-12)
    tx = pj.ddp_sgd(space, 0.1, alpha=1.0, batch_axes=(None, 0))
    grads = jax.grad(lambda p: jnp.sum(fn(p, key, x) ** 2))(params)
    step = jax.jit(lambda g, s, p, key: tx.update(g, s, p, inputs=(key, x), key=jax.random.key(0)))
    updates, _ = step(grads, tx.init(params), params, key)
    assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree_util.tree_leaves(updates))


def test_nnx_state_as_an_argument():
    """The pattern of docs/trace.md: ``fn(params, x, rest)`` with the nnx state besides the params (an RNN's
    ``nnx.Rngs`` stream: a key and a count, no batch axis) shared by the batch; κ at α = 1 is the Fisher diagonal."""

    class NnxRNN(nnx.Module):
        def __init__(self, rngs):
            self.rnn = nnx.RNN(
                nnx.SimpleCell(3, 4, activation_fn=nnx.relu, rngs=rngs, dtype=jnp.float64, param_dtype=jnp.float64)
            )
            self.out = nnx.Linear(4, 2, rngs=rngs, param_dtype=jnp.float64)

        def __call__(self, x):
            return self.out(self.rnn(x)[:, -1])

    graphdef, params, rest = nnx.split(NnxRNN(nnx.Rngs(0)), nnx.Param, ...)
    seq = jax.random.normal(jax.random.key(1), (5, 4, 3), jnp.float64)
    fn = lambda p, x, rest: nnx.merge(graphdef, p, rest)(x)  # noqa: E731
    space = pj.trace(fn, params, seq, rest)
    got = pj.ddp_kappa(space, params, (seq, rest), alpha=1.0, batch_axes=(0, None))
    # the reference closes over a copy of the state made in its own trace (flax refuses writes to state from outside)
    fisher = _fisher(lambda p, x: fn(p, x, jax.tree_util.tree_map(lambda a: a, rest)), params, seq)
    chex.assert_trees_all_close(got, fisher, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match=r"inputs\[1\]\['rnn'\]\['rngs'\].*batch_axes=\(0, None\)"):
        pj.ddp_kappa(space, params, (seq, rest), alpha=1.0)


def test_errors_say_what_where_and_how():
    params, x, scale, mask = _mlp_case()
    space = pj.trace(_masked_mlp, params, x, scale, mask)
    cases = [
        ({}, r"inputs\[1\] \(shape \(\)\) has no leading batch axis: pass batch_axes=\(0, None, None\)"),
        ({"batch_axes": (0, 0)}, "not a pytree prefix of the inputs tuple"),
        ({"batch_axes": (1, None, None)}, "batch_axes takes 0 or None"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match) as err:
            pj.ddp_kappa(space, params, (x, scale, mask), alpha=0.5, **kwargs)
        assert len(str(err.value)) <= 300, str(err.value)
    with pytest.raises(ValueError, match=r"inputs\[2\] has shape \(1, 3\), traced with \(1, 5\)"):
        pj.ddp_kappa(space, params, (x, scale, mask[:, :3]), alpha=0.5, batch_axes=(0, None, None))
    with pytest.raises(ValueError, match="variance over the examples"):
        pj.ddp_kappa(space, params, (x, scale, mask), alpha=1.0, moment="variance", batch_axes=None)
    tx = pj.scale_by_ddp(space, alpha=1.0)  # the transformation checks the same way, naming itself
    grads = jax.tree_util.tree_map(jnp.ones_like, params)
    with pytest.raises(ValueError, match=r"inputs\[1\].*batch_axes=\(0, None, None\)"):
        tx.update(grads, tx.init(params), params, inputs=(x, scale, mask))


# ----------------------------------------------------------------------------- a graph batch (jraph)


class GraphConvNet(nn.Module):
    """Embed the nodes, two graph convolutions (messages summed at the receivers, a ReLU MLP), sum the nodes of
    each graph (a segment sum), read out."""

    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, graph):
        dense = lambda k: nn.Dense(k, param_dtype=self.dtype)  # noqa: E731
        graph = jraph.GraphMapFeatures(embed_node_fn=dense(8))(graph)
        for _ in range(2):
            update = lambda nodes: nn.relu(dense(8)(nodes))  # noqa: E731
            graph = jraph.GraphConvolution(update_node_fn=update, add_self_edges=True)(graph)
        n_graph = graph.n_node.shape[0]
        which = jnp.repeat(jnp.arange(n_graph), graph.n_node, total_repeat_length=graph.nodes.shape[0])
        return dense(2)(jax.ops.segment_sum(graph.nodes, which, n_graph))


def _rings(key, sizes, dtype):
    """Ring graphs of these sizes in one ``GraphsTuple`` (nodes, edges and graphs of different counts)."""
    senders, receivers, start = [], [], 0
    for s in sizes:
        for i in range(s):
            senders += [start + i, start + (i + 1) % s]
            receivers += [start + (i + 1) % s, start + i]
        start += s
    return jraph.GraphsTuple(
        nodes=jax.random.normal(key, (start, 3), dtype), edges=jnp.ones((len(senders), 1), dtype),
        senders=jnp.array(senders), receivers=jnp.array(receivers), n_node=jnp.array(sizes),
        n_edge=jnp.array([2 * s for s in sizes]), globals=jnp.zeros((len(sizes), 1), dtype),
    )  # fmt: skip


def test_a_graph_batch_is_one_example():
    """With ``batch_axes=None`` the GraphsTuple is one example: at α = 1 κ is Σ_t (∂f_t/∂w)² over every output
    entry t of the batch (the Jacobian of the whole batch), which for graphs that do not interact is the sum over
    the graphs of their own squared gradients. The default says what to pass."""
    graph = _rings(jax.random.key(0), [3, 4, 5], jnp.float64)
    model = GraphConvNet(jnp.float64)
    params = model.init(jax.random.key(1), graph)["params"]
    fn = lambda p, g: model.apply({"params": p}, g)  # noqa: E731
    space = pj.trace(fn, params, graph)
    assert space.num_hidden > 0
    got = pj.ddp_kappa(space, params, graph, alpha=1.0, batch_axes=None)
    jac = jax.jacrev(lambda p: fn(p, graph))(params)
    chex.assert_trees_all_close(got, jax.tree_util.tree_map(lambda j: jnp.sum(j * j, axis=(0, 1)), jac), rtol=1e-10)
    alone = [jax.jacrev(lambda p, g=g: fn(p, g))(params) for g in jraph.unbatch(graph)]  # each graph on its own
    summed = jax.tree_util.tree_map(lambda *js: sum(jnp.sum(j * j, axis=(0, 1)) for j in js), *alone)
    chex.assert_trees_all_close(got, summed, rtol=1e-10, atol=1e-12)
    for inputs in (graph, (graph,)):  # the one argument as it is, or in a tuple
        with pytest.raises(ValueError, match=r"inputs\[0\]\.edges has 24 examples.*batch_axes=None") as err:
            pj.ddp_kappa(space, params, inputs, alpha=1.0)
        assert len(str(err.value)) <= 300
    half = pj.ddp_kappa(space, params, graph, alpha=0.5, batch_axes=None, estimator="probes", key=jax.random.key(2))
    assert all(bool(jnp.all(jnp.isfinite(k))) for k in jax.tree_util.tree_leaves(half))


def test_ddp_sgd_trains_a_graph_network():
    """20 jitted steps of DDP-SGD at α = 1 on a graph regression (the batch one example): finite, loss lower."""
    graph = _rings(jax.random.key(3), [3, 4, 5, 6], jnp.float32)
    model = GraphConvNet()
    params = model.init(jax.random.key(4), graph)["params"]
    fn = lambda p, g: model.apply({"params": p}, g)  # noqa: E731
    target = jax.random.normal(jax.random.key(5), (4, 2))
    space = pj.trace(fn, params, graph)
    loss_fn = lambda p: jnp.mean((fn(p, graph) - target) ** 2)  # noqa: E731
    tx = pj.ddp_sgd(space, 0.1, alpha=1.0, batch_axes=None)

    @jax.jit
    def step(p, s, key):
        loss, g = jax.value_and_grad(loss_fn)(p)
        updates, s = tx.update(g, s, p, inputs=graph, key=key)
        return optax.apply_updates(p, updates), s, loss

    state, start = tx.init(params), float(loss_fn(params))
    for key in jax.random.split(jax.random.key(6), 20):
        params, state, _ = step(params, state, key)
    end = float(loss_fn(params))
    assert np.isfinite(end) and end < start, (start, end)
