"""DDP-SGD step cost against the same jitted `optax.sgd` step, in one process.

Rows: α = 1 with one probe (the target: ≤ 2× SGD), α = 0.5 with one probe, α = 1 exact (its cost
grows with the number of outputs: one backward pass per output), α = 1 with one probe
recomputed every 10 steps, and α = 1 with one probe on a random quarter of the batch
(``probe_batch_size``, also on the RNN); on the ReLU RNN, α = 1 and α = 0.5 (the recurrent kernels' Hessian-vector
product on top) with one probe, and α = 1 exact. Run: ``python benchmarks/bench_ddp.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, str(Path(__file__).parent))
from common import interleaved_ratio, make_step, setups, step_ms, write_results  # noqa: E402

import pathspace_jax as pj  # noqa: E402


def main() -> None:
    rows = {}
    all_setups = setups()
    for name in ("mlp_784_512_512_10_b128", "small_cnn_b64", "relu_rnn_h100_t28_b64"):
        model, x, y = all_setups[name]
        params = model.init(jax.random.key(0), x[:1])["params"]
        fn = lambda p, x, model=model: model.apply({"params": p}, x)  # noqa: E731
        space = pj.trace(fn, params, x)
        sgd = optax.sgd(0.01)
        sgd_step = make_step(model, sgd)
        variants = {
            "alpha1_probes1": dict(alpha=1.0, estimator="probes", num_probes=1),
            "alpha0.5_probes1": dict(alpha=0.5, estimator="probes", num_probes=1),
            "alpha1_probes1_every10": dict(alpha=1.0, estimator="probes", num_probes=1, every=10),
            # the probe's forward and backward pass on a random quarter of the batch
            "alpha1_probes1_quarter_batch": dict(alpha=1.0, estimator="probes", probe_batch_size=x.shape[0] // 4),
            "alpha1_probes4": dict(alpha=1.0, estimator="probes", num_probes=4),
            "alpha1_probes4_every10": dict(alpha=1.0, estimator="probes", num_probes=4, every=10),
        }
        if name == "relu_rnn_h100_t28_b64":
            keep = ("alpha1_probes1", "alpha0.5_probes1", "alpha1_probes1_quarter_batch")
            variants = {k: v for k, v in variants.items() if k in keep}
        variants["alpha1_exact"] = dict(alpha=1.0, estimator="exact")  # one backward pass per output (10 here)
        out = {"sgd_step_ms": step_ms(sgd_step, params, sgd.init(params), x, y)}
        for vname, kw in variants.items():
            tx = pj.ddp_sgd(space, 0.01, **kw)
            step = make_step(model, tx, extra=lambda x: {"inputs": x})
            r = interleaved_ratio(step, sgd_step, params, tx.init(params), sgd.init(params), x, y, rounds=3, repeats=10)
            out[vname] = round(r, 3)
            print(f"{name:28s} {vname:24s} {r:6.2f}x optax.sgd", flush=True)
        rows[name] = out
    path = write_results("ddp", rows)
    print("wrote", path)


if __name__ == "__main__":
    jnp.zeros(())
    main()
