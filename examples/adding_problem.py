"""The adding problem at T = 50, 100, 200: a ReLU RNN trained with SGD, Path-SGD, G-SGD, Adam and G-Adam.

The adding problem (Hochreiter & Schmidhuber, "Long Short-Term Memory", 1997; Le, Jaitly & Hinton,
"A Simple Way to Initialize Recurrent Networks of Rectified Linear Units", 2015): each input is a
sequence of T pairs (a value drawn uniformly from [0, 1], a marker in {0, 1}); exactly two markers are
1, one in each half of the sequence, and the target is the sum of the two marked values. Always
predicting 1 gives a mean squared error of 1/6 ≈ 0.167; the task is solved when the error falls well
below that. Neyshabur, Wu, Salakhutdinov and Srebro ("Path-Normalized Optimization of Recurrent Neural
Networks with ReLU Activations", NeurIPS 2016) train a ReLU RNN on it with SGD and Path-SGD, with and
without the second-order term κ⁽²⁾ of the recurrent weights; "Path Space for Recurrent Neural Networks
with ReLU Activations" adds G-SGD. This script runs all of them, and Adam and G-Adam, at small scale.

A Flax ``nn.RNN`` over ``nn.SimpleCell(relu)`` (standard Flax initialisation) reads the sequence; a
dense layer reads its last state out. Every batch is fresh: 50 new sequences per step. Every
configuration of one optimiser (seeds × learning rates) trains at once, ``jax.vmap`` over the
members, each with its own initialisation, data and learning rate (``optax.inject_hyperparams``); the
learning rate is chosen by the validation error at the end of training, and the table gives the test
error (fresh sequences) of that learning rate, mean ± std over the seeds. No gradient clipping: it acts
on the weight gradients and would break the path-space optimisers' invariance under rescaling.

Two budgets. ``--budget short`` (the default, a few minutes): T = 50, 100, 200, hidden 64, 1,000 steps, 2
seeds, fixed grids. ``--budget paper``: T = 100, hidden 100 as in the paper, 50,000 steps, 3 seeds, and grids
*found*, not guessed: a pilot (1 seed, 2,000 steps, 8 rates a factor √10 apart) gives each optimiser the
largest rate that does not diverge, and the run trains that rate and four below it (factors of √10), and two
more below while fewer than three rates from the largest that did not diverge over the run down are left (the
adding problem diverges late). The table then gives, per optimiser, the largest rate that did not diverge over
the run (no seed's error non-finite or above 2) and the fraction of seeds that solve the task (test error
below 0.05). The paper budget took about 12 hours of wall time on 2 CPU cores shared with other work, in two or
three single-threaded processes (``--workers 2``, or ``--only`` per process: together they train 2.2 times as fast
as one two-threaded process). It saves every member's state after each chunk of steps, and running the same
command again resumes it (``--hours`` stops it after that much time; the files are in
``<out>/adding_problem_paper_checkpoints``, removed when the run completes).
``--only NAME...`` trains some optimisers only; a run without it assembles the table from their checkpoints.
``--status`` prints how far the saved run is (chunks done, the latest test errors per rate and seed).

Run:  pip install -e ".[examples]" && python examples/adding_problem.py   (--quick: under a minute)
      python examples/adding_problem.py --budget paper --workers 2 --out examples/results --hours 2   (resume: again)
Writes <out>/adding_problem[_paper].json and .png and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax
from tqdm import tqdm

import pathspace_jax as pj

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SGD_GRID = (0.03, 0.01, 0.003)  # SGD, G-SGD and Path-SGD (its κ normalised by default: SGD's rates carry over)
ADAM_GRID = (3e-3, 1e-3, 3e-4)
BUDGETS = {
    "short": {"lengths": [50, 100, 200], "steps": 1000, "hidden": 64, "seeds": 2, "evals": 10},
    "paper": {"lengths": [100], "steps": 50_000, "hidden": 100, "seeds": 3, "evals": 50},
}
PILOT_FRACTION, PILOT_EVALS = 25, 4  # the pilot trains for 1/25 of the steps (2,000 of 50,000)
STOPPED = 3  # the exit code of a run that --hours stopped
SOLVED = 0.05  # the test error that solves the task
DIVERGED = 2.0  # a validation error non-finite or above this diverged (an untrained network's is about 7/6)


def pilot_grid(grid):
    """The pilot's rates: 8 rates a factor √10 apart, from the power of ten above 10 × ``grid``'s largest down
    (SGD's family 1, 0.3, ..., 3e-4; Adam's 0.1, ..., 3e-5)."""
    return tuple(_half_decade(10.0 ** np.ceil(np.log10(grid[0]) + 1), k) for k in range(8))


class ReluRNN(nn.Module):
    hidden: int

    @nn.compact
    def __call__(self, x):  # x: (batch, steps, 2)
        h = nn.RNN(nn.SimpleCell(self.hidden, activation_fn=nn.relu))(x)
        return nn.Dense(1)(h[:, -1])[:, 0]


def adding_batch(key, batch: int, length: int):
    """A batch of the adding problem: inputs (batch, length, 2) and targets (batch,)."""
    kv, k1, k2 = jax.random.split(key, 3)
    values = jax.random.uniform(kv, (batch, length), jnp.float32)
    first = jax.random.randint(k1, (batch,), 0, length // 2)
    second = jax.random.randint(k2, (batch,), length // 2, length)
    markers = jax.nn.one_hot(first, length, dtype=jnp.float32) + jax.nn.one_hot(second, length, dtype=jnp.float32)
    return jnp.stack([values, markers], axis=-1), jnp.sum(values * markers, axis=1)


def optimisers(space):
    """name -> (transformation with an injected learning rate, learning-rate grid)."""
    inject = optax.inject_hyperparams
    first_order = inject(pj.path_sgd, static_args=("second_order",))(space, 0.0, second_order=False)
    return {
        "SGD": (inject(optax.sgd)(learning_rate=0.0), SGD_GRID),
        "Path-SGD κ⁽¹⁾": (first_order, SGD_GRID),
        "Path-SGD κ⁽¹⁾+κ⁽²⁾": (inject(pj.path_sgd)(space, learning_rate=0.0), SGD_GRID),
        "G-SGD": (inject(pj.g_sgd)(space, learning_rate=0.0), SGD_GRID),
        "Adam": (inject(optax.adam)(learning_rate=0.0), ADAM_GRID),
        "G-Adam": (inject(pj.g_adam)(space, learning_rate=0.0), ADAM_GRID),
    }


def train(model, tx, lrs, seeds, *, length, steps, batch, evals, bar, ckpt=None, deadline=None):
    """Train one member per (seed, learning rate). Returns the validation and test errors (mean squared error
    on 1,000 fresh sequences each) after every chunk of steps, each of shape (evals, seeds, learning rates).

    With ``ckpt`` (a file), the members' parameters, optimiser states and curves are saved after every chunk,
    and a saved run resumes from its last chunk; with ``deadline`` (a `time.time`), training stops after the
    chunk that passes it and returns None (run again to resume)."""
    seed_of = np.repeat(np.asarray(seeds), len(lrs))
    lr_of = np.tile(np.asarray(lrs, np.float32), len(seeds))
    keys = jax.vmap(jax.random.key)(jnp.asarray(seed_of))
    data_keys = jax.vmap(lambda k: jax.random.fold_in(k, 1))(keys)
    x0, _ = adding_batch(jax.random.key(0), 1, length)
    params = jax.vmap(lambda k: model.init(k, x0)["params"])(keys)
    state = jax.vmap(tx.init)(params)
    state.hyperparams["learning_rate"] = jnp.asarray(lr_of)
    held_out = [adding_batch(jax.random.key(k), 1000, length) for k in (10_000, 20_000)]  # validation, test

    def mse(p, x, y):
        return jnp.mean((model.apply({"params": p}, x) - y) ** 2)

    def step(carry, key):  # one member, one fresh batch
        p, s = carry
        g = jax.grad(mse)(p, *adding_batch(key, batch, length))
        u, s = tx.update(g, s, p)
        return (optax.apply_updates(p, u), s), None

    @jax.jit
    def chunk(params, state, i):  # chunk i: every member's next steps // evals fresh batches
        part = jax.vmap(lambda k: jax.random.split(jax.random.fold_in(k, i), steps // evals))(data_keys)
        (params, state), _ = jax.vmap(lambda p, s, k: jax.lax.scan(step, (p, s), k))(params, state, part)
        errs = [jax.vmap(mse, in_axes=(0, None, None))(params, x, y) for x, y in held_out]
        return params, state, *(jnp.where(jnp.isfinite(e), e, jnp.inf) for e in errs)

    signature = json.dumps([lrs, seeds, length, steps, batch, evals])
    curves, treedef = [], jax.tree.structure((params, state))
    if ckpt is not None and ckpt.exists():
        with np.load(ckpt) as f:
            if str(f["signature"]) != signature:
                raise SystemExit(f"{ckpt} was saved by another configuration: remove it to start afresh")
            leaves = [jnp.asarray(f[f"leaf_{k}"]) for k in range(treedef.num_leaves)]
            curves = [[f["val"][i], f["test"][i]] for i in range(int(f["done"]))]
        params, state = jax.tree.unflatten(treedef, leaves)
        bar.update(len(curves))
    for i in range(len(curves), evals):
        params, state, *errs = chunk(params, state, i)
        curves.append([np.asarray(e).reshape(len(seeds), len(lrs)) for e in errs])
        if ckpt is not None:
            tmp = ckpt.with_suffix(".tmp.npz")
            leaves = {f"leaf_{k}": np.asarray(a) for k, a in enumerate(jax.tree.leaves((params, state)))}
            val, test = (np.stack(c) for c in zip(*curves, strict=True))
            np.savez(tmp, signature=signature, done=len(curves), val=val, test=test, **leaves)
            tmp.replace(ckpt)
        bar.update()
        if deadline is not None and time.time() > deadline and len(curves) < evals:
            return None
    return tuple(np.stack(c) for c in zip(*curves, strict=True))


def diverged(val_last) -> np.ndarray:
    """Per learning rate: whether any seed's final validation error is non-finite or above `DIVERGED`."""
    return np.any(~np.isfinite(val_last) | (val_last > DIVERGED), axis=0)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", choices=list(BUDGETS), default="short")
    ap.add_argument("--lengths", type=int, nargs="+", help="sequence lengths T (default: the budget's)")
    ap.add_argument("--steps", type=int, help="training steps (default: the budget's)")
    ap.add_argument("--hidden", type=int, help="hidden units (default: the budget's)")
    ap.add_argument("--seeds", type=int, help="seeds per learning rate (default: the budget's)")
    ap.add_argument("--evals", type=int, help="evaluations, and checkpoints, per run (default: the budget's)")
    ap.add_argument("--batch", type=int, default=50)
    ap.add_argument("--hours", type=float, help="stop after this many hours (paper budget; run again to resume)")
    ap.add_argument(
        "--only",
        nargs="+",
        metavar="NAME",
        help="train (or resume) only these optimisers, e.g. in "
        "parallel processes; a run without --only then assembles the table from their checkpoints",
    )
    ap.add_argument(
        "--workers",
        type=int,
        default=1,
        help="train the optimisers in this many processes, "
        "each single-threaded (on 2 CPU cores, 2 train 2.2 times as fast as one two-threaded process)",
    )
    ap.add_argument("--status", action="store_true", help="print how far the saved paper-budget run is, and stop")
    ap.add_argument("--quick", action="store_true", help="T = 20, 1 learning rate, 150 steps")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "out")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    for k, v in BUDGETS[args.budget].items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    if args.quick:
        args.lengths, args.steps = [20], 150
    paper = args.budget == "paper"
    stem = "adding_problem_paper" if paper else "adding_problem"
    ckpts = args.out / f"{stem}_checkpoints" if paper else None
    deadline = time.time() + 3600 * args.hours if args.hours else None

    if args.status:
        return _status(ckpts if paper else None)
    t0 = time.perf_counter()
    if args.workers > 1 and not args.only and _in_workers(argv, args) is None:
        return _stopped(args)
    model = ReluRNN(args.hidden)
    seeds = list(range(args.seeds))
    results = {}
    for length in args.lengths:
        x0, _ = adding_batch(jax.random.key(0), 1, length)
        params = model.init(jax.random.key(0), x0)["params"]
        space = pj.trace(lambda p, x: model.apply({"params": p}, x), params, x0)
        opts = {k: v for k, v in optimisers(space).items() if not args.only or k in args.only}
        if not opts:
            raise SystemExit(f"--only {args.only}: no such optimiser (choose from {list(optimisers(space))})")
        results[length] = {}
        total = len(opts) * (args.evals + (PILOT_EVALS if paper else 0))
        with tqdm(total=total, desc=f"T = {length}", unit="chunk") as bar:
            for name, (tx, grid) in opts.items():
                bar.set_postfix_str(name)
                kw = {"length": length, "batch": args.batch, "bar": bar, "deadline": deadline}
                if paper:
                    out = found_grid_run(model, tx, grid, seeds, args, ckpts / f"T{length}_{_slug(name)}", kw)
                else:
                    lrs = list(grid[1:2] if args.quick else grid)
                    out = train(model, tx, lrs, seeds, steps=args.steps, evals=args.evals, **kw)
                    out = None if out is None else {"lrs": lrs, **dict(zip(("val", "test"), out, strict=True))}
                if out is None:
                    return _stopped(args)
                results[length][name] = _summary(out)

    elapsed = time.perf_counter() - t0
    _table(results, args, elapsed)
    if args.only:
        return results  # the checkpoints stay for the run that assembles every optimiser
    args.out.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    json_path = args.out / f"{stem}.json"
    json_path.write_text(json.dumps({"config": config, "seconds": elapsed, "results": results}, allow_nan=True))
    png_path = args.out / f"{stem}.png"
    _plot(results, args, png_path)
    if ckpts is not None and ckpts.exists():  # the run is complete: its checkpoints are no longer needed
        for f in ckpts.glob("*.npz"):
            f.unlink()
        ckpts.rmdir()
    print(f"table data: {json_path}\nplot: {png_path}")
    if not paper:
        print(
            "the papers' budget (T = 100, 50,000 steps, 3 seeds, rates found; about 12 hours on 2 CPU cores, "
            "resumable): python examples/adding_problem.py --budget paper --workers 2 --hours 2 (again to resume)"
        )
    return results


