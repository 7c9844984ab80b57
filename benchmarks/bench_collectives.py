"""What each optimiser communicates per step, counted from the compiled programs on a mesh of N CPU devices.

The train step (`common.make_step`) of every optimiser is compiled for N CPU devices (4, or the first argument)
under two shardings:

* **data parallel**: params and optimizer state replicated, the batch's rows sharded over ``data``;
* **FSDP-style**: every leaf sharded along its largest axis divisible by N over ``data`` (replicated where none
  is), the batch's rows too.

and the collectives in XLA's optimised HLO (``all-reduce``, ``all-gather``, ``reduce-scatter``,
``collective-permute``, ``all-to-all``) are counted with the bytes of their results: the data each device
receives per step, up to the algorithm XLA's runtime uses for each. An operation inside a loop (a scan) counts
once. ``extra_x``: bytes beyond SGD's under the same sharding, in units of the params' bytes. The GPU and TPU
compilers may fuse or split collectives differently; the CPU program shows what the algorithm needs.

Run: python benchmarks/bench_collectives.py [N]   -> results/<platform>-jax<version>/collectives.json (N = 4),
collectives_<N>dev.json otherwise
"""

from __future__ import annotations

import re
import sys

import jax

DEVICES = int(sys.argv[1]) if len(sys.argv) > 1 else 4
jax.config.update("jax_num_cpu_devices", DEVICES)  # before the backend starts

import numpy as np  # noqa: E402
import optax  # noqa: E402
from common import make_step, setups, write_results  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import pathspace_jax as pj  # noqa: E402

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_OP = re.compile(r"^\s*(?:ROOT\s+)?%\S+\s*=\s*(.*?)\s+(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
_SHAPE = re.compile(r"\b(pred|[suf]\d+|bf16)\[([\d,]*)\]")
_BYTES = {"pred": 1, "bf16": 2}


def collectives(hlo: str) -> dict[str, list[int]]:
    """op name -> [count, bytes of the results] in an HLO module's text."""
    out = {op: [0, 0] for op in COLLECTIVES}
    for line in hlo.splitlines():
        m = _OP.search(line)
        if not m:
            continue
        size = 0
        for dtype, dims in _SHAPE.findall(m.group(1)):
            width = _BYTES.get(dtype) or int(dtype[1:]) // 8
            size += width * int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64))
        out[m.group(2)][0] += 1
        out[m.group(2)][1] += size
    return out


def main() -> None:
    mesh = jax.make_mesh((DEVICES,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    replicated = NamedSharding(mesh, P())

    def fsdp(a):
        axes = [k for k in np.argsort(a.shape)[::-1] if a.shape[k] % DEVICES == 0]
        spec = [None] * a.ndim
        if axes:
            spec[axes[0]] = "data"
        return NamedSharding(mesh, P(*spec))

    rows = {}
    for model_name, (model, x, y) in setups().items():
        params = model.init(jax.random.key(0), x)["params"]
        nbytes = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(params))
        space = pj.trace(lambda p, x, model=model: model.apply({"params": p}, x), params, x)
        txs = {
            "sgd": (optax.sgd(0.01), None),
            "adam": (optax.adam(1e-3), None),
            "g_sgd": (pj.g_sgd(space, 0.01), None),
            "g_adam": (pj.g_adam(space, 1e-3), None),
            "path_sgd": (pj.path_sgd(space, 0.01), None),
            "ddp_sgd α=1": (pj.ddp_sgd(space, 0.01, alpha=1.0), lambda x: {"inputs": x}),
        }
        baseline = {}
        for name, (tx, extra) in txs.items():
            state = jax.eval_shape(tx.init, params)
            for sharding_name, place in (("data parallel", lambda a: replicated), ("FSDP", fsdp)):
                p_sh = jax.tree_util.tree_map(place, params)
                s_sh = jax.tree_util.tree_map(lambda a, place=place: place(a) if a.ndim else replicated, state)
                batch = NamedSharding(mesh, P("data"))
                spec = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)  # noqa: E731
                args = (
                    jax.tree_util.tree_map(spec, params, p_sh),
                    jax.tree_util.tree_map(spec, state, s_sh),
                    spec(x, batch),
                    spec(y, batch),
                )
                hlo = make_step(model, tx, extra).lower(*args).compile().as_text()
                counts = collectives(hlo)
                total = sum(b for _, b in counts.values())
                baseline.setdefault(sharding_name, total)
                rows[f"{model_name}, {name}, {sharding_name}"] = {
                    "collectives": sum(c for c, _ in counts.values()),
                    "MB": round(total / 2**20, 3),
                    "extra_x": round((total - baseline[sharding_name]) / nbytes, 2),
                    **{op: c for op, (c, _) in counts.items() if c},
                }
                print(model_name, name, sharding_name, rows[f"{model_name}, {name}, {sharding_name}"], flush=True)
    print(write_results("collectives" if DEVICES == 4 else f"collectives_{DEVICES}dev", rows))


if __name__ == "__main__":
    main()
