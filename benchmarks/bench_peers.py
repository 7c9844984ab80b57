"""The public PyTorch G-SGD and Path-SGD against ours, on the same machine, in the same process.

The peer is the G-SGD code of Meng et al. ("G-SGD: Optimizing ReLU neural networks in its positively
scale-invariant space", ICLR 2019), published at github.com/MSRA-COLT/gsgd (its ``gsgd_mlp/opt/
gopt_general_mlp.py``, eager PyTorch, bias-free MLPs only). It is not a dependency and is not vendored:
clone it anywhere and pass the folder. PyTorch is needed for this script only.

The model is the 784-512-512-10 ReLU MLP of the other benchmarks without biases (the peer supports none),
batch 128, softmax cross-entropy on fixed random inputs. Each train step (forward, backward, update) is timed
over blocks of consecutive steps in interleaved rounds: PyTorch's own ``torch.optim.SGD``, the peer's
``gSGD`` (``opt='ec'``, its G-SGD step), and ours: ``optax.sgd`` and ``pj.g_sgd`` in jitted, donated steps.
Reported: milliseconds per step (median over rounds) and each G-SGD's step as a multiple of its own
framework's SGD. Run: ``python benchmarks/bench_peers.py --msra-gsgd PATH/TO/gsgd``.

``--path-sgd PATH`` adds the published Path-SGD code of Neyshabur et al. (github.com/bneyshabur/path-sgd, its
``path_sgd.py``: ``PathSGD(model, input_dim).update_grad()`` between ``backward`` and ``torch.optim.SGD.step``)
against ``pj.path_sgd(second_order=False)``. As published it is plain SGD: ``self.params`` is a generator that
its first call consumes (computing the global ratio) before the loop that divides the gradients, so no
gradient is ever divided. It is timed with two fixes, applied from outside (its file is not changed): the
params as a list, and the squared copy's gradients zeroed before each call (``.backward()`` adds into them,
so after t steps the scaling would be t times κ). On CPU its hard-coded ``.cuda()`` on the all-ones input is
made a no-op.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).parent))
from common import make_step, time_steps, write_results  # noqa: E402

import pathspace_jax as pj  # noqa: E402

WIDTHS, BATCH = (512, 512), 128


def torch_timer(torch, model, step_fn, x, y):  # torch is imported in main() only
    """Seconds per step over a block of ``n`` torch train steps (forward, backward, update)."""
    loss_fn = torch.nn.CrossEntropyLoss()
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)

    def run(n: int) -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            model.zero_grad(set_to_none=False)
            loss_fn(model(x), y).backward()
            step_fn()
        sync()
        return (time.perf_counter() - t0) / n

    return run


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--msra-gsgd", type=Path, required=True, help="a clone of github.com/MSRA-COLT/gsgd")
    ap.add_argument("--path-sgd", type=Path, help="a clone of github.com/bneyshabur/path-sgd (optional)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=50, help="steps per timed block")
    ap.add_argument("--commit", help="the clone's commit, where the folder is not a git checkout of its own")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(os.cpu_count())
    sys.path.insert(0, str(args.msra_gsgd / "gsgd_mlp"))
    try:
        import torchvision.models  # noqa: F401  (the peer imports it and uses nothing of it)
    except (ImportError, RuntimeError):  # no torchvision matching this torch: an empty stand-in for that import
        print("torchvision is not importable: the peer's unused `import torchvision.models` gets an empty module")
        sys.modules["torchvision"] = sys.modules["torchvision.models"] = ModuleType("torchvision")
    from opt.gopt_general_mlp import gSGD  # the peer

    commit = args.commit or _commit(args.msra_gsgd)
    # PyTorch on the device JAX runs on: CUDA when JAX has a GPU
    device = "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"
    rng = np.random.default_rng(0)
    x_np = rng.standard_normal((BATCH, 784)).astype(np.float32)
    y_np = (np.arange(BATCH) % 10).astype(np.int64)

    # PyTorch: the same bias-free MLP for torch.optim.SGD and for the peer's G-SGD
    def torch_mlp():
        torch.manual_seed(0)
        sizes = (784, *WIDTHS, 10)
        layers = []
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
            layers += [torch.nn.Linear(a, b, bias=False)] + ([torch.nn.ReLU()] if i < len(WIDTHS) else [])
        return torch.nn.Sequential(*layers)

    xt, yt = torch.from_numpy(x_np).to(device), torch.from_numpy(y_np).to(device)
    m_sgd, m_gsgd = torch_mlp().to(device), torch_mlp().to(device)
    opt_sgd = torch.optim.SGD(m_sgd.parameters(), lr=0.01)
    opt_gsgd = gSGD(m_gsgd, lr=0.01, args=SimpleNamespace(device=device, opt="ec"))
    timers = {
        "torch_sgd": torch_timer(torch, m_sgd, opt_sgd.step, xt, yt),
        "msra_gsgd": torch_timer(torch, m_gsgd, opt_gsgd.step, xt, yt),
    }
    if args.path_sgd is not None:
        sys.path.insert(0, str(args.path_sgd))
        from path_sgd import PathSGD  # the published Path-SGD

        if device == "cpu":
            torch.Tensor.cuda = lambda self, *a, **k: self  # its all-ones input is moved with .cuda()
        m_path = torch_mlp().to(device)
        opt_path = torch.optim.SGD(m_path.parameters(), lr=0.01)
        path = PathSGD(m_path, 784)
        path.params = list(m_path.parameters())  # fix 1: a list, not a generator consumed by its first call

        def path_step():
            path.model.zero_grad(set_to_none=False)  # fix 2: the squared copy's gradients do not accumulate
            path.update_grad()
            opt_path.step()

        timers["published_path_sgd"] = torch_timer(torch, m_path, path_step, xt, yt)

    # ours: optax.sgd and pj.g_sgd on the same shapes
    dense_free = BiasFreeMLP(widths=WIDTHS)
    x, y = jnp.asarray(x_np), jnp.asarray(y_np)
    params = dense_free.init(jax.random.key(0), x[:1])["params"]
    space = pj.trace(lambda p, x: dense_free.apply({"params": p}, x), params, x)
    ours = {"optax_sgd": optax.sgd(0.01), "pj_g_sgd": pj.g_sgd(space, 0.01)}
    if args.path_sgd is not None:
        ours["pj_path_sgd"] = pj.path_sgd(space, 0.01, second_order=False)
    for k, tx in ours.items():
        step, state = make_step(dense_free, tx), tx.init(params)
        timers[k] = lambda n, step=step, state=state: time_steps(step, params, state, x, y, repeats=n, warmup=1)

    for run in timers.values():  # warm up (compiles ours)
        run(3)
    times = {k: [] for k in timers}
    for _ in range(args.rounds):
        for k, run in timers.items():
            times[k].append(run(args.repeats))
    ms = {k: 1e3 * float(np.median(v)) for k, v in times.items()}
    row = {k: round(v, 4) for k, v in ms.items()}
    row["msra_gsgd_vs_torch_sgd"] = round(float(np.median(np.divide(times["msra_gsgd"], times["torch_sgd"]))), 2)
    row["pj_g_sgd_vs_optax_sgd"] = round(float(np.median(np.divide(times["pj_g_sgd"], times["optax_sgd"]))), 2)
    row["msra_gsgd_vs_pj_g_sgd"] = round(ms["msra_gsgd"] / ms["pj_g_sgd"], 1)
    if args.path_sgd is not None:
        row["published_path_sgd_vs_torch_sgd"] = round(
            float(np.median(np.divide(times["published_path_sgd"], times["torch_sgd"]))), 2
        )
        row["pj_path_sgd_vs_optax_sgd"] = round(
            float(np.median(np.divide(times["pj_path_sgd"], times["optax_sgd"]))), 2
        )
        row["published_path_sgd_vs_pj_path_sgd"] = round(ms["published_path_sgd"] / ms["pj_path_sgd"], 1)
        row["published_path_sgd_commit"] = _commit(args.path_sgd)[:12] or "unknown"
    row["torch"] = f"{torch.__version__} ({device})"
    row["msra_gsgd_commit"] = commit.strip()[:12] or "unknown"
    for k, v in row.items():
        print(f"{k:28s} {v}")
    print("wrote", write_results("peers", {f"mlp_784_512_512_10_nobias_b{BATCH}_ms": row}))


def _commit(folder: Path) -> str:
    """The commit of the git checkout ``folder`` ("" when it is not the top of a checkout of its own)."""
    git = ["git", "-C", str(folder), "rev-parse"]
    top = subprocess.run([*git, "--show-toplevel"], capture_output=True, text=True).stdout.strip()
    own = top and Path(top).resolve() == folder.resolve()  # not the enclosing repository's commit
    return subprocess.run([*git, "HEAD"], capture_output=True, text=True).stdout.strip() if own else ""


class BiasFreeMLP(nn.Module):
    """The MLP of `common.MLP` without biases (the peer's G-SGD supports none)."""

    widths: tuple[int, ...] = WIDTHS

    @nn.compact
    def __call__(self, x):
        for w in self.widths:
            x = nn.relu(nn.Dense(w, use_bias=False)(x))
        return nn.Dense(10, use_bias=False)(x)


if __name__ == "__main__":
    main()
