"""google/flax's example models (`tests/flax_examples.py`) with each optimiser: step time over the plain one's.

Each model as its example writes it (training mode, its own loss, dropout on), at the test suite's small widths:
one jitted step of G-SGD, Path-SGD (κ⁽¹⁾ + κ⁽²⁾ every step, the default) and DDP-SGD (α = 1, one probe, the
default estimator) over `optax.sgd`'s, G-Adam's over `optax.adam`'s, interleaved in one process
(`common.interleaved_ratio`). A model with no hidden node (`describe` says why) runs the plain forms. The table
in docs/models.md is this file's output. Run: ``python benchmarks/bench_flax_examples.py [name ...]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import optax

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
from common import interleaved_ratio, step_ms, write_results  # noqa: E402
from flax_examples import CASES  # noqa: E402

import pathspace_jax as pj  # noqa: E402


def _step(case, tx, ddp: bool):
    """A jitted step ``(params, state, inputs, _) -> (params, state, loss)`` of the example's own loss."""

    def step(params, state, inputs, _):
        loss, g = jax.value_and_grad(case.loss)(params, *inputs)
        kw = {"inputs": inputs, "key": jax.random.key(0)} if ddp else {}
        updates, state = tx.update(g, state, params, **kw)
        return optax.apply_updates(params, updates), state, loss

    return jax.jit(step, donate_argnums=(0, 1))


def measure(name: str) -> dict:
    case = CASES[name]()
    space = pj.trace(case.fn, case.params, *case.inputs)
    txs = {
        "sgd": optax.sgd(case.sgd_lr),
        "adam": optax.adam(case.adam_lr),
        "g_sgd": pj.g_sgd(space, case.sgd_lr),
        "g_adam": pj.g_adam(space, case.adam_lr),
        "path_sgd": pj.path_sgd(space, case.sgd_lr),
        "ddp_sgd": pj.ddp_sgd(space, case.sgd_lr, alpha=1.0, batch_axes=case.batch_axes()),
    }
    steps = {k: _step(case, tx, k == "ddp_sgd") for k, tx in txs.items()}
    states = {k: tx.init(case.params) for k, tx in txs.items()}
    row = {"hidden": space.num_hidden, "params": space.num_params, "sgd_ms": None}
    row["sgd_ms"] = step_ms(steps["sgd"], case.params, states["sgd"], case.inputs, None, rounds=3, repeats=10)
    for k, base in (("g_sgd", "sgd"), ("g_adam", "adam"), ("path_sgd", "sgd"), ("ddp_sgd", "sgd")):
        row[k] = round(
            interleaved_ratio(
                steps[k], steps[base], case.params, states[k], states[base], case.inputs, None, rounds=3, repeats=10
            ),  # fmt: skip
            2,
        )
    return row


def main(names):
    rows = {}
    for name in names:
        rows[name] = measure(name)
        print(name, rows[name], flush=True)
    write_results("flax_examples", rows)
    print("\n| model | H | SGD ms | G-SGD | G-Adam (over Adam) | Path-SGD | DDP-SGD α=1 |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['hidden']} | {r['sgd_ms']:.2f} | {r['g_sgd']:.2f}× | {r['g_adam']:.2f}× "
              f"| {r['path_sgd']:.2f}× | {r['ddp_sgd']:.2f}× |")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:] or list(CASES))
