"""Compile time of one train step against depth, for Transformer blocks stacked with ``nn.scan``.

``nn.scan`` over layers keeps a model's program one block long however deep it is. G-SGD's update reads the
stacked leaves as they are; Path-SGD's κ and DDP-SGD's statistics run the |·|^p network and the node statistics
layer by layer (each layer's slice is a leaf of its own, `pathspace_jax.trace`) below
`pathspace_jax.program.ROLL_LAYERS` blocks, so their programs hold every layer there, and as one scan from it on.
Per depth and optimiser: building the transformation and lowering the step (``build_s``, trace included),
compiling it (``compile_s``) and the lines of StableHLO (``hlo_lines``); ``x_sgd`` is compile_s over SGD's at
that depth, measured in the same process.

Run: python benchmarks/bench_depth.py   -> benchmarks/results/<platform>-jax<version>/depth.json
"""

from __future__ import annotations

import time

import flax.linen as nn
import jax
import optax
from common import write_results

import pathspace_jax as pj

WIDTH, VOCAB, T, B = 64, 64, 32, 8
DEPTHS = (2, 4, 8, 16, 32)


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=4)(h, h)
        x = x + nn.Dense(WIDTH)(nn.relu(nn.Dense(4 * WIDTH)(nn.LayerNorm()(x))))
        return x, None


class LM(nn.Module):
    depth: int

    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(VOCAB, WIDTH)(ids)
        x, _ = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=self.depth)()(x, None)
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


def transformation(name: str, space, params):
    """(tx, whether its update takes the batch): the path part by ``name``, the rest (LayerNorm offsets, the
    embedding) by SGD, as docs/partition.md writes it."""
    if name == "sgd":
        return optax.sgd(0.1), False
    labels = pj.path_labels(space, params)
    if name == "ddp_sgd":
        split = optax.partition({"path": optax.sgd(0.1), "other": optax.sgd(0.1)}, labels)
        return optax.chain(pj.scale_by_ddp(space, alpha=0.5), split), True
    path = {"g_sgd": pj.g_sgd, "path_sgd": pj.path_sgd}[name](space, 0.1)
    return optax.partition({"path": path, "other": optax.sgd(0.1)}, labels), False


def measure(depth: int, name: str) -> dict:
    model = LM(depth)
    ids = jax.random.randint(jax.random.key(0), (B, T), 0, VOCAB)
    params = model.init(jax.random.key(1), ids)["params"]

    def fn(p, x):
        return model.apply({"params": p}, x)

    def loss(p):
        return optax.softmax_cross_entropy_with_integer_labels(fn(p, ids)[:, :-1], ids[:, 1:]).mean()

    t0 = time.perf_counter()
    space = None if name == "sgd" else pj.trace(fn, params, ids)
    tx, needs_batch = transformation(name, space, params)

    def step(p, s):
        u, s = tx.update(jax.grad(loss)(p), s, p, **({"inputs": ids} if needs_batch else {}))
        return optax.apply_updates(p, u), s

    lowered = jax.jit(step).lower(params, tx.init(params))
    t1 = time.perf_counter()
    lowered.compile()
    t2 = time.perf_counter()
    return {"build_s": t1 - t0, "compile_s": t2 - t1, "hlo_lines": len(lowered.as_text().splitlines())}


if __name__ == "__main__":
    rows = {}
    for depth in DEPTHS:
        sgd = measure(depth, "sgd")
        for name in ("sgd", "g_sgd", "path_sgd", "ddp_sgd"):
            row = sgd if name == "sgd" else measure(depth, name)
            rows[f"depth{depth}_{name}"] = {**row, "x_sgd": row["compile_s"] / sgd["compile_s"]}
            print(f"depth {depth:2d} {name:8s}", rows[f"depth{depth}_{name}"], flush=True)
    print("wrote", write_results("depth", rows))
