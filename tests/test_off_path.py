"""Entries that lie on no path: Path-SGD's κ is exactly 0 there and they do not change the function.

A 3×3 convolution on 1×1 maps (the last stage of a ResNet on 32×32 images) reads only padding with all its taps
but the centre one. A loss with weight decay gives those taps a gradient; Path-SGD and DDP-SGD give them the plain
step of the learning rate, as SGD does, not that gradient divided by a floor (10⁶ times SGD's step, then NaN).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pathspace_jax as pj


class _PaddedCNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(4, (3, 3), padding="SAME")(x))
        x = nn.relu(nn.Conv(4, (3, 3), padding="SAME")(x))
        return nn.Dense(3)(x.reshape(x.shape[0], -1))


def _problem():
    model = _PaddedCNN()
    x = jax.random.normal(jax.random.key(1), (16, 1, 1, 2))
    y = jax.random.randint(jax.random.key(2), (16,), 0, 3)
    params = model.init(jax.random.key(0), x)["params"]
    fn = lambda p, x: model.apply({"params": p}, x)  # noqa: E731

    def loss(p):
        ce = optax.softmax_cross_entropy_with_integer_labels(fn(p, x), y).mean()
        return ce + 1e-4 * sum(jnp.sum(w**2) for w in jax.tree.leaves(p))

    return fn, params, x, loss


def _train(tx, params, loss, steps=20, **extra):
    @jax.jit
    def step(p, s):
        value, g = jax.value_and_grad(loss)(p)
        u, s = tx.update(g, s, p, **extra)
        return optax.apply_updates(p, u), s, value

    state, values = tx.init(params), []
    for _ in range(steps):
        params, state, value = step(params, state)
        values.append(float(value))
    return values


def test_describe_counts_the_taps_that_read_only_padding():
    fn, params, x, _ = _problem()
    space = pj.trace(fn, params, x)
    kappa = pj.path_kappa(space, params)
    assert sum(int(jnp.sum(k == 0)) for k in jax.tree.leaves(kappa)) == 8 * 2 * 4 + 8 * 4 * 4  # all but the centre
    text = pj.describe(space, params)
    assert "Conv_0/kernel   3x3x2x4  g0 -> g1; entries on no path: 64 taps that read only padding" in text
    assert "128 taps that read only padding" in text
    assert "entries on no path" not in pj.describe(space)  # the counts need the params


@pytest.mark.parametrize("name", ["path_sgd", "ddp_sgd"])
def test_padding_taps_take_the_plain_step_and_train_like_sgd(name):
    fn, params, x, loss = _problem()
    space = pj.trace(fn, params, x)
    extra = {"inputs": x} if name == "ddp_sgd" else {}
    tx = pj.path_sgd(space, 0.1) if name == "path_sgd" else pj.ddp_sgd(space, 0.1, alpha=1.0, estimator="exact")
    # one step: at the entries on no path the update is SGD's
    grads = jax.grad(loss)(params)
    updates, _ = tx.update(grads, tx.init(params), params, **extra)
    off = jax.tree.map(lambda k: k == 0, pj.path_kappa(space, params))
    for u, g, o in zip(jax.tree.leaves(updates), jax.tree.leaves(grads), jax.tree.leaves(off), strict=True):
        np.testing.assert_array_equal(np.asarray(u)[np.asarray(o)], -0.1 * np.asarray(g)[np.asarray(o)])
    ours, sgd = _train(tx, params, loss, **extra), _train(optax.sgd(0.1), params, loss)
    assert np.all(np.isfinite(ours)) and ours[-1] < ours[0], ours
    assert abs(ours[-1] - sgd[-1]) < 0.1 * sgd[0], (ours[-1], sgd[-1])
