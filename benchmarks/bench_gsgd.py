"""G-SGD step cost against plain optax, in one process.

Rows: ``g_sgd`` vs ``optax.sgd`` on the ReLU RNN (hidden 100, 28 steps of 28 inputs, batch 64) and on the
small CNN (target ≤ 1.05×); on the MLP 784-512-512-10 at batch 128, ``g_sgd`` vs ``optax.adam`` (target ≤ 1×)
and vs ``optax.sgd``, and ``g_adam`` vs ``optax.adam``. Run: ``python benchmarks/bench_gsgd.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, str(Path(__file__).parent))
from common import interleaved_ratio, make_step, setups, write_results  # noqa: E402

import pathspace_jax as pj  # noqa: E402

PAIRS = {
    "relu_rnn_h100_t28_b64": [("g_sgd", "sgd")],
    "small_cnn_b64": [("g_sgd", "sgd")],
    "mlp_784_512_512_10_b128": [("g_sgd", "adam"), ("g_sgd", "sgd"), ("g_adam", "adam")],
}


def main() -> None:
    rows = {}
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
        out = {}
        for a, b in pairs:
            r = interleaved_ratio(
                steps[a], steps[b], params, txs[a].init(params), txs[b].init(params), x, y, rounds=9, repeats=30
            )
            out[f"{a}/{b}"] = round(r, 3)
            print(f"{name:28s} {a:7s} / {b:5s} {r:6.3f}x", flush=True)
        rows[name] = out
    path = write_results("gsgd", rows)
    print("wrote", path)


if __name__ == "__main__":
    jnp.zeros(())
    main()