def found_grid_run(model, tx, grid, seeds, args, prefix: Path, kw):
    """The paper budget's run of one optimiser, its learning rates found: a pilot (one seed, 1/`PILOT_FRACTION`
    of the steps, `pilot_grid`) gives the largest rate that does not diverge; the run trains it and four rates
    below (factors of √10) and, while fewer than three of its rates from the largest that did not diverge over
    the run down are left (a late divergence), two more below. Checkpoints ``<prefix>_pilot.npz``,
    ``<prefix>_rates<k>.npz``. Returns the rates and their curves (and the pilot's), or None when stopped."""
    pilot_lrs = list(pilot_grid(grid))
    prefix.parent.mkdir(parents=True, exist_ok=True)
    out = train(model, tx, pilot_lrs, seeds[:1], steps=args.steps // PILOT_FRACTION, evals=PILOT_EVALS,
                ckpt=prefix.with_name(prefix.name + "_pilot.npz"), **kw)  # fmt: skip
    if out is None:
        return None
    pilot_val = out[0][-1]
    stable = [lr for lr, d in zip(pilot_lrs, diverged(pilot_val), strict=True) if not d]
    top = stable[0] if stable else pilot_lrs[-1]
    lrs, curves, k = [], [], 0
    while True:
        rates = [_half_decade(top, k + j) for j in range(5 if k == 0 else 2)]
        if k:
            kw["bar"].total += args.evals
        out = train(model, tx, rates, seeds, steps=args.steps, evals=args.evals,
                    ckpt=prefix.with_name(f"{prefix.name}_rates{k}.npz"), **kw)  # fmt: skip
        if out is None:
            return None
        lrs, k = lrs + rates, k + len(rates)
        curves.append(list(out))
        val, test = (np.concatenate(c, axis=2) for c in zip(*curves, strict=True))
        ok = np.flatnonzero(~diverged(val[-1]))
        if (len(ok) and len(lrs) - ok[0] >= 3) or k >= 12:
            return {"lrs": lrs, "val": val, "test": test, "pilot": {"lrs": pilot_lrs, "val": pilot_val[0].tolist()}}


