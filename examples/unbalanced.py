"""Rescaling invariance, shown: one network and node-wise rescaled copies of it, trained side by side.

A ReLU network computes the same function after every hidden node's incoming weights are multiplied
by c > 0 and its outgoing weights divided by c. This script takes an MLP on scikit-learn's
handwritten digits, makes copies of it rescaled node-wise by random powers of two up to 2^±8 (the same
function, bit for bit), and trains all of them at once (``jax.vmap`` over the copies, one `PathSpace`
for all) with each optimiser. SGD's and Adam's curves spread apart, since each copy is a different
starting point for them; Path-SGD's, DDP-SGD's, G-SGD's and G-Adam's coincide up to rounding,
since their steps commute with the rescaling. It runs in float64 (``--float32`` for single precision):
in float32 the copies agree to ~1e-6 at first, and like any perturbation of a training trajectory the
rounding differences grow over the run (to a few percent of the loss after 600 steps).

Run:  pip install -e ".[examples]" && python examples/unbalanced.py   (--quick: a few seconds)
Writes examples/out/unbalanced.json and examples/out/unbalanced.png and prints a table.
"""

from __future__ import annotations

import argparse
import json
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
    dtype: str = "float64"

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64, param_dtype=self.dtype)(x))
        x = nn.relu(nn.Dense(32, param_dtype=self.dtype)(x))
        return nn.Dense(10, param_dtype=self.dtype)(x)


def load(dtype):
    """The digits (8×8 images, pixels scaled to [0, 1]), a fixed 75/25 split."""
    digits = load_digits()
    x = (digits.data / 16.0).astype(dtype)
    x_tr, x_te, y_tr, y_te = train_test_split(x, digits.target, test_size=0.25, random_state=0)
    return jnp.asarray(x_tr), jnp.asarray(y_tr), jnp.asarray(x_te), jnp.asarray(y_te)


def optimisers(space, lr, adam_lr):
    """name -> (transformation, whether its update needs the batch as ``inputs=``)."""
    return {
        "SGD": (optax.sgd(lr), False),
        "Adam": (optax.adam(adam_lr), False),
        "Path-SGD": (pj.path_sgd(space, lr), False),
        "DDP-SGD (α=0.5)": (pj.ddp_sgd(space, lr, alpha=0.5), True),
        "G-SGD": (pj.g_sgd(space, lr), False),
        "G-Adam": (pj.g_adam(space, adam_lr), False),
    }


