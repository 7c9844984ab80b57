"""Training across processes: every optimiser on a (data, model) mesh of local processes, checked against one device.

This script launches ``--processes`` copies of itself (default 2), each with ``--devices`` CPU devices (default 2),
joined by ``jax.distributed.initialize`` into one JAX runtime (CPU collectives over gloo), exactly as a
multi-host GPU or TPU job is (there, one process per host and the accelerators as devices). On the global mesh
``(data, model)`` each process:

* traces the network: the `PathSpace` is static, the same on every process, so nothing about it is communicated;
* builds the params as global arrays, each Dense kernel and bias sharded along its output axis over ``model``,
  and every batch sharded along its rows over ``data`` (each process supplies its own rows);
* runs ``jax.jit(tx.init)`` and ``--steps`` jitted steps of SGD, Adam, G-SGD, G-Adam, Path-SGD and DDP-SGD (α = 1)
  on scikit-learn's digits (an MLP 64-128-128-10, batch 64); XLA inserts the collectives.

Process 0 gathers the final params; one more process trains the same optimisers on one device, and this
(launching) process prints, per optimiser, the largest difference between the two, relative to the params'
largest entry: float32 rounding (reductions split across devices sum in another order), about 1e-7; Adam and
G-Adam 1e-5, as their steps divide by the root of tiny second moments, which that rounding perturbs more.

Run:  pip install -e ".[examples]" && python examples/multiprocess.py   (--steps 20: the default; --quick: 3 steps)
Writes examples/out/multiprocess.json and prints the table. See docs/scaling.md for multi-host GPU and TPU.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

WIDTHS = (128, 128, 10)
BATCH = 64


def optimisers(space):
    """name -> (transformation, whether its update takes the batch as ``inputs=``)."""
    import optax

    import pathspace_jax as pj

    return {
        "SGD": (optax.sgd(0.1), False),
        "Adam": (optax.adam(1e-3), False),
        "G-SGD": (pj.g_sgd(space, 0.1), False),
        "G-Adam": (pj.g_adam(space, 1e-3), False),
        "Path-SGD": (pj.path_sgd(space, 0.1), False),
        "DDP-SGD (α=1)": (pj.ddp_sgd(space, 0.1, alpha=1.0), True),
    }


def data(steps: int):
    """The digits, centred, and the rows of each step's batch (the same on every process)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    x -= x.mean(0)
    order = np.random.default_rng(0).permutation(len(x))[: steps * BATCH].reshape(steps, BATCH)
    return x, digits.target.astype(np.int32), order


def train(steps: int, place=None, put_batch=None) -> dict[str, dict[str, np.ndarray]]:
    """Every optimiser for ``steps`` steps; ``place`` / ``put_batch`` make global arrays on a mesh (None: one device).
    Returns name -> final params as numpy (``place`` given: gathered from every process)."""
    import flax.linen as nn
    import jax
    import optax

    import pathspace_jax as pj

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for w in WIDTHS[:-1]:
                x = nn.relu(nn.Dense(w)(x))
            return nn.Dense(WIDTHS[-1])(x)

    model, (x, y, order) = MLP(), data(steps)
    params = jax.tree_util.tree_map(np.asarray, model.init(jax.random.key(0), x[:BATCH])["params"])
    fn = lambda p, x: model.apply({"params": p}, x)  # noqa: E731
    space = pj.trace(fn, jax.eval_shape(lambda: params), x[:BATCH])  # abstract params: the graph alone
    place = place or (lambda tree: jax.tree_util.tree_map(jax.numpy.asarray, tree))
    put_batch = put_batch or jax.numpy.asarray
    out = {}
    for name, (tx, needs_inputs) in optimisers(space).items():

        def step(p, s, xb, yb, tx=tx, needs_inputs=needs_inputs):
            loss = lambda p: optax.softmax_cross_entropy_with_integer_labels(fn(p, xb), yb).mean()  # noqa: E731
            u, s = tx.update(jax.grad(loss)(p), s, p, **({"inputs": xb} if needs_inputs else {}))
            return optax.apply_updates(p, u), s

        p = place(params)
        s, step = jax.jit(tx.init)(p), jax.jit(step)
        for rows in order:
            p, s = step(p, s, put_batch(x[rows]), put_batch(y[rows]))
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            p = multihost_utils.process_allgather(p, tiled=True)
        out[name] = jax.tree_util.tree_map(np.asarray, p)
    return out


