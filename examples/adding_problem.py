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

Run:  pip install -e ".[examples]" && python examples/adding_problem.py   (--quick: under a minute)
Writes examples/out/adding_problem.json and examples/out/adding_problem.png and prints the table.
"""

from __future__ import annotations

import argparse
import json
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


def train(model, tx, lrs, seeds, *, length, steps, batch, evals, bar):
    """Train one member per (seed, learning rate). Returns the validation and test errors (mean squared error
    on 1,000 fresh sequences each) after every chunk of steps, each of shape (evals, seeds, learning rates)."""
    seed_of = np.repeat(np.asarray(seeds), len(lrs))
    lr_of = np.tile(np.asarray(lrs, np.float32), len(seeds))
    keys = jax.vmap(jax.random.key)(jnp.asarray(seed_of))
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
    def chunk(params, state, keys):  # keys: (members, steps per chunk)
        (params, state), _ = jax.vmap(lambda p, s, k: jax.lax.scan(step, (p, s), k))(params, state, keys)
        errs = [jax.vmap(mse, in_axes=(0, None, None))(params, x, y) for x, y in held_out]
        return params, state, *(jnp.where(jnp.isfinite(e), e, jnp.inf) for e in errs)

    data_keys = jax.vmap(lambda k: jax.random.split(jax.random.fold_in(k, 1), steps))(keys)
    curves = []
    for i in range(evals):
        part = data_keys[:, i * steps // evals : (i + 1) * steps // evals]
        params, state, *errs = chunk(params, state, part)
        curves.append([np.asarray(e).reshape(len(seeds), len(lrs)) for e in errs])
        bar.update()
    return (np.stack(c) for c in zip(*curves, strict=True))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[50, 100, 200])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--batch", type=int, default=50)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="T = 20, 1 learning rate, 150 steps")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "out")
    args = ap.parse_args(argv)
    if args.quick:
        args.lengths, args.steps = [20], 150
    evals = 10

    t0 = time.perf_counter()
    model = ReluRNN(args.hidden)
    seeds = list(range(args.seeds))
    results = {}
    for length in args.lengths:
        x0, _ = adding_batch(jax.random.key(0), 1, length)
        params = model.init(jax.random.key(0), x0)["params"]
        space = pj.trace(lambda p, x: model.apply({"params": p}, x), params, x0)
        opts = optimisers(space)
        results[length] = {}
        with tqdm(total=len(opts) * evals, desc=f"T = {length}", unit="chunk") as bar:
            for name, (tx, grid) in opts.items():
                bar.set_postfix_str(name)
                lrs = list(grid[1:2] if args.quick else grid)
                val, test = train(model, tx, lrs, seeds, length=length, steps=args.steps, batch=args.batch,
                                  evals=evals, bar=bar)  # fmt: skip
                best = int(np.argmin(val[-1].mean(0)))
                results[length][name] = {"lrs": lrs, "lr": lrs[best], "best": best, "val": val.tolist(),
                                         "test": test.tolist(), "test_mse": test[-1, :, best].tolist()}  # fmt: skip

    names = list(next(iter(results.values())))
    print(f"\nTest mean squared error after {args.steps} steps, mean ± std over {args.seeds} seeds, at the learning "
          f"rate chosen on validation sequences (in brackets); always predicting 1: 0.167\n")  # fmt: skip
    print(f"{'':<8}" + "".join(f"{n:>26}" for n in names))
    for length, runs in results.items():
        cells = [f"{np.mean(r['test_mse']):.4f} ± {np.std(r['test_mse']):.4f} ({r['lr']:g})" for r in runs.values()]
        print(f"{'T = ' + str(length):<8}" + "".join(f"{c:>26}" for c in cells))
    elapsed = time.perf_counter() - t0
    print(f"\n({elapsed:.0f} s)")

    args.out.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    json_path = args.out / "adding_problem.json"
    json_path.write_text(json.dumps({"config": config, "seconds": elapsed, "results": results}, allow_nan=True))

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4.2), squeeze=False, sharey=True)
    for ax, (length, runs) in zip(axes[0], results.items(), strict=True):
        for i, (name, r) in enumerate(runs.items()):
            err = np.asarray(r["test"])[:, :, r["best"]]  # (evals, seeds)
            at = np.arange(1, len(err) + 1) * args.steps // len(err)
            ax.plot(at, err.mean(1), "--" if "Adam" in name else "-", color=f"C{i}", label=f"{name} (lr {r['lr']:g})")
        ax.axhline(1 / 6, color="grey", lw=0.8)
        ax.set(title=f"T = {length}", xlabel="step", yscale="log")
        ax.legend(fontsize=7)
    axes[0, 0].set_ylabel("test mean squared error")
    fig.suptitle(f"Adding problem, ReLU RNN h={args.hidden}: mean over {args.seeds} seeds (grey: predicting 1)")
    fig.tight_layout()
    png_path = args.out / "adding_problem.png"
    fig.savefig(png_path, dpi=110)
    print(f"table data: {json_path}\nplot: {png_path}")
    return results


if __name__ == "__main__":
    main()
