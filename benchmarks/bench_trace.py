"""Time `trace` on models of about a million parameters.

With abstract params (``jax.eval_shape``) the skeleton comes from the graph alone; with concrete params
``trace`` also chooses it from their values (`pathspace_jax.skeleton.choose_by_value`), timed separately.

Run: python benchmarks/bench_trace.py   -> benchmarks/results/<platform>-jax<version>/trace.json
"""

from __future__ import annotations

import time

import flax.linen as nn
import jax
import jax.numpy as jnp
from common import MLP, write_results

import pathspace_jax as pj


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        for c in (64, 128, 128):
            x = nn.relu(nn.Conv(c, (3, 3))(x))
            x = nn.max_pool(x, (2, 2), (2, 2))
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


class RNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.RNN(nn.SimpleCell(512, activation_fn=nn.relu))(x)
        h = nn.RNN(nn.SimpleCell(512, activation_fn=nn.relu))(h)
        return nn.Dense(10)(h[:, -1])


def bench(name, model, x, repeats=5):
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), x)["params"])
    fn = lambda p, x: model.apply({"params": p}, x)  # noqa: E731
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        space = pj.trace(fn, params, x)
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    jax.make_jaxpr(fn)(params, x)
    make_jaxpr = time.perf_counter() - t0
    concrete = model.init(jax.random.key(0), x)["params"]
    by_value = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        pj.trace(fn, concrete, x)
        by_value.append(time.perf_counter() - t0)
    times.sort()
    by_value.sort()
    row = {
        "num_params": space.num_params,
        "num_hidden": space.num_hidden,
        "trace_seconds_median": times[len(times) // 2],
        "trace_value_skeleton_seconds_median": by_value[len(by_value) // 2],
        "make_jaxpr_seconds": make_jaxpr,
    }
    print(
        f"{name:28s} m={space.num_params:>9,d}  trace {row['trace_seconds_median']:.3f}s  "
        f"with the value skeleton {row['trace_value_skeleton_seconds_median']:.3f}s  "
        f"(make_jaxpr alone {make_jaxpr:.3f}s)"
    )
    return row


if __name__ == "__main__":
    rows = {
        "mlp_784_1024_512_10": bench("mlp_784_1024_512_10", MLP(widths=(1024, 512)), jnp.ones((128, 784))),
        "cnn_64_128_128": bench("cnn_64_128_128", CNN(), jnp.ones((8, 32, 32, 3))),
        "stacked_relu_rnn_512": bench("stacked_relu_rnn_512", RNN(), jnp.ones((8, 28, 28))),
    }
    print("wrote", write_results("trace", rows))