def save(params: dict, path: Path) -> None:
    np.savez(path, **{f"{name}|{'/'.join(k)}": v for name, tree in params.items() for k, v in _flatten(tree)})


def worker(args) -> None:
    """One process of the job: join the runtime, build the mesh, train, and (process 0) save the params. With
    ``--processes 0``: the one-device reference, in a process of its own (whatever the caller's JAX settings)."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    if args.processes == 0:
        save(train(args.steps), args.save)
        return
    jax.config.update("jax_num_cpu_devices", args.devices)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{args.port}", num_processes=args.processes, process_id=args.process_id)
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    shape, auto = (args.processes * args.devices // args.model, args.model), (jax.sharding.AxisType.Auto,) * 2
    mesh = jax.make_mesh(shape, ("data", "model"), axis_types=auto)  # XLA places the collectives

    def global_array(a, spec):  # every process holds the whole numpy array and supplies its own shards of it
        sharding = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(a.shape, sharding, lambda index: a[index])

    def place(tree):  # a kernel (in, out) and a bias (out,) along their output axis over "model"
        return jax.tree_util.tree_map(lambda a: global_array(a, P(*[None] * (a.ndim - 1), "model")), tree)

    def put_batch(a):
        return global_array(a, P("data"))

    params = train(args.steps, place, put_batch)
    if jax.process_index() == 0:
        save(params, args.save)
    jax.distributed.shutdown()


def _flatten(tree, prefix=()):
    for k, v in tree.items():
        yield from _flatten(v, prefix + (k,)) if isinstance(v, dict) else [(prefix + (k,), v)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--devices", type=int, default=2, help="CPU devices per process")
    ap.add_argument("--model", type=int, default=2, help="size of the mesh's model axis")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="3 steps")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "out")
    ap.add_argument("--timeout", type=float, default=600, help="seconds before the job is stopped")
    ap.add_argument("--process-id", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--save", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.steps = 3 if args.quick else args.steps
    if args.process_id is not None:
        worker(args)
        return {}

    args.out.mkdir(parents=True, exist_ok=True)
    files = [args.out / "multiprocess_sharded.npz", args.out / "multiprocess_one_device.npz"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}

    def launch(processes: int, path: Path, port: int = 0) -> list[subprocess.Popen]:
        common = ["--processes", str(processes), "--devices", str(args.devices), "--model", str(args.model),
                  "--steps", str(args.steps), "--port", str(port), "--save", str(path)]  # fmt: skip
        return [subprocess.Popen([sys.executable, __file__, *common, "--process-id", str(i)], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                for i in range(max(processes, 1))]  # fmt: skip

    t0 = time.perf_counter()
    jobs = launch(args.processes, files[0], _free_port()) + launch(0, files[1])  # the job, and the reference
    try:
        logs = [job.communicate(timeout=args.timeout)[0] for job in jobs]
    finally:
        for job in jobs:
            job.kill()
    for i, (job, log) in enumerate(zip(jobs, logs)):
        if job.returncode:
            who = f"process {i} of the job" if i < args.processes else "the one-device run"
            raise RuntimeError(f"{who} exited with {job.returncode}:\n{log[-3000:]}")
    seconds = time.perf_counter() - t0
    sharded, single = (dict(np.load(f)) for f in files)
    rows = {}
    for name in dict.fromkeys(k.split("|")[0] for k in single):
        keys = [k for k in single if k.startswith(name + "|")]
        scale = max(float(np.abs(single[k]).max()) for k in keys)
        rows[name] = max(float(np.abs(sharded[k] - single[k]).max()) for k in keys) / scale
    mesh = f"({args.processes * args.devices // args.model}, {args.model})"
    print(f"{args.processes} processes x {args.devices} CPU devices, mesh (data, model) = {mesh}, {args.steps} steps, "
          f"{seconds:.0f} s")  # fmt: skip
    print(f"{'optimiser':<16} max |sharded - one device| / max |params|")
    for name, r in rows.items():
        print(f"{name:<16} {r:.1e}")
    result = {"config": {k: v for k, v in vars(args).items() if k in ("processes", "devices", "model", "steps")},
              "seconds": seconds, "max_relative_difference": rows}  # fmt: skip
    (args.out / "multiprocess.json").write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    for f in files:
        f.unlink()
    return result


if __name__ == "__main__":
    main()
