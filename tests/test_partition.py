"""Path-space transformations inside ``optax.partition`` / ``optax.masked``, with the space of the whole model.

``optax.partition`` hands each transformation trees in which the leaves of the other labels are
``optax.MaskedNode``. `pj.path_labels` labels the edge leaves (the positively homogeneous part) and the
rest; the path-space transformations take the masked trees, give exactly the updates they give on the
whole tree at their leaves, and refuse a partition that masks one of the network's edges.
"""

from __future__ import annotations

from pydoc_data.topics import topics

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import pathspace_jax as pj


class _LM(nn.Module):
    """Character model: embedding -> 2-layer ReLU RNN -> LayerNorm -> PReLU -> logits (the PReLU's slope is the one
    parameter that is not an edge)."""

    vocab: int

    @nn.compact
    def __call__(self, ids):
        h = nn.Embed(self.vocab, 8)(ids)
        for _ in range(2):
            h = nn.RNN(nn.SimpleCell(16, activation_fn=nn.relu))(h)
        return nn.Dense(self.vocab)(nn.PReLU()(nn.LayerNorm()(h)))


def _text_batches(steps, batch=8, length=17):
    text = "".join(topics[k] for k in sorted(topics))[:20_000]
    chars = sorted(set(text))
    ids = np.asarray([chars.index(c) for c in text], np.int32)
    rng = np.random.default_rng(0)
    starts = rng.integers(0, len(ids) - length, (steps, batch))
    return len(chars), jnp.asarray(ids[starts[..., None] + np.arange(length)])


