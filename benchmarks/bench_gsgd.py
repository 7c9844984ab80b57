"""G-SGD step cost against plain optax, in one process.

Rows: ``g_sgd`` vs ``optax.sgd`` on the ReLU RNN (hidden 100, 28 steps of 28 inputs, batch 64) and on the
small CNN (target ≤ 1.05×); on the MLP 784-512-512-10 at batch 128, ``g_sgd`` vs ``optax.adam`` (target ≤ 1×)
and vs ``optax.sgd``, and ``g_adam`` vs ``optax.adam``. Then the O(m) check: the G-SGD update alone
(gradient given) on MLPs 784-w-w-10 of growing width, in ns per parameter, next to ``optax.sgd``'s.
Run: ``python benchmarks/bench_gsgd.py``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, str(Path(__file__).parent))
from common import MLP, host_us, interleaved_ratio, make_step, setups, step_ms, write_results  # noqa: E402

import pathspace_jax as pj  # noqa: E402

PAIRS = {
    "relu_rnn_h100_t28_b64": [("g_sgd", "sgd")],
    "small_cnn_b64": [("g_sgd", "sgd")],
    "mlp_784_512_512_10_b128": [("g_sgd", "adam"), ("g_sgd", "sgd"), ("g_adam", "adam")],
}


def main() -> None:
    rows, host = {}, {}
    all_setups = setups()
    for name, pairs in PAIRS.items():
        model, x, y = all_setups[name]
        params = model.init(jax.random.key(0), x[:1])["params"]
        space = pj.trace(lambda p, x, model=model: model.apply({"params": p}, x), params, x)
        txs = {
            "sgd": optax.sgd(0.01),
            "adam": optax.adam(1e-3),
            "g_sgd": pj.g_sgd(space, 0.01),
            "g_adam": pj.g_adam(space, 1e-3),
        }
        steps = {k: make_step(model, tx) for k, tx in txs.items()}
        out = {"sgd_step_ms": step_ms(steps["sgd"], params, txs["sgd"].init(params), x, y)}
        host[name] = {k: host_us(steps[k], params, txs[k].init(params), x, y) for k in dict.fromkeys(sum(pairs, ()))}
        for a, b in pairs:
            r = interleaved_ratio(
                steps[a], steps[b], params, txs[a].init(params), txs[b].init(params), x, y, rounds=9, repeats=30
            )
            out[f"{a}/{b}"] = round(r, 3)
            print(f"{name:28s} {a:7s} / {b:5s} {r:6.3f}x", flush=True)
        rows[name] = out
    rows["update_ns_per_param"] = scaling()
    rows["host_us_per_call"] = host
    path = write_results("gsgd", rows)
    print("wrote", path)


def update_seconds(tx, params, grads, repeats: int = 200) -> float:
    """Median seconds of one jitted ``params + tx.update(grads)`` (params and state donated)."""

    def apply(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    apply = jax.jit(apply, donate_argnums=(0, 1))
    p, s = jax.tree_util.tree_map(jnp.copy, (params, tx.init(params)))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        p, s = apply(p, s, grads)
        jax.block_until_ready(p)
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def scaling(widths=(128, 512, 2048)) -> dict:
    """ns per parameter of the G-SGD and the SGD update (gradient given) on MLPs 784-w-w-10."""
    out = {}
    for w in widths:
        model = MLP(widths=(w, w))
        x = jax.random.normal(jax.random.key(0), (8, 784))
        params = model.init(jax.random.key(0), x)["params"]
        grads = jax.tree_util.tree_map(lambda a: 1e-3 * jnp.ones_like(a), params)
        space = pj.trace(lambda p, x, model=model: model.apply({"params": p}, x), params, x)
        m = space.num_params
        row = {"m": m}
        for k, tx in (("g_sgd", pj.g_sgd(space, 0.01)), ("sgd", optax.sgd(0.01))):
            row[k] = round(1e9 * update_seconds(tx, params, grads) / m, 3)
        out[f"mlp_784_{w}_{w}_10"] = row
        print(f"m = {m:9d}  update ns/param: g_sgd {row['g_sgd']:7.3f}  sgd {row['sgd']:7.3f}", flush=True)
    return out


if __name__ == "__main__":
    jnp.zeros(())
    main()
