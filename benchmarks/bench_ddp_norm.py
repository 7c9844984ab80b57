"""DDP-Normalization step cost against the plain step and against batch normalisation, in one process.

For each setup: a jitted SGD step on ``pj.ddp_normalize(space, alpha=...)``'s ``fn_tilde`` (α = 0.5 and
α = 1 with the variance) against (a) the same SGD step on the plain network and (b) the same network
with ``flax.linen.BatchNorm`` after every hidden layer (training mode), all with the same batch.
Run: ``python benchmarks/bench_ddp_norm.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, str(Path(__file__).parent))
from common import interleaved_ratio, make_step, setups, write_results  # noqa: E402

import pathspace_jax as pj  # noqa: E402


class BatchNormMLP(nn.Module):
    """784-512-512-10 with BatchNorm after each hidden Dense."""

    @nn.compact
    def __call__(self, x):
        for w in (512, 512):
            x = nn.relu(nn.BatchNorm(use_running_average=False)(nn.Dense(w)(x)))
        return nn.Dense(10)(x)


class BatchNormCNN(nn.Module):
    """The small CNN with BatchNorm after each convolution."""

    @nn.compact
    def __call__(self, x):
        for c in (16, 32):
            x = nn.relu(nn.BatchNorm(use_running_average=False)(nn.Conv(c, (3, 3))(x)))
            x = nn.max_pool(x, (2, 2), (2, 2))
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


def main() -> None:
    rows = {}
    all_setups = setups()
    for name, bn_model in (("mlp_784_512_512_10_b128", BatchNormMLP()), ("small_cnn_b64", BatchNormCNN())):
        model, x, y = all_setups[name]
        params = model.init(jax.random.key(0), x[:1])["params"]
        fn = lambda p, x, model=model: model.apply({"params": p}, x)  # noqa: E731
        space = pj.trace(fn, params, x)
        sgd = optax.sgd(0.01)
        plain = make_step(model, sgd)
        bn_vars = bn_model.init(jax.random.key(0), x)
        stats = bn_vars["batch_stats"]

        def bn_apply(p, x, stats=stats, bn_model=bn_model):
            return bn_model.apply({"params": p, "batch_stats": stats}, x, mutable=["batch_stats"])[0]

        bn = make_step(bn_apply, sgd)
        bn_params = bn_vars["params"]
        out = {}
        for vname, kw in {
            "alpha0.5_second": dict(alpha=0.5),
            "alpha1_variance": dict(alpha=1.0, moment="variance"),
        }.items():
            step = make_step(pj.ddp_normalize(space, **kw), sgd)
            s = sgd.init(params)
            r_plain = interleaved_ratio(step, plain, params, s, s, x, y, rounds=3, repeats=10)
            # against batch normalisation: each step on its own params
            r_bn = interleaved_ratio(step, bn, params, s, sgd.init(bn_params), x, y, rounds=3, repeats=10,
                                     params_b=bn_params)  # fmt: skip
            out[vname] = {"vs_plain_sgd": round(r_plain, 3), "vs_batchnorm_sgd": round(r_bn, 3)}
            print(f"{name:28s} {vname:16s} {r_plain:6.2f}x plain SGD step, {r_bn:6.2f}x BatchNorm SGD step", flush=True)
        rows[name] = out
    path = write_results("ddp_norm", rows)
    print("wrote", path)


if __name__ == "__main__":
    jnp.zeros(())
    main()
