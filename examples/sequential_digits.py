"""Sequential digits: a ReLU RNN reads each image step by step, trained with every optimiser.

The sequential-MNIST experiment of "Path Space for Recurrent Neural Networks with ReLU Activations"
(anonymous ICLR submission; Table 1: G-SGD, SGD and Path-SGD; Table 7: G-Adam and Adam), at the scale of
scikit-learn's handwritten digits (1,797 images of 8×8 pixels, shipped with scikit-learn) instead
of MNIST's 70,000 of 28×28:

- **rows**: each image read row by row, 8 steps of 8 pixels (their sMNIST-28 reads 28 rows of 28);
- **permuted pixels**: pixel by pixel in a fixed random order, 64 steps of 1 pixel (their permuted
  sMNIST-98 reads 98 steps of 8).

As in the paper: a single-layer ReLU RNN (Flax ``nn.RNN`` over ``nn.SimpleCell(relu)``, standard
Flax initialisation) with 100 hidden units, its last state read out by a dense layer; batch 64; no
regularisation; the learning rate of each optimiser chosen on a validation split from the paper's
grid (Path-SGD and DDP-SGD, whose steps are divided by κ, from grids that go up to 10 and 3); 3 seeds;
the test error of the last epoch, mean ± standard deviation over the seeds. DDP-SGD runs at α = 1
(the diagonal Fisher information, one damped probe per step). The path-space optimisers act on every
parameter: the RNN, its biases and the read-out, one `PathSpace` traced once. Every configuration of
one optimiser (seeds × learning rates) trains at once, ``jax.vmap`` over the members, each member
with its own initialisation, batch order and learning rate (``optax.inject_hyperparams``).

Run:  pip install -e ".[examples]" && python examples/sequential_digits.py   (--quick: under a minute)
Writes examples/out/sequential_digits.json and examples/out/sequential_digits.png and prints the table.
``--paper`` trains the paper's 400 epochs instead of 40 (half an hour on 2 CPU cores) and writes
sequential_digits_paper.json and .png. Each optimiser's finished runs are saved as they complete (in
``<out>/sequential_digits_runs`` or ``_paper_runs``, removed at the end), so the same command again resumes a
stopped run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import pathspace_jax as pj

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

TASKS = {"rows": "rows (8 steps of 8)", "permuted": "permuted pixels (64 steps of 1)"}

# The paper's grid is {1e-1, 5e-2, 1e-2, 5e-3, 1e-3, 5e-4, 1e-4, 5e-5, 1e-5}; SGD, G-SGD, Path-SGD and DDP-SGD search
# the part of it where SGD's best values lie on these tasks (one grid: Path-SGD's and DDP-SGD's κ is normalised by
# default, so SGD's learning rates carry over), Adam and G-Adam another.
SGD_GRID = (0.1, 0.05, 0.01, 0.005)
ADAM_GRID = (5e-3, 1e-3, 5e-4)


class ReluRNN(nn.Module):
    """A single-layer ReLU RNN whose last state is read out by a dense layer."""

    hidden: int = 100

    @nn.compact
    def __call__(self, x):  # x: (batch, steps, features)
        h = nn.RNN(nn.SimpleCell(self.hidden, activation_fn=nn.relu))(x)
        return nn.Dense(10)(h[:, -1])


def load_tasks():
    """The digits (pixels scaled to [0, 1]) split 60/15/25 into train, validation and test, stratified and fixed;
    for each task, the three splits as sequences (n, steps, features) with their labels."""
    digits = load_digits()
    x, y = (digits.data / 16.0).astype(np.float32), digits.target
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.25, stratify=y, random_state=0)
    x_tr, x_va, y_tr, y_va = train_test_split(x_tr, y_tr, test_size=0.2, stratify=y_tr, random_state=0)
    order = np.random.default_rng(0).permutation(64)  # the fixed permutation of the pixels
    as_seq = {"rows": lambda a: a.reshape(len(a), 8, 8), "permuted": lambda a: a[:, order].reshape(len(a), 64, 1)}
    return {
        task: {split: (jnp.asarray(f(a)), jnp.asarray(b)) for split, (a, b) in
               {"train": (x_tr, y_tr), "val": (x_va, y_va), "test": (x_te, y_te)}.items()}
        for task, f in as_seq.items()
    }  # fmt: skip


def optimisers(space):
    """name -> (transformation with an injected learning rate, learning-rate grid, whether ``update`` takes
    the batch as ``inputs=``)."""
    inject = optax.inject_hyperparams
    static = ("alpha", "num_probes")  # they choose DDP's program: Python values, not injected arrays
    return {
        "SGD": (inject(optax.sgd)(learning_rate=0.0), SGD_GRID, False),
        "Path-SGD": (inject(pj.path_sgd)(space, learning_rate=0.0), SGD_GRID, False),
        "G-SGD": (inject(pj.g_sgd)(space, learning_rate=0.0), SGD_GRID, False),
        "DDP-SGD": (inject(pj.ddp_sgd, static_args=static)(space, learning_rate=0.0, alpha=1.0), SGD_GRID, True),
        "Adam": (inject(optax.adam)(learning_rate=0.0), ADAM_GRID, False),
        "G-Adam": (inject(pj.g_adam)(space, learning_rate=0.0), ADAM_GRID, False),
    }


def train(model, tx, needs_inputs, lrs, seeds, data, *, epochs, batch, bar):
    """Train one member per (seed, learning rate) at once. Returns the mean training loss per epoch and the
    validation and test errors after every epoch, each of shape (epochs, seeds, learning rates)."""
    (x_tr, y_tr), (x_va, y_va), (x_te, y_te) = data["train"], data["val"], data["test"]
    seed_of = np.repeat(np.asarray(seeds), len(lrs))  # member m: seed seed_of[m], learning rate lr_of[m]
    lr_of = np.tile(np.asarray(lrs, np.float32), len(seeds))
    init = jax.vmap(lambda k: model.init(k, x_tr[:1])["params"])
    params = init(jax.vmap(jax.random.key)(jnp.asarray(seed_of)))
    state = jax.vmap(tx.init)(params)
    state.hyperparams["learning_rate"] = jnp.asarray(lr_of)

    def loss_fn(p, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": p}, x), y).mean()

    def step(p, s, idx):  # one member, one batch
        x, y = x_tr[idx], y_tr[idx]
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        u, s = tx.update(g, s, p, **({"inputs": x} if needs_inputs else {}))
        return optax.apply_updates(p, u), s, loss

    def error(p, x, y):  # a member whose outputs are not finite counts as wrong everywhere
        logits = model.apply({"params": p}, x)
        return jnp.where(jnp.all(jnp.isfinite(logits)), (logits.argmax(-1) != y).mean(), 1.0)

    @jax.jit
    def epoch(params, state, idx):  # idx: (steps, members, batch)
        def body(carry, i):
            p, s, loss = jax.vmap(step)(*carry, i)
            return (p, s), loss

        (params, state), losses = jax.lax.scan(body, (params, state), idx)
        errs = [jax.vmap(error, in_axes=(0, None, None))(params, x, y) for x, y in ((x_va, y_va), (x_te, y_te))]
        return params, state, losses.mean(0), *errs

    rngs = [np.random.default_rng(int(s)) for s in seed_of]  # each member's own batch order
    steps = len(x_tr) // batch
    curves = []
    for _ in range(epochs):
        idx = np.stack([r.permutation(len(x_tr))[: steps * batch].reshape(steps, batch) for r in rngs], axis=1)
        params, state, *out = epoch(params, state, jnp.asarray(idx))
        curves.append([np.asarray(o).reshape(len(seeds), len(lrs)) for o in out])
        bar.update()
    loss, val, test = (np.stack(c) for c in zip(*curves, strict=True))
    return np.where(np.isfinite(loss), loss, np.inf), val, test


def summarise(run, lrs):
    """The learning rate with the lowest last-epoch validation error (mean over seeds), and its test errors."""
    best = int(np.argmin(run["val"][-1].mean(0)))
    return {"lr": lrs[best], "test_error": run["test"][-1, :, best].tolist(), "best": best}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=100)
    ap.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS))
    ap.add_argument("--quick", action="store_true", help="the rows task, 2 seeds, 1 learning rate, 4 epochs")
    ap.add_argument("--paper", action="store_true", help="the paper's 400 epochs (resumable: run again)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "out")
    args = ap.parse_args(argv)
    if args.quick:
        args.epochs, args.seeds, args.tasks = 4, 2, ["rows"]
    if args.paper:
        args.epochs = 400
    stem = "sequential_digits_paper" if args.paper else "sequential_digits"
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    done = args.out / f"{stem}_runs"  # one file per finished (task, optimiser), until the whole run is done

    t0 = time.perf_counter()
    data = load_tasks()
    model = ReluRNN(args.hidden)
    seeds = list(range(args.seeds))
    results, resumed_s = {}, 0.0  # resumed_s: the training time of the runs a stopped run had finished
    for task in args.tasks:
        x = data[task]["train"][0][:1]
        params = model.init(jax.random.key(0), x)["params"]
        space = pj.trace(lambda p, x: model.apply({"params": p}, x), params, x)
        opts = optimisers(space)
        results[task] = {}
        with tqdm(total=len(opts) * args.epochs, desc=TASKS[task], unit="epoch") as bar:
            for name, (tx, grid, needs_inputs) in opts.items():
                bar.set_postfix_str(name)
                saved = done / f"{task}_{name}.json"
                if saved.exists() and (kept := json.loads(saved.read_text()))["config"] == config:
                    results[task][name] = kept["run"]
                    resumed_s += kept["run"]["seconds"]
                    bar.update(args.epochs)
                    continue
                t_run = time.perf_counter()
                lrs = list(grid[1:2] if args.quick else grid)
                loss, val, test = train(model, tx, needs_inputs, lrs, seeds, data[task], epochs=args.epochs,
                                        batch=args.batch, bar=bar)  # fmt: skip
                run = {"lrs": lrs, "loss": loss.tolist(), "val": val, "test": test}
                run.update(summarise(run, lrs))
                run["val"], run["test"] = val.tolist(), test.tolist()
                run["seconds"] = time.perf_counter() - t_run
                results[task][name] = run
                done.mkdir(parents=True, exist_ok=True)
                saved.write_text(json.dumps({"config": config, "run": run}, allow_nan=True))

    names = list(next(iter(results.values())))
    print(f"\nTest error (%) of the last epoch, mean ± std over {args.seeds} seeds, at the learning rate chosen on the "
          f"validation split (in brackets)\n")  # fmt: skip
    print(f"{'':<33}" + "".join(f"{n:>22}" for n in names))
    for task, runs in results.items():
        cells = [f"{100 * np.mean(r['test_error']):.2f} ± {100 * np.std(r['test_error']):.2f} ({r['lr']:g})" for r in
                 runs.values()]  # fmt: skip
        print(f"{TASKS[task]:<33}" + "".join(f"{c:>22}" for c in cells))
    elapsed = time.perf_counter() - t0 + resumed_s
    print(f"\n({elapsed:.0f} s; {len(data['rows']['train'][1])} training, {len(data['rows']['val'][1])} validation "
          f"and {len(data['rows']['test'][1])} test images)")  # fmt: skip

    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / f"{stem}.json"
    json_path.write_text(json.dumps({"config": config, "seconds": elapsed, "results": results}, allow_nan=True))

    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.5), squeeze=False)
    for ax, (task, runs) in zip(axes[0], results.items(), strict=True):
        for i, (name, r) in enumerate(runs.items()):
            err = 100 * np.asarray(r["test"])[:, :, r["best"]]  # (epochs, seeds)
            epochs = np.arange(1, len(err) + 1)
            style = "--" if "Adam" in name else "-"
            ax.plot(epochs, err.mean(1), style, color=f"C{i}", label=f"{name} (lr {r['lr']:g})")
            ax.fill_between(epochs, err.min(1), err.max(1), color=f"C{i}", alpha=0.15)
        ax.set(title=TASKS[task], xlabel="epoch", ylabel="test error (%)", yscale="log")
        ax.legend(fontsize=8)
    fig.suptitle(f"Sequential digits, ReLU RNN h={args.hidden}: mean over {args.seeds} seeds (band: min to max)")
    fig.tight_layout()
    png_path = args.out / f"{stem}.png"
    fig.savefig(png_path, dpi=110)
    shutil.rmtree(done, ignore_errors=True)  # the run is complete: its saved runs are in the JSON above
    print(f"table data: {json_path}\nplot: {png_path}")
    return results


if __name__ == "__main__":
    main()
