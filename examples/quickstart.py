"""Quickstart: rescaling invariance on scikit-learn's handwritten digits.

1. Trace a Flax MLP into its reduction graph and print `describe`.
2. Unbalance it with a node-wise rescaling by powers of two: the function is the
   same, bit for bit, but the weights are not.
3. Train from the balanced and from the unbalanced weights with plain SGD and
   with the path-space optimisers of pathspace_jax (Path-SGD, G-SGD, DDP-SGD).
   Plain SGD trains the two very differently; the rescaling-invariant
   optimisers give the same curves.

Run:  pip install -e ".[examples]" && python examples/quickstart.py
Writes examples/out/quickstart.png and prints a table.
"""

from __future__ import annotations

import argparse
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


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64)(x))
        x = nn.relu(nn.Dense(32)(x))
        return nn.Dense(10)(x)


def load():
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    x_tr, x_te, y_tr, y_te = train_test_split(x, digits.target, test_size=0.25, random_state=0)
    mean = x_tr.mean(0)
    return jnp.asarray(x_tr - mean), jnp.asarray(y_tr), jnp.asarray(x_te - mean), jnp.asarray(y_te)


def optimisers(space, lr):
    """name -> (transformation, whether its update needs the batch as `inputs=`)."""
    return {
        "SGD": (optax.sgd(lr), False),
        "Path-SGD": (pj.path_sgd(space, lr), False),
        "G-SGD": (pj.g_sgd(space, lr), False),
        "DDP-SGD (alpha=0.5)": (pj.ddp_sgd(space, lr, alpha=0.5, estimator="probes"), True),
    }


def train(model, tx, needs_inputs, params, data, *, epochs, batch, seed):
    x_tr, y_tr, x_te, y_te = data

    def loss_fn(p, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": p}, x), y).mean()

    @jax.jit
    def step(p, s, x, y):
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        kw = {"inputs": x} if needs_inputs else {}
        u, s = tx.update(g, s, p, **kw)
        return optax.apply_updates(p, u), s, loss

    @jax.jit
    def accuracy(p):
        return (model.apply({"params": p}, x_te).argmax(-1) == y_te).mean()

    state = tx.init(params)
    rng = np.random.default_rng(seed)
    history = []
    for _ in range(epochs):
        order = rng.permutation(len(x_tr))
        losses = []
        for i in range(0, len(order) - batch + 1, batch):
            idx = order[i : i + batch]
            params, state, loss = step(params, state, x_tr[idx], y_tr[idx])
            losses.append(float(loss))
        history.append((float(np.mean(losses)), float(accuracy(params))))
    return np.array(history)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=25)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--unbalance", type=int, default=3, help="rescaling factors 2^k with |k| <= this")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "out")
    args = ap.parse_args()

    data = load()
    model = MLP()
    params = model.init(jax.random.key(0), data[0][:1])["params"]
    fn = lambda p, x: model.apply({"params": p}, x)  # noqa: E731
    space = pj.trace(fn, params, data[0][:1])
    # the skeleton (G-SGD's basis paths) is chosen by index, from the graph alone (trace's default)
    print(pj.describe(space), "\n")

    unbalanced = pj.random_rescale(space, params, jax.random.key(1), max_exponent=args.unbalance)
    same = bool(jnp.array_equal(fn(params, data[2]), fn(unbalanced, data[2])))
    print(f"unbalanced by factors up to 2^{args.unbalance}: same outputs on the test set: {same}\n")

    runs = {}
    opts = optimisers(space, args.lr)
    with tqdm(total=2 * len(opts), desc="training", unit="run") as bar:
        for name, (tx, needs_inputs) in opts.items():
            for start, p0 in (("balanced", params), ("unbalanced", unbalanced)):
                runs[name, start] = train(
                    model, tx, needs_inputs, p0, data, epochs=args.epochs, batch=args.batch, seed=0
                )
                bar.update()

    print(f"{'optimiser':<24} {'start':<11} {'final loss':>10} {'test acc':>9}  {'curves differ by':>16}")
    for (name, start), h in runs.items():
        gap = np.max(np.abs(h[:, 0] - runs[name, "balanced"][:, 0]) / h[:, 0]) if start == "unbalanced" else None
        gap_text = f"{gap:16.1e}" if gap is not None else ""
        print(f"{name:<24} {start:<11} {h[-1, 0]:>10.4f} {h[-1, 1]:>9.3f}  {gap_text}")
    print("(curves differ by: max relative difference of the training loss between the two starts)")

    args.out.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for (name, start), h in runs.items():
        style = "-" if start == "balanced" else "--"
        color = axes[0].plot(h[:, 0], style, label=f"{name}, {start}")[0].get_color()
        axes[1].plot(h[:, 1], style, color=color)
    axes[0].set(xlabel="epoch", ylabel="training loss", yscale="log", title="loss")
    axes[1].set(xlabel="epoch", ylabel="test accuracy", title="accuracy")
    axes[0].legend(fontsize=8)
    fig.suptitle("digits, MLP 64-64-32-10: balanced (solid) vs rescaled (dashed) start")
    fig.tight_layout()
    path = args.out / "quickstart.png"
    fig.savefig(path, dpi=120)
    print(f"\nplot: {path}")


if __name__ == "__main__":
    main()
