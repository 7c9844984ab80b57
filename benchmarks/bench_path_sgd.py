"""Path-SGD step cost against the same jitted `optax.sgd` step, in one process.

Rows per setup: κ⁽¹⁾ recomputed every step (``second_order=False``; the target is ≤ 1.25× SGD), κ⁽¹⁾
every 10 steps (target ≤ 1.05×), the same schedule decided in Python (``update(..., refresh_kappa=...)``: two
compiled steps, no ``lax.cond``), and on the RNN the exact κ⁽¹⁾ + κ⁽²⁾ every step (target ≤ 2×) and every
10 steps; ``host_us_per_call``: the time one call of each step takes to return, the device idle before it
(`common.host_us`: a step near it is host-bound). κ does not depend on the batch: its cost is that of the squared
network on one all-ones example (plus, for κ⁽²⁾, O(T n³ + T² n²) for the lag sum), so the ratio falls as the
batch grows.
Run: ``python benchmarks/bench_path_sgd.py``.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, str(Path(__file__).parent))
from common import host_us, interleaved_ratio, make_step, setups, step_ms, write_results  # noqa: E402

import pathspace_jax as pj  # noqa: E402


def scheduled(model, tx, k: int = 10):
    """The schedule of ``every=k`` decided in Python: two jitted steps, ``refresh_kappa=True`` at every k-th
    call and False in between, neither with a conditional (a block of 20 calls holds two refreshes)."""
    refresh = make_step(model, tx, extra=lambda x: {"refresh_kappa": True})
    reuse = make_step(model, tx, extra=lambda x: {"refresh_kappa": False})
    calls = itertools.count()

    def step(*args):
        return (refresh if next(calls) % k == 0 else reuse)(*args)

    return step


def main() -> None:
    rows, host = {}, {}
    for name, (model, x, y) in setups().items():
        params = model.init(jax.random.key(0), x[:1])["params"]
        fn = lambda p, x, model=model: model.apply({"params": p}, x)  # noqa: E731
        space = pj.trace(fn, params, x)
        sgd = optax.sgd(0.01)
        sgd_step = make_step(model, sgd)
        variants = {
            "kappa1_every1": dict(second_order=False),
            "kappa1_every10": dict(second_order=False, every=10),
            "kappa1_refresh10_outside": dict(second_order=False, every=10, refresh_outside=True),
        }
        if any(leaf.recurrent for leaf in space.leaves):
            variants["exact_kappa2_every1"] = dict(second_order=True)
            variants["exact_kappa2_every10"] = dict(second_order=True, every=10)
        out = {"sgd_step_ms": step_ms(sgd_step, params, sgd.init(params), x, y)}
        host[name] = {"sgd": host_us(sgd_step, params, sgd.init(params), x, y)}
        for vname, kw in variants.items():
            kw = dict(kw)
            outside = kw.pop("refresh_outside", False)
            tx = pj.path_sgd(space, 0.01, **kw)
            step = scheduled(model, tx) if outside else make_step(model, tx)
            r = interleaved_ratio(step, sgd_step, params, tx.init(params), sgd.init(params), x, y, rounds=7, repeats=20)
            out[vname] = round(r, 3)
            host[name][vname] = host_us(step, params, tx.init(params), x, y)
            print(f"{name:28s} {vname:24s} {r:6.2f}x optax.sgd", flush=True)
        rows[name] = out
    path = write_results("path_sgd", rows | {"host_us_per_call": host})
    print("wrote", path)


if __name__ == "__main__":
    jnp.zeros(())
    main()
