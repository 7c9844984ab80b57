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

``--gspace PATH`` adds the GSpace G-SGD (github.com/chris-je/ScaleInvariantParameterSpaces, its
``optimizers/GOptimizer.py`` with ``torch.optim.SGD``, as its own "gsgd") on a second, bias-free MLP
784-256-256-256-10: its path scaling needs four weight matrices or more.

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
    ap.add_argument(
        "--gspace", type=Path, help="a clone of github.com/chris-je/ScaleInvariantParameterSpaces (optional)"
    )
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

    # PyTorch on the device JAX runs on: CUDA when JAX has a GPU
    device = "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"

    def msra(model):
        opt = gSGD(model, lr=0.01, args=SimpleNamespace(device=device, opt="ec"))
        return opt.step

    peers = {"msra_gsgd": msra}
    if args.path_sgd is not None:
        sys.path.insert(0, str(args.path_sgd))
        from path_sgd import PathSGD  # the published Path-SGD

        if device == "cpu":
            torch.Tensor.cuda = lambda self, *a, **k: self  # its all-ones input is moved with .cuda()

        def published_path_sgd(model):
            opt, path = torch.optim.SGD(model.parameters(), lr=0.01), PathSGD(model, 784)
            path.params = list(model.parameters())  # fix 1: a list, not a generator consumed by its first call

            def step():
                path.model.zero_grad(set_to_none=False)  # fix 2: the squared copy's gradients do not accumulate
                path.update_grad()
                opt.step()

            return step

        peers["published_path_sgd"] = published_path_sgd
    rows = {f"mlp_784_512_512_10_nobias_b{BATCH}_ms": _row(torch, device, WIDTHS, peers, args)}
    rows[f"mlp_784_512_512_10_nobias_b{BATCH}_ms"]["msra_gsgd_commit"] = (args.commit or _commit(args.msra_gsgd))[
        :12
    ] or "unknown"
    if args.path_sgd is not None:
        rows[f"mlp_784_512_512_10_nobias_b{BATCH}_ms"]["published_path_sgd_commit"] = (
            _commit(args.path_sgd)[:12] or "unknown"
        )
    if args.gspace is not None:  # its path scaling needs four weight matrices or more
        sys.path.insert(0, str(args.gspace))
        from optimizers.GOptimizer import GOptimizer  # the GSpace peer

        def gspace(model):
            return GOptimizer(list(model.parameters()), torch.optim.SGD, 0.01).step  # its "gsgd"

        row = _row(torch, device, (256, 256, 256), {"gspace_gsgd": gspace}, args)
        row["gspace_commit"] = _commit(args.gspace)[:12] or "unknown"
        rows[f"mlp_784_256_256_256_10_nobias_b{BATCH}_ms"] = row
    for name, row in rows.items():
        print(name)
        for k, v in row.items():
            print(f"  {k:34s} {v}")
    print("wrote", write_results("peers", rows))


def _row(torch, device, widths, peers, args) -> dict:
    """ms per step of torch SGD, each peer (name -> a function of the torch model giving its step), optax.sgd and
    ours (pj.g_sgd, and pj.path_sgd next to a Path-SGD peer) on the bias-free 784-widths-10 MLP; and the ratios."""
    rng = np.random.default_rng(0)
    x_np = rng.standard_normal((BATCH, 784)).astype(np.float32)
    y_np = (np.arange(BATCH) % 10).astype(np.int64)

    def torch_mlp():  # the same bias-free MLP (the same init) for torch.optim.SGD and each peer
        torch.manual_seed(0)
        sizes = (784, *widths, 10)
        layers = []
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
            layers += [torch.nn.Linear(a, b, bias=False)] + ([torch.nn.ReLU()] if i < len(widths) else [])
        return torch.nn.Sequential(*layers).to(device)

    xt, yt = torch.from_numpy(x_np).to(device), torch.from_numpy(y_np).to(device)
    m_sgd = torch_mlp()
    timers = {"torch_sgd": torch_timer(torch, m_sgd, torch.optim.SGD(m_sgd.parameters(), lr=0.01).step, xt, yt)}
    for name, make in peers.items():
        model = torch_mlp()
        timers[name] = torch_timer(torch, model, make(model), xt, yt)

    model = BiasFreeMLP(widths=widths)
    x, y = jnp.asarray(x_np), jnp.asarray(y_np)
    params = model.init(jax.random.key(0), x[:1])["params"]
    space = pj.trace(lambda p, x: model.apply({"params": p}, x), params, x)
    ours = {"optax_sgd": optax.sgd(0.01), "pj_g_sgd": pj.g_sgd(space, 0.01)}
    if "published_path_sgd" in peers:
        ours["pj_path_sgd"] = pj.path_sgd(space, 0.01, second_order=False)
    for k, tx in ours.items():
        step, state = make_step(model, tx), tx.init(params)
        timers[k] = lambda n, step=step, state=state: time_steps(step, params, state, x, y, repeats=n, warmup=1)

    for run in timers.values():  # warm up (compiles ours)
        run(3)
    times = {k: [] for k in timers}
    for _ in range(args.rounds):
        for k, run in timers.items():
            times[k].append(run(args.repeats))
    ms = {k: 1e3 * float(np.median(v)) for k, v in times.items()}
    row = {k: round(v, 4) for k, v in ms.items()}

    def ratio(a, b):
        return round(float(np.median(np.divide(times[a], times[b]))), 2)

    for name in peers:
        ours_name = "pj_path_sgd" if "path_sgd" in name else "pj_g_sgd"
        row[f"{name}_vs_torch_sgd"] = ratio(name, "torch_sgd")
        row[f"{ours_name}_vs_optax_sgd"] = ratio(ours_name, "optax_sgd")
        row[f"{name}_vs_{ours_name}"] = round(ms[name] / ms[ours_name], 1)
    row["torch"] = f"{torch.__version__} ({device})"
    return row


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
