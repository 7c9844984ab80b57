"""`pathspace_jax.testing` at its default tolerances: float32 models held to float32's precision relative to
the outputs' scale, so rounding passes and a step that is not invariant fails."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pathspace_jax as pj


class _Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        for width in (32, 32):
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(4)(x)


def _setup():
    model = _Net()
    x = jax.random.normal(jax.random.key(1), (64, 8), jnp.float32)
    y = jax.random.normal(jax.random.key(2), (64, 4), jnp.float32)
    params = model.init(jax.random.key(0), x)["params"]
    fn = lambda p, x: model.apply({"params": p}, x)  # noqa: E731
    return fn, params, x, y, pj.trace(fn, params, x)


def test_default_tolerances_follow_the_outputs_dtype_and_scale():
    assert pj.testing.default_tolerances(np.array([0.5, -2.0], np.float32)) == pytest.approx(
        (64 * 2.0**-23, 64 * 2.0**-23 * 2.0)
    )
    assert pj.testing.default_tolerances(np.array([3.0])) == pytest.approx((1e-6, 3e-6))  # float64: 1e-6
    assert pj.testing.default_tolerances(np.ones(2, np.float32), rtol=1e-3, atol=0.0) == (1e-3, 0.0)


@pytest.mark.parametrize("name", ["g_sgd", "path_sgd", "ddp_sgd"])
def test_float32_steps_pass_at_the_defaults_and_sgd_fails(name):
    fn, params, x, y, space = _setup()
    assert jax.tree.leaves(params)[0].dtype == jnp.float32

    def loss(p, batch):
        return jnp.mean((fn(p, batch[0]) - batch[1]) ** 2)

    kw = {"update_kwargs": {"inputs": x}} if name == "ddp_sgd" else {}
    tx = {"g_sgd": pj.g_sgd, "path_sgd": pj.path_sgd, "ddp_sgd": lambda s, lr: pj.ddp_sgd(s, lr, alpha=1.0)}[name]
    pj.testing.assert_function_invariant(fn, space, params, x)
    pj.testing.assert_update_invariant(tx(space, 0.05), loss, space, params, (x, y), num_steps=3, **kw)
    with pytest.raises(AssertionError):
        pj.testing.assert_update_invariant(optax.sgd(0.05), loss, space, params, (x, y), num_steps=3)