def _half_decade(top: float, k: int) -> float:
    """``top`` times 10^(-k/2), rounded to one digit on the half-decades (1, 0.3, 0.1, 0.03, ...)."""
    return float(f"{10 ** (np.round(2 * np.log10(top)) / 2 - k / 2):.1g}")


def _summary(out) -> dict:
    """One optimiser's row: the rate chosen on validation errors (rates where a seed diverged excluded), its test
    errors per seed, the seeds that solve the task, and the largest rate that did not diverge."""
    lrs, val, test = out["lrs"], out["val"], out["test"]
    bad = diverged(val[-1])
    best = int(np.argmin(np.where(bad, np.inf, val[-1].mean(0))))
    stable = [lr for lr, d in zip(lrs, bad, strict=True) if not d]
    return {**{k: v for k, v in out.items() if k not in ("val", "test")}, "lr": lrs[best], "best": best,
            "val": val.tolist(), "test": test.tolist(), "test_mse": test[-1, :, best].tolist(),
            "diverged": bad.tolist(), "largest_stable_lr": max(stable, default=None),
            "solved": int(np.sum(test[-1, :, best] < SOLVED))}  # fmt: skip


def _in_workers(argv, args):
    """Train every optimiser in ``args.workers`` single-threaded processes (``--only``, round robin), and wait:
    True when they are done (this process then assembles from their checkpoints), None when one stopped."""
    names = list(optimisers(None))
    flags = " ".join([os.environ.get("XLA_FLAGS", ""), "--xla_cpu_multi_thread_eigen=false",
                      "intra_op_parallelism_threads=1"])  # fmt: skip
    env = {**os.environ, "XLA_FLAGS": flags, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    own = [a for i, a in enumerate(argv) if a != "--workers" and (i == 0 or argv[i - 1] != "--workers")]
    own = [a for a in own if not a.startswith("--workers=")]
    procs = [subprocess.Popen([sys.executable, __file__, *own, "--only", *names[k :: args.workers]], env=env)
             for k in range(min(args.workers, len(names)))]  # fmt: skip
    codes = [p.wait() for p in procs]
    if any(c not in (0, STOPPED) for c in codes):
        raise SystemExit(f"a worker failed (exit codes {codes})")
    return None if STOPPED in codes else True


def _status(ckpts: Path | None):
    """Print each saved run of the paper budget (pilots and rate groups): its chunks done and, per learning rate,
    the latest test errors of its seeds (inf: diverged). Reads the checkpoints only."""
    if ckpts is None or not ckpts.exists():
        raise SystemExit("--status reads the checkpoints of --budget paper: none saved in --out")
    for f in sorted(ckpts.glob("*.npz"), key=lambda f: f.stat().st_mtime):
        with np.load(f) as z:
            lrs, seeds, _, steps, _, evals = json.loads(str(z["signature"]))
            done, test = int(z["done"]), z["test"]
        print(f"{f.stem}: {done}/{evals} chunks ({done * steps // evals:,} of {steps:,} steps)")
        for j, lr in enumerate(lrs):
            print(f"  lr {lr:<8g}" + " ".join(f"{e:8.3f}" if e < 1e3 else f"{e:8.1e}" for e in test[done - 1, :, j]))
    return None


def _slug(name: str) -> str:
    return "".join(c if c.isascii() and c.isalnum() else "_" for c in name.replace("κ⁽¹⁾", "k1").replace("κ⁽²⁾", "k2"))


def _stopped(args):
    print(f"\nstopped after --hours {args.hours}: the state is saved; run the same command again to resume")
    return None


def _table(results, args, elapsed):
    print(f"\nTest mean squared error after {args.steps} steps, mean ± std over {args.seeds} seeds, at the learning "
          f"rate chosen on validation sequences (in brackets), and the seeds that solve the task (test error "
          f"below {SOLVED}); always predicting 1: 0.167\n")  # fmt: skip
    names = list(next(iter(results.values())))
    print(f"{'':<8}" + "".join(f"{n:>30}" for n in names))
    for length, runs in results.items():
        cells = [f"{np.mean(r['test_mse']):.4f} ± {np.std(r['test_mse']):.4f} ({r['lr']:g}) {r['solved']}/{args.seeds}"
                 for r in runs.values()]  # fmt: skip
        print(f"{'T = ' + str(length):<8}" + "".join(f"{c:>30}" for c in cells))
        stable = [f"{r['largest_stable_lr']:g}" if r["largest_stable_lr"] else "none" for r in runs.values()]
        print(f"{'stable ≤':<8}" + "".join(f"{c:>30}" for c in stable))
    if args.budget == "paper":  # the claim depends on the rates: every one trained, per optimiser
        print(f"\nPer learning rate: test error (mean over seeds) and seeds that solve the task; diverged: a seed's "
              f"validation error non-finite or above {DIVERGED}; –: not trained\n")  # fmt: skip
        for length, runs in results.items():
            print(f"{'T = ' + str(length):<8}" + "".join(f"{n:>30}" for n in names))
            for lr in sorted({lr for r in runs.values() for lr in r["lrs"]}, reverse=True):
                print(f"{lr:<8g}" + "".join(f"{_rate_cell(r, lr, args.seeds):>30}" for r in runs.values()))
    print(f"\n({elapsed:.0f} s in this process)")


def _rate_cell(r, lr, seeds) -> str:
    if lr not in r["lrs"]:
        return "–"
    j = r["lrs"].index(lr)
    if r["diverged"][j]:
        return "diverged"
    err = np.asarray(r["test"])[-1, :, j]
    return f"{err.mean():.3f} {int(np.sum(err < SOLVED))}/{seeds}"


def _plot(results, args, path):
    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4.2), squeeze=False, sharey=True)
    for ax, (length, runs) in zip(axes[0], results.items(), strict=True):
        for i, (name, r) in enumerate(runs.items()):
            err = np.asarray(r["test"])[:, :, r["best"]]  # (evals, seeds)
            at = np.arange(1, len(err) + 1) * args.steps // len(err)
            style = "--" if "Adam" in name else "-"
            ax.plot(at, err.mean(1), style, color=f"C{i}", label=f"{name} (lr {r['lr']:g}, {r['solved']} solved)")
            if len(err[0]) > 1:
                ax.fill_between(at, err.min(1), err.max(1), color=f"C{i}", alpha=0.12, lw=0)
        ax.axhline(1 / 6, color="grey", lw=0.8)
        ax.axhline(SOLVED, color="grey", lw=0.8, ls=":")
        ax.set(title=f"T = {length}", xlabel="step", yscale="log")
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)  # below the curves
    axes[0, 0].set_ylabel("test mean squared error")
    fig.suptitle(f"Adding problem, ReLU RNN h={args.hidden}: mean and range over {args.seeds} seeds\n"
                 f"(grey: predicting 1; dotted: solved)", fontsize=11)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")


if __name__ == "__main__":
    sys.exit(STOPPED if main() is None else 0)
