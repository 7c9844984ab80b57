"""An MLP and a CNN on the handwritten digits with every optimiser, and DDP-Normalization against batch norm.

Two parts, on scikit-learn's handwritten digits (1,797 images of 8×8 pixels), for a ReLU MLP
(64-100-100-10) and a ReLU CNN (two unpadded 3×3 convolutions of 16 and 32 channels, 2×2 average
pooling, a dense read-out), both with Flax's standard initialisation:

1. **Optimisers**: SGD, Path-SGD (Neyshabur, Salakhutdinov & Srebro, "Path-SGD: Path-Normalized
   Optimization in Deep Neural Networks", NeurIPS 2015), G-SGD and G-Adam ("Path Space for Recurrent
   Neural Networks with ReLU Activations"; Meng et al., "G-SGD: Optimizing ReLU Neural Networks in its
   Positively Scale-Invariant Space", ICLR 2019), DDP-SGD at α = 0, 0.5 and 1 (Neyshabur, Salakhutdinov,
   Tomioka & Srebro, "Data-dependent path normalization in neural networks", ICLR 2016: α = 0 is
   Path-SGD's κ, α = 1 the diagonal natural gradient), and Adam.
2. **Normalisations**, all trained with SGD: the network with ``flax.linen.BatchNorm`` after every
   hidden layer (Ioffe & Szegedy, 2015), and DDP-Normalization (`pathspace_jax.ddp_normalize`, the
   same paper's §4) of the plain network at α = 0 (unit-wise path normalisation, no data), α = 0.5,
   and α = 1 with the variance and the bias as shift (batch normalisation without its scale). Both
   are evaluated with the statistics of the whole training set (for DDP-Normalization, the plain
   weights of `pathspace_jax.ddp_normalized_weights`).

The digits are split 60/15/25 into training, validation and test sets (stratified, fixed); batch 64;
every configuration of one method (seeds × learning rates) trains at once (``jax.vmap``, one member
per seed and learning rate, ``optax.inject_hyperparams``); the learning rate is chosen on the
validation split and the table gives the test error of the last epoch, mean ± std over the seeds.

Run:  pip install -e ".[examples]" && python examples/digits_mlp_cnn.py   (--quick: under a minute)
Writes examples/out/digits_mlp_cnn.json and examples/out/digits_mlp_cnn.png and prints the table.
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
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import pathspace_jax as pj

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SGD_GRID = (1.0, 0.3, 0.1)
ADAM_GRID = (3e-3, 1e-3, 3e-4)


class MLP(nn.Module):
    batch_norm: bool = False

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = x.reshape(x.shape[0], -1)
        for width in (100, 100):
            x = nn.Dense(width)(x)
            if self.batch_norm:  # momentum 0: the running statistics are those of the last batch seen (see _predict)
                x = nn.BatchNorm(use_running_average=not train, momentum=0.0)(x)
            x = nn.relu(x)
        return nn.Dense(10)(x)


class CNN(nn.Module):
    batch_norm: bool = False

    @nn.compact
    def __call__(self, x, train: bool = True):
        for channels in (16, 32):
            x = nn.Conv(channels, (3, 3), padding="VALID")(x)
            if self.batch_norm:
                x = nn.BatchNorm(use_running_average=not train, momentum=0.0)(x)
            x = nn.relu(x)
        x = nn.avg_pool(x, (2, 2), (2, 2))
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


MODELS = {"MLP": MLP, "CNN": CNN}


def load():
    """Pixels in [0, 1] minus the training mean, as (n, 8, 8, 1) images; the train, validation and test splits."""
    digits = load_digits()
    x, y = (digits.data / 16.0).astype(np.float32), digits.target
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.25, stratify=y, random_state=0)
    x_tr, x_va, y_tr, y_va = train_test_split(x_tr, y_tr, test_size=0.2, stratify=y_tr, random_state=0)
    mean = x_tr.mean(0)
    return {
        split: (jnp.asarray((a - mean).reshape(-1, 8, 8, 1)), jnp.asarray(b))
        for split, (a, b) in {"train": (x_tr, y_tr), "val": (x_va, y_va), "test": (x_te, y_te)}.items()
    }


class Method:
    """One line of the table: how to initialise, compute the training logits and predict, and the optimiser.

    ``logits(p, x)`` is the training-mode function; ``predict(p, x_train, x)`` the evaluation-mode one (with
    the statistics of the whole training set where the method normalises)."""

    def __init__(self, init, logits, predict, tx, grid, needs_inputs=False):
        self.init, self.logits, self.predict = init, logits, predict
        self.tx, self.grid, self.needs_inputs = tx, grid, needs_inputs


def methods(name, x):
    """name -> Method, for the model ``name``; ``x`` is an example batch."""
    model, bn_model = MODELS[name](), MODELS[name](batch_norm=True)
    init = lambda k: model.init(k, x)["params"]
    apply = lambda p, x: model.apply({"params": p}, x)
    space = pj.trace(apply, init(jax.random.key(0)), x)
    inject = optax.inject_hyperparams
    static = ("alpha", "num_probes")  # they choose DDP's program: Python values, not injected arrays

    def plain(tx, grid, needs_inputs=False):
        return Method(init, apply, lambda p, x_tr, x: apply(p, x), tx, grid, needs_inputs)

    out = {
        "SGD": plain(inject(optax.sgd)(learning_rate=0.0), SGD_GRID),
        "Path-SGD": plain(inject(pj.path_sgd)(space, learning_rate=0.0), SGD_GRID),
        "G-SGD": plain(inject(pj.g_sgd)(space, learning_rate=0.0), SGD_GRID),
        **{
            f"DDP-SGD α={a:g}": plain(inject(pj.ddp_sgd, static_args=static)(space, 0.0, alpha=a), SGD_GRID, True)
            for a in (0.0, 0.5, 1.0)
        },
        "Adam": plain(inject(optax.adam)(learning_rate=0.0), ADAM_GRID),
        "G-Adam": plain(inject(pj.g_adam)(space, learning_rate=0.0), ADAM_GRID),
    }

    def bn_init(k):
        return bn_model.init(k, x)  # params and batch_stats

    def bn_logits(v, x):
        return bn_model.apply(v, x, mutable=["batch_stats"])[0]

    def bn_predict(v, x_tr, x):  # the batch statistics of the whole training set, then evaluation mode
        _, stats = bn_model.apply(v, x_tr, mutable=["batch_stats"])
        return bn_model.apply({**v, **stats}, x, train=False)

    sgd = inject(optax.sgd)(learning_rate=0.0)
    # the batch statistics are not trained: they are recomputed on every batch (bn_logits) and for evaluation
    part = lambda v: {
        "params": jax.tree.map(lambda _: "p", v["params"]),
        "batch_stats": jax.tree.map(lambda _: "s", v["batch_stats"]),
    }
    bn_tx = optax.multi_transform({"p": sgd, "s": optax.set_to_zero()}, part)
    out["BatchNorm"] = Method(bn_init, bn_logits, bn_predict, bn_tx, SGD_GRID)
    for a, moment, center in ((0.0, "second", False), (0.5, "second", False), (1.0, "variance", True)):
        fn_tilde = pj.ddp_normalize(space, alpha=a, moment=moment, center=center)
        weights = lambda w, x_tr, a=a, moment=moment, center=center: pj.ddp_normalized_weights(
            space, w, x_tr, alpha=a, moment=moment, center=center
        )
        predict = lambda w, x_tr, x, weights=weights: apply(weights(w, x_tr), x)
        label = f"DDP-Norm α={a:g}" + (" (var, shift)" if center else "")
        out[label] = Method(init, fn_tilde, predict, sgd, SGD_GRID)
    return out


def _lr_state(state):
    """The injected hyperparameters of the SGD inside a BatchNorm method's multi_transform state, or the state's."""
    return state.inner_states["p"].inner_state if hasattr(state, "inner_states") else state


def train(method, lrs, seeds, data, *, epochs, batch, bar):
    """Train one member per (seed, learning rate) at once. Returns the validation and test errors after every
    epoch, each of shape (epochs, seeds, learning rates), and the training loss per epoch."""
    (x_tr, y_tr), (x_va, y_va), (x_te, y_te) = data["train"], data["val"], data["test"]
    seed_of = np.repeat(np.asarray(seeds), len(lrs))
    lr_of = np.tile(np.asarray(lrs, np.float32), len(seeds))
    params = jax.vmap(method.init)(jax.vmap(jax.random.key)(jnp.asarray(seed_of)))
    tx = method.tx
    state = jax.vmap(tx.init)(params)
    _lr_state(state).hyperparams["learning_rate"] = jnp.asarray(lr_of)

    def loss_fn(p, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(method.logits(p, x), y).mean()

    def step(p, s, idx):
        x, y = x_tr[idx], y_tr[idx]
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        u, s = tx.update(g, s, p, **({"inputs": x} if method.needs_inputs else {}))
        return optax.apply_updates(p, u), s, loss

    def error(p, x, y):  # a member whose outputs are not finite counts as wrong everywhere
        logits = method.predict(p, x_tr, x)
        return jnp.where(jnp.all(jnp.isfinite(logits)), (logits.argmax(-1) != y).mean(), 1.0)

    @jax.jit
    def epoch(params, state, idx):  # idx: (steps, members, batch)
        def body(carry, i):
            p, s, loss = jax.vmap(step)(*carry, i)
            return (p, s), loss

        (params, state), losses = jax.lax.scan(body, (params, state), idx)
        errs = [jax.vmap(error, in_axes=(0, None, None))(params, x, y) for x, y in ((x_va, y_va), (x_te, y_te))]
        return params, state, losses.mean(0), *errs

    rngs = [np.random.default_rng(int(s)) for s in seed_of]
    steps = len(x_tr) // batch
    curves = []
    for _ in range(epochs):
        idx = np.stack([r.permutation(len(x_tr))[: steps * batch].reshape(steps, batch) for r in rngs], axis=1)
        params, state, *out = epoch(params, state, jnp.asarray(idx))
        curves.append([np.asarray(o).reshape(len(seeds), len(lrs)) for o in out])
        bar.update()
    loss, val, test = (np.stack(c) for c in zip(*curves, strict=True))
    return np.where(np.isfinite(loss), loss, np.inf), val, test


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument("--quick", action="store_true", help="the MLP, 2 seeds, 1 learning rate, 3 epochs")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "out")
    args = ap.parse_args(argv)
    if args.quick:
        args.epochs, args.seeds, args.models = 3, 2, ["MLP"]

    t0 = time.perf_counter()
    data = load()
    seeds = list(range(args.seeds))
    results = {}
    for name in args.models:
        ms = methods(name, data["train"][0][:2])
        results[name] = {}
        with tqdm(total=len(ms) * args.epochs, desc=name, unit="epoch") as bar:
            for label, method in ms.items():
                bar.set_postfix_str(label)
                lrs = list(method.grid[1:2] if args.quick else method.grid)
                loss, val, test = train(method, lrs, seeds, data, epochs=args.epochs, batch=args.batch, bar=bar)
                best = int(np.argmin(val[-1].mean(0)))
                results[name][label] = {"lrs": lrs, "lr": lrs[best], "best": best, "loss": loss.tolist(),
                                        "val": val.tolist(), "test": test.tolist(),
                                        "test_error": test[-1, :, best].tolist()}  # fmt: skip

    labels = list(next(iter(results.values())))
    print(f"\nTest error (%) of the last epoch, mean ± std over {args.seeds} seeds, at the learning rate chosen on the "
          f"validation split (in brackets)\n")  # fmt: skip
    print(f"{'':<28}" + "".join(f"{n:>24}" for n in results))
    for label in labels:
        cells = []
        for runs in results.values():
            r = runs[label]
            cells.append(f"{100 * np.mean(r['test_error']):.2f} ± {100 * np.std(r['test_error']):.2f} ({r['lr']:g})")
        print(f"{label:<28}" + "".join(f"{c:>24}" for c in cells))
    elapsed = time.perf_counter() - t0
    print(f"\n({elapsed:.0f} s)")

    args.out.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    json_path = args.out / "digits_mlp_cnn.json"
    json_path.write_text(json.dumps({"config": config, "seconds": elapsed, "results": results}, allow_nan=True))

    fig, axes = plt.subplots(2, len(results), figsize=(6.5 * len(results), 8.5), squeeze=False)
    for col, (name, runs) in enumerate(results.items()):
        for row, part in enumerate((labels[:8], labels[8:])):
            ax = axes[row, col]
            for i, label in enumerate(part):
                r = runs[label]
                err = 100 * np.asarray(r["test"])[:, :, r["best"]]
                epochs = np.arange(1, len(err) + 1)
                ax.plot(epochs, err.mean(1), "--" if "Adam" in label else "-", color=f"C{i}",
                        label=f"{label} (lr {r['lr']:g})")  # fmt: skip
            title = "optimisers" if row == 0 else "normalisations, trained with SGD"
            ax.set(title=f"{name}: {title}", xlabel="epoch", ylabel="test error (%)", yscale="log")
            ax.legend(fontsize=7)
    fig.suptitle(f"Handwritten digits: mean test error over {args.seeds} seeds")
    fig.tight_layout()
    png_path = args.out / "digits_mlp_cnn.png"
    fig.savefig(png_path, dpi=110)
    print(f"table data: {json_path}\nplot: {png_path}")
    return results


if __name__ == "__main__":
    main()