def train_copies(apply, tx, needs_inputs, copies, data, *, steps, batch, seed, eval_every):
    """Train every copy (params stacked on a leading axis) with ``tx`` on the same batches.

    Returns the training loss at every step, shape (steps, copies), and the test accuracy every
    ``eval_every`` steps, shape (steps // eval_every, copies).
    """
    x_tr, y_tr, x_te, y_te = data

    def loss_fn(p, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(apply(p, x), y).mean()

    def step(p, s, x, y):
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        u, s = tx.update(g, s, p, **({"inputs": x} if needs_inputs else {}))
        return optax.apply_updates(p, u), s, loss

    step = jax.jit(jax.vmap(step, in_axes=(0, 0, None, None)))
    accuracy = jax.jit(jax.vmap(lambda p: (apply(p, x_te).argmax(-1) == y_te).mean()))
    params, state = copies, jax.vmap(tx.init)(copies)
    rng = np.random.default_rng(seed)
    losses, accs, order = [], [], np.array([], dtype=np.int64)
    for t in range(steps):
        if len(order) < batch:
            order = rng.permutation(len(x_tr))
        idx, order = order[:batch], order[batch:]
        params, state, loss = step(params, state, x_tr[idx], y_tr[idx])
        losses.append(np.asarray(loss))
        if (t + 1) % eval_every == 0:
            accs.append(np.asarray(accuracy(params)))
    return np.stack(losses), np.stack(accs)


def spread(curves):
    """Max over steps of the relative spread (max − min) / min of the copies' losses; inf if any diverged."""
    if not np.all(np.isfinite(curves)):
        return float("inf")
    return float(np.max((curves.max(1) - curves.min(1)) / curves.min(1)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--copies", type=int, default=4, help="rescaled copies besides the original")
    ap.add_argument("--max-exponent", type=int, default=8, help="rescaling factors 2^k with |k| <= this")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.05, help="learning rate of the SGD-type optimisers")
    ap.add_argument("--adam-lr", type=float, default=1e-3, help="learning rate of Adam and G-Adam")
    ap.add_argument("--float32", action="store_true", help="train in float32 instead of float64")
    ap.add_argument("--quick", action="store_true", help="2 copies, 60 steps (a smoke test)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "out")
    args = ap.parse_args(argv)
    if args.quick:
        args.copies, args.steps = 2, 60

    dtype = "float32" if args.float32 else "float64"
    jax.config.update("jax_enable_x64", not args.float32)
    data = load(dtype)
    model = MLP(dtype)
    params = model.init(jax.random.key(0), data[0][:1])["params"]

    def apply(p, x):
        return model.apply({"params": p}, x)

    space = pj.trace(apply, params, data[0][:1])
    keys = jax.random.split(jax.random.key(1), args.copies)
    copies = [params] + [pj.random_rescale(space, params, k, max_exponent=args.max_exponent) for k in keys]
    same = all(bool(jnp.array_equal(apply(params, data[2]), apply(c, data[2]))) for c in copies)
    print(f"{len(copies)} copies (the original and {args.copies} rescaled by factors up to 2^±{args.max_exponent}); "
          f"same outputs on the test set, bit for bit: {same}")  # fmt: skip
    stacked = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *copies)

    results = {}
    eval_every = max(1, args.steps // 20)
    opts = optimisers(space, args.lr, args.adam_lr)
    for name, (tx, needs_inputs) in tqdm(opts.items(), desc="optimisers", unit="opt"):
        losses, accs = train_copies(apply, tx, needs_inputs, stacked, data, steps=args.steps, batch=args.batch,
                                    seed=0, eval_every=eval_every)  # fmt: skip
        results[name] = {"loss": losses.tolist(), "test_accuracy": accs.tolist(), "spread": spread(losses)}

    print(f"\n{'optimiser':<16} {'final loss: min':>16} {'max':>9} {'test acc: min':>14} {'max':>7}  "
          f"{'spread of the curves':>20}")  # fmt: skip
    for name, r in results.items():
        last, acc = np.asarray(r["loss"][-1]), np.asarray(r["test_accuracy"][-1])
        print(f"{name:<16} {np.nanmin(last):>16.4f} {np.nanmax(last):>9.4f} {np.nanmin(acc):>14.3f} "
              f"{np.nanmax(acc):>7.3f}  {r['spread']:>20.1e}")  # fmt: skip
    print("(spread: max over steps of (max − min) / min of the copies' training losses; inf: a copy diverged)")

    args.out.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    json_path = args.out / "unbalanced.json"
    json_path.write_text(json.dumps({"config": config, "results": results}, allow_nan=True))

    fig, axes = plt.subplots(2, 3, figsize=(13, 7), sharex=True, sharey=True)
    for ax, (name, r) in zip(axes.ravel(), results.items(), strict=True):
        curves = np.asarray(r["loss"])
        for j in range(curves.shape[1]):
            ax.plot(np.where(np.isfinite(curves[:, j]), curves[:, j], np.nan), lw=1,
                    label="original" if j == 0 else f"rescaled copy {j}")  # fmt: skip
        ax.set(title=f"{name} (spread {r['spread']:.1e})", yscale="log", ylim=(1e-3, 1e2))
    for ax in axes[-1]:
        ax.set_xlabel("step")
    for ax in axes[:, 0]:
        ax.set_ylabel("training loss")
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(f"digits MLP ({dtype}): one function, {len(copies)} node-wise rescalings (factors up to "
                 f"2^±{args.max_exponent})")  # fmt: skip
    fig.tight_layout()
    png_path = args.out / "unbalanced.png"
    fig.savefig(png_path, dpi=110)
    print(f"\ntable data: {json_path}\nplot: {png_path}")
    return results


if __name__ == "__main__":
    main()
