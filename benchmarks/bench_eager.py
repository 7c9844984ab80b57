"""The public functions of the params called outside a trace: compiled whole, against the same function op by op.

`pj.to_coords`, `pj.coord_scales`, `pj.path_kappa` and the others are many small operations on node vectors and
leaves. Called with concrete arrays, each runs as one compiled program (`pathspace_jax.frames.jit_when_eager`);
before, each of its operations was dispatched alone, and compiled the first time it was met. Rows per setup and
function: ``first_ms`` the first call (tracing and compiling included, no persistent compilation cache),
``call_ms`` a later call, and the same op by op (``inspect.unwrap``: the function as written); JAX's in-memory
caches are cleared before each first call. About a minute on any backend. Run: ``python benchmarks/bench_eager.py``.
"""

from __future__ import annotations

import inspect
import sys
import time
from pathlib import Path

import jax

import pathspace_jax as pj

sys.path.insert(0, str(Path(__file__).parent))
from common import setups, write_results  # noqa: E402

FUNCTIONS = (pj.to_coords, pj.coord_scales, pj.canonicalize, pj.path_kappa)


def timed(f, *args, repeats: int = 10) -> tuple[float, float]:
    """(first call, mean of ``repeats`` later calls), in ms, from empty in-memory caches."""
    jax.clear_caches()
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    first = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(f(*args))
    return 1e3 * first, 1e3 * (time.perf_counter() - t) / repeats


def main() -> None:
    rows = {}
    for name, (model, x, _) in setups().items():
        params = model.init(jax.random.key(1), x)["params"]
        space = pj.trace(lambda p, x, model=model: model.apply({"params": p}, x), params, x)
        for f in FUNCTIONS:
            first, call = timed(f, space, params)
            first_op, call_op = timed(inspect.unwrap(f), space, params)
            row = {"first_ms": first, "call_ms": call, "op_by_op_first_ms": first_op, "op_by_op_call_ms": call_op}
            rows[f"{name} {f.__name__}"] = row
            print(f"{name:26s} {f.__name__:13s}", {k: round(v, 2) for k, v in row.items()})
    print(write_results("eager", rows))


if __name__ == "__main__":
    main()
