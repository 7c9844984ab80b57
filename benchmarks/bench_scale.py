"""Every optimiser on the shapes users train, against ``optax.sgd`` and ``optax.adam``, with memory.

Models: the stacked ReLU-RNN language model of the path-space-for-RNNs paper (Section 5.2: embedding 400,
two layers of hidden 1550, vocabulary 50; the sequence shortened to 16 characters at batch 32 so that a CPU
run stays short), a wider MLP 784-2048-2048-10 (batch 128) and a residual CNN (two residual blocks of 32
channels, batch 64). Each is traced whole, embedding and decoder included, and every optimiser runs on all
of its parameters. Optimisers: ``g_sgd``, ``g_adam``, ``path_sgd`` with κ⁽¹⁾ every step and every 10 steps,
the exact κ⁽¹⁾ + κ⁽²⁾ every step and every 10 steps (recurrent models), and ``ddp_sgd`` at α = 1 with one
probe.

Times: the jitted, donated train step (`common.make_step`), every optimiser timed in turn within a round
(a block of about a second of steps, 10 for ``every=10`` so that its recomputation is amortised), the
median over rounds of its time per step divided by SGD's (and Adam's) in the same round. Memory: the optimizer
state in bytes, and the peak of the compiled step (XLA's temporaries plus arguments and outputs, from
``memory_analysis``), both as ratios to SGD's. Then step time against batch size and width on MLPs
784-w-w-10 for SGD, Adam, G-SGD and G-Adam, with a plot. Run: ``python benchmarks/bench_scale.py``
(``--quick``: fewer rounds and no sweep).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).parent))
from common import MLP, make_step, optimisers, results_folder, time_steps, write_results  # noqa: E402

import pathspace_jax as pj  # noqa: E402


class StackedLM(nn.Module):
    """Embedding, stacked ReLU RNNs and a dense decoder (the paper's character-level language model)."""

    vocab: int = 50
    embed: int = 400
    hidden: int = 1550
    layers: int = 2

    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(self.vocab, self.embed)(ids)
        for _ in range(self.layers):
            x = nn.RNN(nn.SimpleCell(self.hidden, activation_fn=nn.relu))(x)
        return nn.Dense(self.vocab)(x)


class ResidualCNN(nn.Module):
    """conv(32) then two residual blocks (conv-relu-conv + skip, relu), pooled, and a dense classifier."""

    channels: int = 32
    blocks: int = 2

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(self.channels, (3, 3))(x))
        for _ in range(self.blocks):
            h = nn.relu(nn.Conv(self.channels, (3, 3))(x))
            x = nn.relu(x + nn.Conv(self.channels, (3, 3))(h))
            x = nn.max_pool(x, (2, 2), (2, 2))
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


def setups(seq: int = 16):
    """name -> (model, inputs, integer labels); the LM's labels are the next characters."""
    k = jax.random.key(0)
    ids = jax.random.randint(k, (32, seq + 1), 0, 50)
    return {
        f"lm_emb400_h1550x2_t{seq}_b32": (StackedLM(), ids[:, :-1], ids[:, 1:]),
        "mlp_784_2048_2048_10_b128": (MLP(widths=(2048, 2048)), jax.random.normal(k, (128, 784)), jnp.arange(128) % 10),
        "residual_cnn_b64": (ResidualCNN(), jax.random.normal(k, (64, 28, 28, 1)), jnp.arange(64) % 10),
    }


def nbytes(tree) -> int:
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree_util.tree_leaves(tree))


def peak_bytes(step, *args) -> int | None:
    """Temporaries plus arguments plus outputs of the compiled step, as XLA reports them (None if it does not)."""
    try:
        m = step.lower(*args).compile().memory_analysis()
        return int(m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes)
    except Exception:  # noqa: BLE001  (a backend without memory analysis)
        return None


