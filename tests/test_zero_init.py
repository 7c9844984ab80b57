"""Weights that a standard recipe initialises to exactly 0 (a residual block's last normalisation scale): the
index rule's skeleton avoids them where it can, so G-SGD and G-Adam train such a model as written."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pathspace_jax as pj
from pathspace_jax.skeleton import skeleton


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        y = nn.Dense(8)(nn.relu(nn.Dense(8)(x)))
        return nn.relu(x + nn.LayerNorm(scale_init=nn.initializers.zeros)(y))  # zero-initialised last scale


class _ResMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(8)(x))
        return nn.Dense(3)(_Block()(_Block()(x)))


def _setup(seed=0):
    model = _ResMLP()
    x = jax.random.normal(jax.random.key(1), (16, 5))
    params = model.init(jax.random.key(seed), x)["params"]
    return (lambda p, x: model.apply({"params": p}, x)), params, x


def test_skeleton_moves_only_off_the_zero_weights():
    fn, params, x = _setup()
    space = pj.trace(fn, params, x)
    plain = pj.trace(fn, jax.tree.map(jnp.ones_like, params), x)  # no zeros: the index rule everywhere
    assert space.skeleton_rule == "index, off zeros" and plain.skeleton_rule == "index"
    assert "moved off weights that were exactly 0" in pj.describe(space)
    ours, index = skeleton(space), skeleton(plain)
    moved = (ours.in_flat != index.in_flat) | (ours.in_leaf != index.in_leaf)
    flat = [np.ravel(w) for w in space.leaves_of(params)]
    assert moved.any() and np.all(ours.out_flat == index.out_flat)
    for v in np.flatnonzero(moved):  # where the index rule took a zero, and now a nonzero weight
        assert flat[index.in_leaf[v]][index.in_flat[v]] == 0 and flat[ours.in_leaf[v]][ours.in_flat[v]] != 0
    pj.g_sgd(space, 0.1).init(params)  # refused with the index rule's zero skeleton weights
    with pytest.raises(ValueError, match="skeleton weight"):
        pj.g_sgd(plain, 0.1).init(params)


@pytest.mark.parametrize("name", ["g_sgd", "g_adam"])
def test_g_sgd_trains_zero_initialised_scales_as_written(name):
    fn, params, x = _setup()
    y = jnp.arange(16) % 3
    space = pj.trace(fn, params, x)
    tx = pj.g_sgd(space, 0.1) if name == "g_sgd" else pj.g_adam(space, 1e-2)

    @jax.jit
    def step(p, s):
        value, g = jax.value_and_grad(lambda p: optax.softmax_cross_entropy_with_integer_labels(fn(p, x), y).mean())(p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, value

    p, s, values = params, tx.init(params), []
    for _ in range(20):
        p, s, value = step(p, s)
        values.append(float(value))
    assert np.all(np.isfinite(values)) and values[-1] < 0.9 * values[0], values
    assert float(jnp.abs(p["_Block_0"]["LayerNorm_0"]["scale"]).min()) > 0  # every scale moved off 0
    # the chart is not tied to the params it was traced with: another initialisation round-trips through it
    other = _setup(seed=1)[1]
    back = pj.from_coords(space, pj.to_coords(space, other))
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(other), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
