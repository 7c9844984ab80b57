"""Scale: the structure the library builds on the host is O(nodes), not O(parameters).

`benchmarks/bench_memory.py` measures the peak resident memory of whole runs up to 84M parameters; here the part
that is ours is measured exactly: Python and numpy allocations (``tracemalloc``) while ``trace``, ``tx.init`` and
the lowering of a train step run, on an MLP whose parameters take 20 MB. One array with an entry per parameter
(the per-entry int64 node indices the library once built) would be 40 MB on its own.
"""

import tracemalloc

import flax.linen as nn
import jax
import optax
import pytest

import pathspace_jax as pj


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        for width in (2048, 2048):
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(10)(x)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["g_sgd", "path_sgd", "ddp_sgd"])
def test_host_memory_of_structure_is_small_against_the_params(name):
    model = MLP()
    x = jax.random.normal(jax.random.key(1), (8, 512))
    y = jax.numpy.arange(8) % 10
    params = jax.jit(model.init)(jax.random.key(0), x)["params"]
    nbytes = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(params))
    fn = lambda p, x: model.apply({"params": p}, x)  # noqa: E731
    tracemalloc.start()
    try:
        space = pj.trace(fn, params, x)
        tx = {"g_sgd": pj.g_sgd, "path_sgd": pj.path_sgd, "ddp_sgd": lambda s, lr: pj.ddp_sgd(s, lr, alpha=1.0)}[name](
            space, 0.01
        )
        state = tx.init(params)
        extra = {"inputs": x} if name == "ddp_sgd" else {}

        def step(p, s):
            g = jax.grad(lambda p: optax.softmax_cross_entropy_with_integer_labels(fn(p, x), y).mean())(p)
            u, s = tx.update(g, s, p, **extra)
            return optax.apply_updates(p, u), s

        jax.jit(step).lower(params, state)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert nbytes > 20e6
    assert peak < 0.5 * nbytes, f"{name}: host allocations peaked at {peak / 1e6:.1f} MB, params {nbytes / 1e6:.1f} MB"
