"""Do SGD's learning rates carry over to Path-SGD and DDP-SGD? One grid, every optimiser, four digit tasks.

Path-SGD and DDP-SGD divide each gradient entry by κ, whose size depends on the network and the data. With
their default ``normalize=True`` κ is divided by its mean over each leaf in the balanced frame (a rescaling
invariant, at the level where a standard initialisation is its own frame), so that from a standard
initialisation the step has SGD's size. This script checks it from outside: SGD, Path-SGD and DDP-SGD at
α = 0, 0.5 and 1 (defaults otherwise), each on the same half-decade grid of learning rates, 3 seeds, on

- the digits MLP (64-100-100-10) and CNN of ``examples/digits_mlp_cnn.py`` (20 epochs, centred pixels);
- the ReLU RNN of ``examples/sequential_digits.py`` (h = 100) reading rows (40 epochs) and permuted pixels
  (64 steps of one pixel; ``--permuted-epochs``, 60 by default).

For each optimiser: the learning rate with the lowest last-epoch validation error (mean over seeds) and the
test error there, against SGD's. The acceptance of the learning-rate issue: the best rate within one grid step
of SGD's, and the test error within 1.2× SGD's. Every configuration of one optimiser (seeds × rates) trains at
once (``jax.vmap``), with the examples' own training loops.

Run:  python benchmarks/lr_transfer.py   (about an hour on 2 CPU cores; --quick: one task, 2 epochs)
Writes benchmarks/results/<platform>/lr_transfer.json and lr_transfer.png and prints the table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import matplotlib
import numpy as np
import optax
from tqdm import tqdm

import pathspace_jax as pj

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
import digits_mlp_cnn as dmc  # noqa: E402
import sequential_digits as seq  # noqa: E402
from common import results_folder  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

GRID = (3.0, 1.0, 0.3, 0.1, 0.03, 0.01, 0.003, 0.001)  # one grid for every optimiser, half a decade a step
ALPHAS = (0.0, 0.5, 1.0)


def optimisers(space):
    """name -> (transformation with an injected learning rate, whether ``update`` takes the batch)."""
    inject = optax.inject_hyperparams
    static = ("alpha", "num_probes")  # they choose DDP's program: Python values, not injected arrays
    return {
        "SGD": (inject(optax.sgd)(learning_rate=0.0), False),
        "Path-SGD": (inject(pj.path_sgd)(space, learning_rate=0.0), False),
        **{
            f"DDP-SGD α={a:g}": (inject(pj.ddp_sgd, static_args=static)(space, learning_rate=0.0, alpha=a), True)
            for a in ALPHAS
        },
    }


def run_digits(name, seeds, epochs, bar):
    """The MLP or CNN task: {optimiser: (val, test)}, each (epochs, seeds, rates)."""
    data = dmc.load()
    x = data["train"][0][:64]
    model = dmc.MODELS[name]()
    init = lambda k: model.init(k, x)["params"]  # noqa: E731
    apply = lambda p, x: model.apply({"params": p}, x)  # noqa: E731
    space = pj.trace(apply, init(jax.random.key(0)), x)
    out = {}
    for opt, (tx, needs_inputs) in optimisers(space).items():
        bar.set_postfix_str(f"{name} {opt}")
        method = dmc.Method(init, apply, lambda p, x_tr, x: apply(p, x), tx, GRID, needs_inputs)
        _, val, test = dmc.train(method, list(GRID), seeds, data, epochs=epochs, batch=64, bar=bar)
        out[opt] = (val, test)
    return out


def run_sequence(task, seeds, epochs, bar):
    """The row-wise or permuted-pixel RNN task: {optimiser: (val, test)}, each (epochs, seeds, rates)."""
    data = seq.load_tasks()[task]
    model = seq.ReluRNN(100)
    x = data["train"][0][:1]
    space = pj.trace(lambda p, x: model.apply({"params": p}, x), model.init(jax.random.key(0), x)["params"], x)
    out = {}
    for opt, (tx, needs_inputs) in optimisers(space).items():
        bar.set_postfix_str(f"{task} {opt}")
        _, val, test = seq.train(model, tx, needs_inputs, list(GRID), seeds, data, epochs=epochs, batch=64, bar=bar)
        out[opt] = (val, test)
    return out


def summarise(runs):
    """Per optimiser: the best rate on the validation split, the test errors there, and the two checks."""
    table = {}
    for opt, (val, test) in runs.items():
        best = int(np.argmin(val[-1].mean(0)))
        table[opt] = {"lr": GRID[best], "best": best, "test_error": test[-1, :, best].tolist()}
    sgd = table["SGD"]
    for row in table.values():
        row["grid_steps_from_sgd"] = abs(row["best"] - sgd["best"])
        row["error_over_sgd"] = float(np.mean(row["test_error"]) / max(np.mean(sgd["test_error"]), 1e-12))
        row["ok"] = row["grid_steps_from_sgd"] <= 1 and row["error_over_sgd"] <= 1.2
    return table


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--tasks", nargs="+", default=["MLP", "CNN", "rows", "permuted"])
    ap.add_argument("--permuted-epochs", type=int, default=60)
    ap.add_argument("--quick", action="store_true", help="the MLP, 2 epochs, 2 seeds (a smoke test)")
    ap.add_argument(
        "--keep",
        action="store_true",
        help="keep the other tasks of an earlier run's JSON (run the tasks one process at a time)",
    )
    args = ap.parse_args(argv)
    epochs = {"MLP": 20, "CNN": 20, "rows": 40, "permuted": args.permuted_epochs}
    if args.quick:
        args.tasks, args.seeds, epochs = ["MLP"], 2, {"MLP": 2}
    seeds = list(range(args.seeds))
    t0 = time.perf_counter()
    out = results_folder()
    out.mkdir(parents=True, exist_ok=True)
    name = "lr_transfer_quick" if args.quick else "lr_transfer"
    results = {}
    if args.keep and (out / f"{name}.json").exists():
        results = json.loads((out / f"{name}.json").read_text())["results"]
    meta = {"grid": GRID, "seeds": args.seeds, "jax": jax.__version__}
    total = sum(epochs[t] for t in args.tasks) * (2 + len(ALPHAS))
    with tqdm(total=total, unit="epoch") as bar:
        for task in args.tasks:
            t = time.perf_counter()
            run = run_digits if task in dmc.MODELS else run_sequence
            runs = run(task, seeds, epochs[task], bar)
            results[task] = {
                "epochs": epochs[task],
                "seconds": time.perf_counter() - t,
                "summary": summarise(runs),
                "runs": {k: {"val": v.tolist(), "test": te.tolist()} for k, (v, te) in runs.items()},
            }
            (out / f"{name}.json").write_text(json.dumps({"config": meta, "results": results}))  # after each task

    print(f"\nTest error (%) at the learning rate chosen on the validation split (in brackets), mean over "
          f"{args.seeds} seeds; grid {GRID}; ✓: within one grid step of SGD's rate and 1.2× its error\n")  # fmt: skip
    names = list(next(iter(results.values()))["summary"])
    print(f"{'':<10}" + "".join(f"{n:>24}" for n in names))
    for task, r in results.items():
        cells = [f"{100 * np.mean(s['test_error']):.1f} ({s['lr']:g}){' ✓' if s['ok'] else ' ✗'}"
                 for s in r["summary"].values()]  # fmt: skip
        print(f"{task:<10}" + "".join(f"{c:>24}" for c in cells))
    print(
        f"\n({time.perf_counter() - t0:.0f} s; per task: "
        + ", ".join(f"{t} {r['seconds']:.0f} s" for t, r in results.items())
        + ")"
    )

    fig, axes = plt.subplots(1, len(results), figsize=(4.5 * len(results), 4), squeeze=False)
    for ax, (task, r) in zip(axes[0], results.items(), strict=True):
        for i, (opt, run) in enumerate(r["runs"].items()):
            err = 100 * np.asarray(run["test"])[-1].mean(0)  # last epoch, mean over seeds, per rate
            ax.plot(GRID, err, "o-" if opt == "SGD" else ".--", color=f"C{i}", label=opt)
        ax.set(title=task, xscale="log", xlabel="learning rate", ylabel="test error (%)", yscale="log")
        ax.legend(fontsize=8)
    fig.suptitle("Test error of the last epoch against the learning rate, one grid for every optimiser")
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=100)
    print(f"results: {out / name}.json, .png")
    return results


if __name__ == "__main__":
    main()
