"""Where a step's time goes on an accelerator: kernels per step and device time per kernel, against optax.sgd.

For each setup and optimiser: the compiled step's optimised HLO (``<out>/hlo/<case>.txt``); the count of its entry
computation's instructions by opcode (fusions, library calls, loops, conditionals: each launched on its own); and,
where the profiler can read the device (CUPTI on a GPU), the device time of 20 steps per kernel, summed from a
Perfetto trace (per kernel name, dearest first). One JSON line per case on stdout; all of them, with the platform,
in ``<out>/profile.json``. Run: ``python benchmarks/gpu_profile.py OUT [CASE ...]`` (cases: ``setup:optimiser``,
e.g. ``mlp2048:g_sgd``; setups mlp2048, mlp512, cnn, rnn; optimisers those of ``common.optimisers``).
"""

from __future__ import annotations

import collections
import gzip
import json
import re
import shutil
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).parent))
from common import MLP, make_step, optimisers, run_meta, setups  # noqa: E402

import pathspace_jax as pj  # noqa: E402

DEFAULT = [
    "mlp2048:sgd",
    "mlp2048:g_sgd",
    "mlp512:sgd",
    "mlp512:g_sgd",
    "mlp512:path_sgd_k1",
    "mlp512:path_sgd_k1_every10",
    "cnn:sgd",
    "cnn:g_sgd",
    "cnn:path_sgd_k1",
    "cnn:ddp_sgd_a1_probe1",
]


def setup(name):
    s = setups()
    if name == "mlp2048":
        k = jax.random.key(0)
        return MLP(widths=(2048, 2048)), jax.random.normal(k, (128, 784)), jnp.arange(128) % 10
    return s[{"mlp512": "mlp_784_512_512_10_b128", "cnn": "small_cnn_b64", "rnn": "relu_rnn_h100_t28_b64"}[name]]


def entry_ops(hlo: str) -> dict:
    """Opcode counts of the ENTRY computation of an optimised HLO module's text."""
    body = hlo[hlo.index("\nENTRY") :]
    body = body[: body.index("\n}")]
    ops = collections.Counter()
    for line in body.splitlines()[1:]:
        m = re.search(r"=\s*\S+\s+([a-z][\w-]*)\(", line) or re.search(r"=\s*\([^=]*\)\s+([a-z][\w-]*)\(", line)
        if m:
            ops[m.group(1)] += 1
    for skip in ("parameter", "constant", "get-tuple-element", "tuple", "bitcast"):
        ops.pop(skip, None)
    return dict(ops.most_common())


def kernel_times(folder: Path):
    """``(device time per kernel name in µs, summed; number of device events; the trace's process names)`` from
    the trace the profiler wrote under ``folder``, or None."""
    traces = sorted(folder.rglob("*.trace.json.gz"))
    if not traces:
        return None
    events = json.loads(gzip.decompress(traces[-1].read_bytes()))
    events = events.get("traceEvents", events) if isinstance(events, dict) else events
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    per, count = collections.defaultdict(float), 0
    for e in events:
        if e.get("ph") == "X" and "/device:GPU" in names.get(e.get("pid"), "") and "dur" in e:
            per[e["name"]] += float(e["dur"])
            count += 1
    return dict(per), count, sorted(set(names.values()))


def main(out: Path, cases: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "hlo").mkdir(exist_ok=True)
    rows = {}
    for case in cases:
        name, opt = case.split(":")
        model, x, y = setup(name)
        params = model.init(jax.random.key(0), x[:1])["params"]
        space = pj.trace(lambda p, x, model=model: model.apply({"params": p}, x), params, x)
        tx, extra = optimisers(space, recurrent=name == "rnn")[opt]
        step = make_step(model, tx, extra)
        state = tx.init(params)
        compiled = step.lower(params, state, x, y).compile()
        hlo = compiled.as_text()
        (out / "hlo" / f"{name}_{opt}.txt").write_text(hlo)
        row = {"ops": entry_ops(hlo)}
        p, s = jax.tree.map(jnp.copy, params), state
        for _ in range(5):
            p, s, loss = step(p, s, x, y)
        loss.block_until_ready()
        t = time.perf_counter()
        for _ in range(20):
            p, s, loss = step(p, s, x, y)
        loss.block_until_ready()
        row["wall_us_per_step"] = round(1e6 * (time.perf_counter() - t) / 20, 1)
        folder = out / "trace" / f"{name}_{opt}"
        try:
            with jax.profiler.trace(str(folder), create_perfetto_trace=True):
                for _ in range(20):
                    p, s, loss = step(p, s, x, y)
                loss.block_until_ready()
            times = kernel_times(folder)
        except Exception as e:  # no profiler on this backend: the HLO counts still say something
            times, row["profile_error"] = None, repr(e)[:300]
        if times and times[1]:  # device events (none on the CPU backend)
            per, count, row["trace_processes"] = times
            row["device_us_per_step"] = round(sum(per.values()) / 20, 1)
            row["device_events_per_step"] = count / 20
            row["kernels"] = {k[:120]: round(v / 20, 2) for k, v in sorted(per.items(), key=lambda kv: -kv[1])}
            row["distinct_kernels"] = len(per)
        shutil.rmtree(folder, ignore_errors=True)
        rows[case] = row
        print(json.dumps({case: row}), flush=True)
    (out / "profile.json").write_text(json.dumps({"meta": run_meta(), "cases": rows}, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:] or DEFAULT)
