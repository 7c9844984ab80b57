"""A character-level language model: a stacked ReLU RNN on the CPython documentation, every optimiser.

The language-modelling experiment of "Path Space for Recurrent Neural Networks with ReLU Activations"
(anonymous ICLR submission, §5.2: a stacked ReLU RNN on character-level Penn Treebank and enwik8) at
small scale, on text that ships with Python: the documentation topics in ``pydoc_data.topics``
(about 465,000 characters). The first 90% of the text trains, the last 10% is held out; the table
gives bits per character on the held-out text.

As in the paper, the path-space optimiser runs on the RNN (its input, recurrent and bias weights,
traced as a network of its own: the embedded characters in, the top layer's states out), and a plain
optimiser on the embedding and the decoder. Here that is SGD next to SGD, Path-SGD and G-SGD, and
Adam next to Adam and G-Adam. One `PathSpace` is traced for the RNN alone; the step applies the two
transformations to their own parts of the parameter tree.

Run:  pip install -e ".[examples]" && python examples/char_lm.py   (--quick: under a minute)
Writes examples/out/char_lm.json and examples/out/char_lm.png and prints the table.
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


class StackedReluRNN(nn.Module):
    """Layers of ReLU RNNs, each reading the sequence of states of the one below."""

    hidden: int
    layers: int

    @nn.compact
    def __call__(self, x):  # (batch, steps, features) -> (batch, steps, hidden)
        for _ in range(self.layers):
            x = nn.RNN(nn.SimpleCell(self.hidden, activation_fn=nn.relu))(x)
        return x


class CharLM(nn.Module):
    vocab: int
    embed: int
    hidden: int
    layers: int

    def setup(self):
        self.embedding = nn.Embed(self.vocab, self.embed)
        self.rnn = StackedReluRNN(self.hidden, self.layers)
        self.decoder = nn.Dense(self.vocab)

    def __call__(self, ids):
        return self.decoder(self.rnn(self.embedding(ids)))


def load_text():
    """The pydoc_data topics as character ids: the first 90% for training, the last 10% held out."""
    from pydoc_data.topics import topics

    text = "".join(topics[k] for k in sorted(topics))
    chars = sorted(set(text))
    ids = np.frombuffer(text.encode("utf-32-le"), np.uint32)
    ids = np.searchsorted(np.frombuffer("".join(chars).encode("utf-32-le"), np.uint32), ids).astype(np.int32)
    cut = int(0.9 * len(ids))
    return len(chars), ids[:cut], ids[cut:]


def optimisers(space, args):
    """name -> (transformation of the RNN's parameters, transformation of the embedding and the decoder)."""
    return {
        "SGD": (optax.sgd(args.lr), optax.sgd(args.lr)),
        "Path-SGD": (pj.path_sgd(space, args.path_lr), optax.sgd(args.lr)),
        "G-SGD": (pj.g_sgd(space, args.lr), optax.sgd(args.lr)),
        "Adam": (optax.adam(args.adam_lr), optax.adam(args.adam_lr)),
        "G-Adam": (pj.g_adam(space, args.adam_lr), optax.adam(args.adam_lr)),
    }


def train(model, params, rnn_tx, other_tx, train_ids, held_out, args, bar):
    """Returns the training loss (nats per character) of every step and the held-out bits per character after
    every chunk of steps."""

    def split(tree):
        return tree["rnn"], {k: v for k, v in tree.items() if k != "rnn"}

    def loss_fn(p, seq):
        logits = model.apply({"params": p}, seq[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, seq[:, 1:]).mean()

    def step(carry, seq):
        p, s_rnn, s_other = carry
        loss, g = jax.value_and_grad(loss_fn)(p, seq)
        (g_rnn, g_other), (p_rnn, p_other) = split(g), split(p)
        u_rnn, s_rnn = rnn_tx.update(g_rnn, s_rnn, p_rnn)
        u_other, s_other = other_tx.update(g_other, s_other, p_other)
        p = optax.apply_updates(p, {"rnn": u_rnn, **u_other})
        return (p, s_rnn, s_other), loss

    @jax.jit
    def chunk(carry, seqs):
        carry, losses = jax.lax.scan(step, carry, seqs)
        bpc = jax.vmap(lambda s: loss_fn(carry[0], s[None]))(held_out).mean() / jnp.log(2.0)
        return carry, losses, bpc

    p_rnn, p_other = split(params)
    carry = (params, rnn_tx.init(p_rnn), other_tx.init(p_other))
    rng = np.random.default_rng(0)
    per_chunk = args.steps // args.evals
    losses, bpcs = [], []
    for _ in range(args.evals):
        starts = rng.integers(0, len(train_ids) - args.length - 1, (per_chunk, args.batch))
        seqs = jnp.asarray(train_ids[starts[..., None] + np.arange(args.length + 1)])
        carry, loss, bpc = chunk(carry, seqs)
        losses.append(np.asarray(loss))
        bpcs.append(float(bpc))
        bar.update()
    return np.concatenate(losses), np.asarray(bpcs)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--evals", type=int, default=10, help="held-out evaluations over the run")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--length", type=int, default=64, help="characters per training sequence")
    ap.add_argument("--embed", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=0.03, help="learning rate of SGD and G-SGD, and of SGD beside Path-SGD")
    ap.add_argument("--path-lr", type=float, default=0.03, help="Path-SGD's learning rate (κ normalised: SGD's scale)")
    ap.add_argument("--adam-lr", type=float, default=3e-3, help="learning rate of Adam and G-Adam")
    ap.add_argument("--quick", action="store_true", help="60 steps, 2 evaluations, a shorter held-out text")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "out")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.evals = 60, 2

    t0 = time.perf_counter()
    vocab, train_ids, test_ids = load_text()
    n_held = (len(test_ids) - 1) // 256 if not args.quick else 16
    held_out = jnp.asarray(test_ids[: n_held * 256 + 1][:-1].reshape(n_held, 256))  # 256-character windows
    model = CharLM(vocab, args.embed, args.hidden, args.layers)
    params = model.init(jax.random.key(0), held_out[:1, :8])["params"]
    rnn = StackedReluRNN(args.hidden, args.layers)
    emb = jnp.zeros((1, 8, args.embed), jnp.float32)
    space = pj.trace(lambda p, e: rnn.apply({"params": p}, e), params["rnn"], emb)  # the RNN alone
    print(pj.describe(space).splitlines()[0])

    results = {}
    opts = optimisers(space, args)
    with tqdm(total=len(opts) * args.evals, desc="training", unit="chunk") as bar:
        for name, (rnn_tx, other_tx) in opts.items():
            bar.set_postfix_str(name)
            loss, bpc = train(model, params, rnn_tx, other_tx, train_ids, held_out, args, bar)
            results[name] = {"loss": np.where(np.isfinite(loss), loss, np.inf).tolist(),
                             "held_out_bpc": np.where(np.isfinite(bpc), bpc, np.inf).tolist()}  # fmt: skip

    elapsed = time.perf_counter() - t0
    print(f"\nHeld-out bits per character after {args.steps} steps of {args.batch} × {args.length} characters "
          f"({len(held_out) * 256:,} held-out characters, vocabulary {vocab})\n")  # fmt: skip
    print(f"{'optimiser':<10} {'lr (RNN, rest)':>18} {'held-out bpc':>13} {'training bpc (last 10%)':>24}")
    for name, r in results.items():
        lr = {"Adam": args.adam_lr, "G-Adam": args.adam_lr, "Path-SGD": args.path_lr}.get(name, args.lr)
        other = args.adam_lr if "Adam" in name else args.lr
        train_bpc = np.mean(r["loss"][-max(1, args.steps // 10) :]) / np.log(2)
        print(f"{name:<10} {f'{lr:g}, {other:g}':>18} {r['held_out_bpc'][-1]:>13.3f} {train_bpc:>24.3f}")
    print(f"\n({elapsed:.0f} s)")

    args.out.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    json_path = args.out / "char_lm.json"
    json_path.write_text(json.dumps({"config": config, "seconds": elapsed, "results": results}, allow_nan=True))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    at = np.arange(1, args.evals + 1) * (args.steps // args.evals)
    for i, (name, r) in enumerate(results.items()):
        ax.plot(at, r["held_out_bpc"], "--" if "Adam" in name else "-", marker="o", ms=3, color=f"C{i}", label=name)
    ax.set(xlabel="step", ylabel="held-out bits per character", title=f"pydoc_data text, {args.layers}-layer ReLU "
           f"RNN h={args.hidden}, embedding {args.embed}")  # fmt: skip
    ax.legend()
    fig.tight_layout()
    png_path = args.out / "char_lm.png"
    fig.savefig(png_path, dpi=110)
    print(f"table data: {json_path}\nplot: {png_path}")
    return results


if __name__ == "__main__":
    main()
