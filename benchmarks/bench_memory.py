"""Host memory and set-up time of every optimiser, from 5M to 84M parameters.

One fresh process per (size, optimiser), so that each peak is its own: a ReLU MLP (input 512 or 1024 or 2048, two
hidden layers of 2048, 4096 or 8192 units, 10 outputs; float32), params from ``model.init``, then
``pj.trace``, ``tx.init`` and one jitted train step (batch 32, cross-entropy, params and state donated as in a
training loop), compiled and run. Reported per run:

* ``peak_rss_mb``: the process's peak resident memory (``ru_maxrss``), and ``over_sgd_x``: its excess over
  ``optax.sgd``'s at the same size, in units of the params' bytes (budget: at most 4), and ``over_plain_x`` the
  same over its plain optax counterpart (``optax.adam`` for G-Adam);
* ``temp_mb``: the compiled step's temporaries (XLA's ``memory_analysis``), ``state_mb``: the optimiser state;
* ``host_peak_mb``: the peak of Python/numpy allocations (``tracemalloc``, in a second process) over trace, init
  and lowering the step: the structure `pathspace_jax` builds on the host;
* ``trace_s``, ``init_s``, ``compile_s``: the set-up time (it should grow no faster than the parameter count).

Run: python benchmarks/bench_memory.py [--sizes small mid large]  -> results/<platform>-jax<version>/memory.json
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
import tracemalloc

SIZES = {"small": (512, 2048, 2048, 10), "mid": (1024, 4096, 4096, 10), "large": (2048, 8192, 8192, 10)}
OPTIMISERS = ("sgd", "adam", "g_sgd", "g_adam", "path_sgd", "ddp_sgd")
RUN = {"check": True, "capture_output": True, "text": True}


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def one(widths: tuple[int, ...], name: str, host: bool) -> dict:
    """Measure one optimiser at one size, in this process (called in a fresh one); ``host``: only the
    ``tracemalloc`` peak (it slows Python down and adds to the RSS, so the other figures come from a run without)."""
    import flax.linen as nn
    import jax
    import optax

    import pathspace_jax as pj

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for w in widths[1:-1]:
                x = nn.relu(nn.Dense(w)(x))
            return nn.Dense(widths[-1])(x)

    model = MLP()
    x = jax.random.normal(jax.random.key(1), (32, widths[0]))
    y = jax.random.randint(jax.random.key(2), (32,), 0, widths[-1])
    params = jax.jit(model.init)(jax.random.key(0), x)["params"]
    nbytes = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(params))
    fn = lambda p, x: model.apply({"params": p}, x)  # noqa: E731
    out = {"params": sum(leaf.size for leaf in jax.tree_util.tree_leaves(params)), "params_mb": nbytes / 2**20}

    if host:
        tracemalloc.start()
    t0 = time.perf_counter()
    space = pj.trace(fn, params, x) if name not in ("sgd", "adam") else None
    t1 = time.perf_counter()
    tx = {
        "sgd": lambda: optax.sgd(0.01),
        "adam": lambda: optax.adam(1e-3),
        "g_sgd": lambda: pj.g_sgd(space, 0.01),
        "g_adam": lambda: pj.g_adam(space, 1e-3),
        "path_sgd": lambda: pj.path_sgd(space, 0.01),
        "ddp_sgd": lambda: pj.ddp_sgd(space, 0.01, alpha=1.0),
    }[name]()
    state = tx.init(params)
    jax.block_until_ready(state)
    t2 = time.perf_counter()
    extra = {"inputs": x} if name == "ddp_sgd" else {}

    def step(p, s, x, y):
        loss = lambda p: optax.softmax_cross_entropy_with_integer_labels(fn(p, x), y).mean()  # noqa: E731
        u, s = tx.update(jax.grad(loss)(p), s, p, **extra)
        return optax.apply_updates(p, u), s

    lowered = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, x, y)  # as a training loop does
    if host:
        return {"host_peak_mb": tracemalloc.get_traced_memory()[1] / 2**20}
    compiled = lowered.compile()
    t3 = time.perf_counter()
    jax.block_until_ready(compiled(params, state, x, y))
    analysis = compiled.memory_analysis()
    out.update(
        trace_s=t1 - t0,
        init_s=t2 - t1,
        compile_s=t3 - t2,
        temp_mb=(analysis.temp_size_in_bytes if analysis else 0) / 2**20,
        state_mb=sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(state)) / 2**20,
        peak_rss_mb=_rss_mb(),
    )
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", choices=SIZES, default=list(SIZES))
    ap.add_argument("--one", nargs=3, metavar=("SIZE", "OPTIMISER", "HOST"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one(SIZES[args.one[0]], args.one[1], args.one[2] == "host")))
        return

    def run(*cmd):
        return json.loads(subprocess.run([sys.executable, __file__, "--one", *cmd], **RUN).stdout)

    from common import write_results

    rows = {}
    for size in args.sizes:
        runs = {}
        for name in OPTIMISERS:
            runs[name] = {**run(size, name, "all"), **run(size, name, "host")}
            print(size, name, runs[name], flush=True)
        for name, r in runs.items():
            params = r.pop("params")
            plain = runs["adam" if "adam" in name else "sgd"]
            rows[f"{'-'.join(map(str, SIZES[size]))} ({params / 1e6:.0f}M), {name}"] = {
                **{k: round(v, 3 if k.endswith("_s") else 1) for k, v in r.items()},
                "over_sgd_x": round((r["peak_rss_mb"] - runs["sgd"]["peak_rss_mb"]) / r["params_mb"], 2),
                "over_plain_x": round((r["peak_rss_mb"] - plain["peak_rss_mb"]) / r["params_mb"], 2),
            }
    print(write_results("memory", rows))


if __name__ == "__main__":
    main()