def measure(name, model, x, y, *, rounds: int, budget: float) -> dict:
    params = model.init(jax.random.key(0), x[:1])["params"]
    t0 = time.perf_counter()
    space = pj.trace(lambda p, x: model.apply({"params": p}, x), params, x)
    trace_s = time.perf_counter() - t0
    recurrent = any(leaf.recurrent for leaf in space.leaves)
    row = {"num_params": space.num_params, "trace_seconds": round(trace_s, 3)}
    steps, states, mem, compile_s, reps = {}, {}, {}, {}, {}
    for k, (tx, extra) in optimisers(space, recurrent).items():
        t0 = time.perf_counter()
        steps[k] = make_step(model, tx, extra)
        states[k] = tx.init(params)
        one = time_steps(steps[k], params, states[k], x, y, repeats=1, warmup=1)  # the first call compiles
        compile_s[k] = time.perf_counter() - t0
        mem[k] = (nbytes(states[k]), peak_bytes(steps[k], params, states[k], x, y))  # compiles again: not timed
        # blocks of 10 steps charge `every=10` its amortised cost; a slow step gets short blocks
        reps[k] = 10 if "every10" in k else int(np.clip(round(budget / one), 2, 10))
    times = {k: [] for k in steps}
    for _ in range(rounds):
        for k in steps:
            times[k].append(time_steps(steps[k], params, states[k], x, y, repeats=reps[k], warmup=1))
    base = {b: np.asarray(times[b]) for b in ("sgd", "adam")}
    row["sgd_step_ms"] = round(1e3 * float(np.median(base["sgd"])), 3)
    row["adam_step_ms"] = round(1e3 * float(np.median(base["adam"])), 3)
    for k, t in times.items():
        t = np.asarray(t)
        state_b, peak_b = mem[k]
        row[k] = {
            "vs_sgd": round(float(np.median(t / base["sgd"])), 3),
            "vs_adam": round(float(np.median(t / base["adam"])), 3),
            "state_mb": round(state_b / 2**20, 2),
            "peak_vs_sgd": None if peak_b is None or mem["sgd"][1] is None else round(peak_b / mem["sgd"][1], 2),
            "build_compile_s": round(compile_s[k], 2),
        }
        print(f"{name:30s} {k:26s} {row[k]['vs_sgd']:6.2f}x sgd {row[k]['vs_adam']:6.2f}x adam "
              f"state {row[k]['state_mb']:8.2f} MB peak {row[k]['peak_vs_sgd']}x sgd", flush=True)  # fmt: skip
    return row


def sweep(widths=(256, 1024, 2048), batches=(32, 128, 512), rounds: int = 3, repeats: int = 10) -> dict:
    """ms per step of SGD, Adam, G-SGD and G-Adam on MLPs 784-w-w-10 against batch size and width."""
    out = {}
    for w in widths:
        model = MLP(widths=(w, w))
        params = model.init(jax.random.key(0), jnp.zeros((1, 784)))["params"]
        space = pj.trace(lambda p, x, model=model: model.apply({"params": p}, x), params, jnp.zeros((8, 784)))
        txs = {"sgd": optax.sgd(0.01), "adam": optax.adam(1e-3), "g_sgd": pj.g_sgd(space, 0.01),
               "g_adam": pj.g_adam(space, 1e-3)}  # fmt: skip
        steps = {k: make_step(model, tx) for k, tx in txs.items()}
        for b in batches:
            x, y = jax.random.normal(jax.random.key(1), (b, 784)), jnp.arange(b) % 10
            t = {k: [] for k in txs}
            for _ in range(rounds):
                for k, tx in txs.items():
                    t[k].append(time_steps(steps[k], params, tx.init(params), x, y, repeats=repeats, warmup=1))
            ms = {k: round(1e3 * float(np.median(v)), 4) for k, v in t.items()}
            out[f"w{w}_b{b}"] = {"width": w, "batch": b, **ms}
            print(f"MLP w={w:5d} b={b:4d}  " + "  ".join(f"{k} {v:.3f} ms" for k, v in ms.items()), flush=True)
    return out


def plot(sweep_rows: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    widths = sorted({r["width"] for r in sweep_rows.values()})
    fig, axes = plt.subplots(1, len(widths), figsize=(4 * len(widths), 3.6), sharey=False)
    for ax, w in zip(np.atleast_1d(axes), widths, strict=True):
        rows = sorted((r for r in sweep_rows.values() if r["width"] == w), key=lambda r: r["batch"])
        for i, k in enumerate(("sgd", "adam", "g_sgd", "g_adam")):
            ax.plot([r["batch"] for r in rows], [r[k] for r in rows], "--" if "adam" in k else "-", marker="o",
                    color=f"C{i}", label=k)  # fmt: skip
        ax.set(xscale="log", yscale="log", xlabel="batch", title=f"MLP 784-{w}-{w}-10")
    np.atleast_1d(axes)[0].set_ylabel("ms per train step")
    np.atleast_1d(axes)[0].legend()
    fig.suptitle(f"{jax.default_backend()}, jax {jax.__version__}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 short rounds, no sweep")
    ap.add_argument("--seq", type=int, default=16, help="the language model's sequence length")
    args = ap.parse_args(argv)
    rounds, budget = (2, 0.2) if args.quick else (5, 1.0)  # budget: seconds of one timed block, roughly
    rows = {name: measure(name, *s, rounds=rounds, budget=budget) for name, s in setups(args.seq).items()}
    if not args.quick:
        rows["mlp_sweep_ms"] = sweep()
        plot(rows["mlp_sweep_ms"], results_folder() / "scale.png")
    print("wrote", write_results("scale", rows))


if __name__ == "__main__":
    main()
