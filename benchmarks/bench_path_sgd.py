"""Path-SGD step cost against the same jitted `optax.sgd` step, in one process.

Rows per setup: κ⁽¹⁾ recomputed every step (``second_order=False``; the target is ≤ 1.25× SGD), κ⁽¹⁾
every 10 steps (target ≤ 1.05×), and on the RNN the exact κ⁽¹⁾ + κ⁽²⁾ every step (target ≤ 2×) and every
10 steps. κ does not depend on the batch: its cost is that of the squared network on one all-ones
example (plus, for κ⁽²⁾, O(T n³ + T² n²) for the lag sum), so the ratio falls as the batch grows.
Run: ``python benchmarks/bench_path_sgd.py``.
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


def main() -> None:
    rows = {}
    for name, (model, x, y) in setups().items():
        params = model.init(jax.random.key(0), x[:1])["params"]
        fn = lambda p, x, model=model: model.apply({"params": p}, x)  # noqa: E731
        space = pj.trace(fn, params, x)
        sgd = optax.sgd(0.01)
        sgd_step = make_step(model, sgd)
        variants = {
            "kappa1_every1": dict(second_order=False),
            "kappa1_every10": dict(second_order=False, every=10),
        }
        if any(leaf.recurrent for leaf in space.leaves):
            variants["exact_kappa2_every1"] = dict(second_order=True)
            variants["exact_kappa2_every10"] = dict(second_order=True, every=10)
        out = {}
        for vname, kw in variants.items():
            tx = pj.path_sgd(space, 0.01, **kw)
            step = make_step(model, tx)
            r = interleaved_ratio(step, sgd_step, params, tx.init(params), sgd.init(params), x, y, rounds=7, repeats=20)
            out[vname] = round(r, 3)
            print(f"{name:28s} {vname:24s} {r:6.2f}x optax.sgd", flush=True)
        rows[name] = out
    path = write_results("path_sgd", rows)
    print("wrote", path)


if __name__ == "__main__":
    jnp.zeros(())
    main()