def _lm():
    vocab, data = _text_batches(30)
    model = _LM(vocab)
    params = model.init(jax.random.key(0), data[0, :, :-1])["params"]
    space = pj.trace(lambda p, ids: model.apply({"params": p}, ids), params, data[0, :, :-1])

    def loss(p, seq):
        logits = model.apply({"params": p}, seq[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, seq[:, 1:]).mean()

    return space, params, data, loss


def test_path_labels_are_the_edges_describe_lists():
    space, params, _, _ = _lm()
    labels = pj.path_labels(space, params)
    text = pj.describe(space)
    # the LayerNorm's reasons name the user's own line (the model's __call__), then Flax's, shortened
    assert "test_partition.py:" in text and "in flax/linen/normalization.py:" in text and "site-packages" not in text
    rows = {line.split()[0]: line for line in text.splitlines() if line and "/" in line.split(" ")[0]}
    flat = {"/".join(str(k.key) for k in path): v for path, v in jax.tree_util.tree_leaves_with_path(labels)}
    assert set(flat) == set(rows)
    for name, label in flat.items():
        assert label == ("other" if "not an edge" in rows[name] else "path"), (name, rows[name])
    assert flat["PReLU_0/negative_slope"] == "other" and flat["Embed_0/embedding"] == "path"
    assert flat["LayerNorm_0/scale"] == "path"  # an edge from the normalised value into units of their own
    assert jax.tree_util.tree_structure(pj.path_labels(space)) == jax.tree_util.tree_structure(labels)


def _path_tx(space, name):
    return {
        "g_sgd": lambda: pj.g_sgd(space, 0.1),
        "g_adam": lambda: pj.g_adam(space, 3e-3),
        # Path-SGD and DDP-SGD: the pinned group (the second RNN layer, normalised by the LayerNorm) is a
        # boundary, cut at every step; the token ids are a one-hot input. DDP at α = 0 is Path-SGD's κ (with
        # κ⁽²⁾), at α = 1 the diagonal Fisher, in between the Gauss–Newton recursion (one damped probe). All at
        # SGD's learning rate, as G-SGD: their κ is normalised by default.
        "path_sgd": lambda: pj.path_sgd(space, 0.1),
        "ddp_sgd_0": lambda: pj.ddp_sgd(space, 0.1, alpha=0.0),
        "ddp_sgd_05": lambda: pj.ddp_sgd(space, 0.1, alpha=0.5),
        "ddp_sgd_1": lambda: pj.ddp_sgd(space, 0.1, alpha=1.0),
    }[name]()


def _partitioned(space, params, name):
    """The path optimiser on the edges, Adam on the rest. DDP-SGD at α > 0 runs the whole network (its node
    statistics need the PReLU's slope), so it scales the whole tree and the split comes after it."""
    labels = pj.path_labels(space, params)
    if name in ("ddp_sgd_05", "ddp_sgd_1"):
        return optax.chain(
            pj.scale_by_ddp(space, alpha=0.5 if name == "ddp_sgd_05" else 1.0),
            optax.partition({"path": optax.sgd(0.1), "other": optax.adam(3e-3)}, labels),
        )
    return optax.partition({"path": _path_tx(space, name), "other": optax.adam(3e-3)}, labels)


@pytest.mark.parametrize("name", ["g_sgd", "g_adam", "path_sgd", "ddp_sgd_0", "ddp_sgd_05", "ddp_sgd_1"])
@pytest.mark.slow
def test_language_model_trains_in_a_partition(name):
    space, params, data, loss = _lm()
    path_tx, tx = _path_tx(space, name), _partitioned(space, params, name)

    def extra(seq):  # DDP-SGD's batch: the traced function's input (the token ids)
        return {"inputs": (seq[:, :-1],)} if name.startswith("ddp") else {}

    def train(tx):
        @jax.jit
        def step(p, s, seq):
            value, grads = jax.value_and_grad(loss)(p, seq)
            updates, s = tx.update(grads, s, p, **extra(seq))
            return optax.apply_updates(p, updates), s, value

        p, s, losses = params, tx.init(params), []
        for seq in data:
            p, s, value = step(p, s, seq)
            losses.append(float(value))
        return np.asarray(losses)

    ours = train(tx)
    assert np.all(np.isfinite(ours)), ours
    assert ours[-5:].mean() < 0.9 * ours[:5].mean(), ours
    # every path optimiser trains at the plain optimiser's rate (its κ, or G-SGD's chart, is normalised):
    # compare with that optimiser on every leaf
    base = train(optax.adam(3e-3) if name == "g_adam" else optax.sgd(0.1))
    assert ours[-5:].mean() <= 1.2 * base[-5:].mean(), (ours, base)

    # at the path leaves, the update is the one the transformation gives on the whole tree
    grads = jax.grad(loss)(params, data[0])
    part, _ = tx.update(grads, tx.init(params), params, **extra(data[0]))
    whole, _ = path_tx.update(grads, path_tx.init(params), params, **extra(data[0]))
    for leaf, a, b in zip(space.leaves, jax.tree_util.tree_leaves(part), jax.tree_util.tree_leaves(whole)):
        if leaf.kind != "other":
            chex.assert_trees_all_close(a, b, rtol=1e-6, atol=1e-7)
    if name == "ddp_sgd_1":  # inside the partition, DDP-SGD says why it needs the hidden leaves' values
        inside = optax.partition({"path": path_tx, "other": optax.adam(3e-3)}, pj.path_labels(space, params))
        with pytest.raises(ValueError, match=r"hid the values of \['PReLU_0/negative_slope'\]"):
            inside.update(grads, inside.init(params), params, **extra(data[0]))


@pytest.mark.parametrize("name", ["path_sgd", "ddp_sgd"])
def test_kappa_scaling_in_a_partition_and_masked(name):
    model = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(3)])
    x = jax.random.normal(jax.random.key(0), (16, 4))
    params = model.init(jax.random.key(1), x)["params"]
    space = pj.trace(lambda p, x: model.apply({"params": p}, x), params, x)
    grads = jax.grad(lambda p: jnp.sum(model.apply({"params": p}, x) ** 2))(params)
    make = {"path_sgd": lambda: pj.path_sgd(space, 0.1), "ddp_sgd": lambda: pj.ddp_sgd(space, 0.1, alpha=0.5)}[name]
    kw = {"inputs": (x,)} if name == "ddp_sgd" else {}
    whole, _ = make().update(grads, make().init(params), params, **kw)
    # extra arguments (DDP's batch) reach the transformation through optax.partition
    tx = optax.partition({"path": make(), "other": optax.sgd(0.1)}, pj.path_labels(space, params))
    part, _ = jax.jit(lambda g, s, p: tx.update(g, s, p, **kw))(grads, tx.init(params), params)
    chex.assert_trees_all_close(part, whole, rtol=1e-6)
    # optax.masked that masks an edge leaf: a clear error naming it
    mask = jax.tree_util.tree_map_with_path(lambda path, _: "layers_0" in jax.tree_util.keystr(path), params)
    with pytest.raises(ValueError, match=r"masked edge leaves of the network: \['layers_2/bias', 'layers_2/kernel'\]"):
        optax.masked(make(), mask).init(params)


class _NnxNormed(nnx.Module):
    def __init__(self, rngs):
        self.l1, self.l2 = nnx.Linear(4, 8, rngs=rngs), nnx.Linear(8, 8, rngs=rngs)
        self.norm, self.head = nnx.LayerNorm(8, rngs=rngs), nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.head(jnp.tanh(self.norm(jax.nn.relu(self.l2(jax.nn.relu(self.l1(x)))))))


def test_path_labels_of_an_nnx_state_serve_nnx_optimizer():
    """``nnx.Optimizer`` inits on the ``State`` of ``Param`` variables and updates on its pure form: the labels of
    the ``State`` serve both (labels with ``Param`` wrappers failed inside JAX at the first update)."""
    model = _NnxNormed(nnx.Rngs(0))
    x, y = jax.random.normal(jax.random.key(1), (16, 4)), jnp.arange(16) % 3
    graphdef, state = nnx.split(model, nnx.Param)
    space = pj.trace(lambda p, x: nnx.merge(graphdef, p)(x), state, x)
    labels = pj.path_labels(space, state)
    assert jax.tree.leaves(labels) == jax.tree.leaves(pj.path_labels(space, nnx.as_pure(state)))
    tx = optax.partition({"path": pj.g_sgd(space, 0.1), "other": optax.adam(1e-2)}, labels)
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, opt):
        loss, g = nnx.value_and_grad(lambda m: optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean())(model)
        opt.update(model, g)
        return loss

    losses = [float(step(model, opt)) for _ in range(10)]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses
