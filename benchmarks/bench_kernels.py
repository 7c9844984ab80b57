"""Kernels per train step: the top-level operations of each optimiser's compiled step, against plain optax.

Where a step is a chain of small kernels (a GPU at these sizes: each launch costs microseconds however little it
computes), their number sets the step's time more than its flops do. This counts the instructions of the compiled
program's entry computation that run as kernels (fusions, library calls, copies, loops and conditionals; not
parameters, constants, tuples or bitcasts), on the same setups as `bench_path_sgd.py`: compiling only, no timing,
so it runs in a minute on any backend. On the CPU the count is a proxy (XLA:CPU fuses differently); on a GPU it is
the launches of one step (CUDA graphs replay them, but do not merge them). A loop or conditional counts once,
however many kernels its body holds. Run: ``python benchmarks/bench_kernels.py``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).parent))
from common import make_step, optimisers, setups, write_results  # noqa: E402

import pathspace_jax as pj  # noqa: E402

# entry instructions that launch nothing
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id"}


def kernels(step, *args) -> int:
    """How many instructions of ``step``'s compiled entry computation launch work (see the module docstring)."""
    text = step.lower(*args).compile().as_text()
    entry = text[text.index("\nENTRY") :]
    entry = entry[: entry.index("\n}")]
    ops = re.findall(r"^\s*(?:ROOT )?%?\S+ = \S+ ([a-z][\w-]*)\(", entry, re.M)
    return sum(op not in _FREE for op in ops)


def main() -> None:
    rows = {}
    for name, (model, x, y) in setups().items():
        params = model.init(jax.random.key(0), x[:1])["params"]
        space = pj.trace(lambda p, x, model=model: model.apply({"params": p}, x), params, x)
        txs = optimisers(space, recurrent=False)
        reuse = pj.path_sgd(space, 0.01, second_order=False, every=10)
        txs["path_sgd_k1_reuse"] = (reuse, lambda x: {"refresh_kappa": False})  # between refreshes
        out = {}
        for label, (tx, extra) in txs.items():
            out[label] = kernels(make_step(model, tx, extra=extra), params, tx.init(params), x, y)
        rows[name] = out
        print(f"{name:28s} " + "  ".join(f"{k} {v}" for k, v in out.items()), flush=True)
    path = write_results("kernels", rows)
    print("wrote", path)


if __name__ == "__main__":
    jnp.zeros(())
    main()
