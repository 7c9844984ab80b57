"""What one more array in the optimizer state costs a step, against the same jitted `optax.sgd` step.

On a GPU the small steps are not set by their kernels alone: plain Adam, with fewer kernels than SGD on the MLP
784-512-512-10 at batch 128, took 1.6× SGD's 0.11-ms step on an H200, as much as G-SGD with 50 % more kernels,
and Path-SGD's step that reuses a kept κ (fewer kernels, more state) took longer than the one that recomputes
it. Both hold more arrays in their state, each one an argument and a result of every call (donated, so never
copied). This isolates that cost: SGD whose state also carries ``n`` arrays that the step passes through
untouched, either small (16 floats, like a kept κ's vectors and frames) or copies of the params (Adam's moments
are two). Rows: ``host_us`` the time one call takes to return with the device idle (`common.host_us`),
``vs_sgd`` the step's time over plain SGD's (interleaved rounds); ``adam`` for comparison. If a step's time
grows with its arrays, packing an optimizer's state into fewer of them shortens it; if not, the cost is in the
kernels. Compiling and timing only: about a minute on any backend. Run: ``python benchmarks/bench_buffers.py``.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, str(Path(__file__).parent))
from common import host_us, interleaved_ratio, make_step, setups, step_ms, write_results  # noqa: E402

SETUPS = ("mlp_784_512_512_10_b128", "small_cnn_b64")


def carrying(tx: optax.GradientTransformation, pad, n: int) -> optax.GradientTransformation:
    """``tx`` whose state also holds ``n`` pads ``pad(params)`` (arrays or trees), passed through untouched."""

    def init(params):
        return tx.init(params), [pad(params) for _ in range(n)]

    def update(updates, state, params=None):
        updates, inner = tx.update(updates, state[0], params)
        return updates, (inner, state[1])

    return optax.GradientTransformation(init, update)


def variants(params) -> dict[str, tuple[int, optax.GradientTransformation]]:
    """name -> (arrays in the state beyond SGD's, transformation)."""
    leaves = len(jax.tree_util.tree_leaves(params))
    sgd, adam = optax.sgd(0.01), optax.adam(1e-3)
    small = {f"small_{n}": (n, carrying(sgd, lambda p: jnp.zeros(16), n)) for n in (8, 32, 128)}
    zeros_like_params = functools.partial(jax.tree_util.tree_map, jnp.zeros_like)
    copies = {f"params_x{k}": (k * leaves, carrying(sgd, zeros_like_params, k)) for k in (1, 2)}
    return {**small, **copies, "adam": (len(jax.tree_util.tree_leaves(adam.init(params))), adam)}


def main() -> None:
    rows = {}
    all_setups = setups()
    for name in SETUPS:
        model, x, y = all_setups[name]
        params = model.init(jax.random.key(0), x[:1])["params"]
        sgd = optax.sgd(0.01)
        base = make_step(model, sgd)
        out = {
            "sgd_step_ms": step_ms(base, params, sgd.init(params), x, y),
            "sgd_host_us": host_us(base, params, sgd.init(params), x, y),
        }
        for key, (n, tx) in variants(params).items():
            step = make_step(model, tx)
            r = interleaved_ratio(step, base, params, tx.init(params), sgd.init(params), x, y, rounds=7)
            out[key] = {"arrays": n, "host_us": host_us(step, params, tx.init(params), x, y), "vs_sgd": round(r, 3)}
            print(f"{name:28s} {key:10s} {n:4d} arrays  host {out[key]['host_us']:7.1f} us  {r:6.3f}x", flush=True)
        rows[name] = out
    print("wrote", write_results("buffers", rows))


if __name__ == "__main__":
    jnp.zeros(())
    main()
