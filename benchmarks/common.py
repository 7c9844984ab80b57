"""Shared models and a timing harness for the benchmarks.

Every benchmark reports a *ratio* against plain optax measured in the same
process (same model, batch, jit), never an absolute time in a test.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import jaxlib
import optax

import pathspace_jax as pj

RESULTS = Path(__file__).parent / "results"


class MLP(nn.Module):
    """784-512-512-10 ReLU MLP."""

    widths: tuple[int, ...] = (512, 512)
    out: int = 10

    @nn.compact
    def __call__(self, x):
        for w in self.widths:
            x = nn.relu(nn.Dense(w)(x))
        return nn.Dense(self.out)(x)


class ReluRNN(nn.Module):
    """Single-layer ReLU RNN (hidden 100) read out at the last step."""

    hidden: int = 100
    out: int = 10

    @nn.compact
    def __call__(self, x):
        h = nn.RNN(nn.SimpleCell(self.hidden, activation_fn=nn.relu))(x)
        return nn.Dense(self.out)(h[:, -1])


class SmallCNN(nn.Module):
    """conv(16)-pool-conv(32)-pool-dense(10) on 28x28x1 images."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(16, (3, 3))(x))
        x = nn.max_pool(x, (2, 2), (2, 2))
        x = nn.relu(nn.Conv(32, (3, 3))(x))
        x = nn.max_pool(x, (2, 2), (2, 2))
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


def setups() -> dict[str, tuple[nn.Module, jax.Array, jax.Array]]:
    """name -> (model, inputs, integer labels) at the batch sizes of the issues."""
    k = jax.random.key(0)
    return {
        "mlp_784_512_512_10_b128": (MLP(), jax.random.normal(k, (128, 784)), jnp.arange(128) % 10),
        "relu_rnn_h100_t28_b64": (ReluRNN(), jax.random.normal(k, (64, 28, 28)), jnp.arange(64) % 10),
        "small_cnn_b64": (SmallCNN(), jax.random.normal(k, (64, 28, 28, 1)), jnp.arange(64) % 10),
    }


def optimisers(space, recurrent: bool) -> dict:
    """name -> (transformation, extra(x) for ``make_step`` or None): every optimiser the benchmarks compare."""
    out = {
        "sgd": (optax.sgd(0.01), None),
        "adam": (optax.adam(1e-3), None),
        "g_sgd": (pj.g_sgd(space, 0.01), None),
        "g_adam": (pj.g_adam(space, 1e-3), None),
        "path_sgd_k1": (pj.path_sgd(space, 0.01, second_order=False), None),
        "path_sgd_k1_every10": (pj.path_sgd(space, 0.01, second_order=False, every=10), None),
    }
    if recurrent:
        out["path_sgd_exact_k2"] = (pj.path_sgd(space, 0.01, second_order=True), None)
        out["path_sgd_exact_k2_every10"] = (pj.path_sgd(space, 0.01, second_order=True, every=10), None)
    out["ddp_sgd_a1_probe1"] = (pj.ddp_sgd(space, 0.01, alpha=1.0, num_probes=1), lambda x: {"inputs": x})
    return out


def make_step(
    model: nn.Module | Callable, tx: optax.GradientTransformation, extra: Callable[[Any], dict] | None = None
):
    """A jitted train step ``(params, opt_state, x, y) -> (params, opt_state, loss)``.

    ``model``: a linen module (applied to ``{"params": p}``) or a function ``(params, x) -> logits``.

    ``extra(x)`` gives extra keyword arguments for ``tx.update`` (e.g. ``inputs=x``). Params and
    optimizer state are donated, as in a real training loop, so XLA may update them in place (for a
    transform that keeps κ in its state this matters: without donation κ is copied every step).
    """

    apply = (lambda p, x: model.apply({"params": p}, x)) if isinstance(model, nn.Module) else model

    def loss_fn(p, x, y):
        logits = apply(p, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def step(params, opt_state, x, y):
        loss, g = jax.value_and_grad(loss_fn)(params, x, y)
        kw = extra(x) if extra is not None else {}
        updates, opt_state = tx.update(g, opt_state, params, **kw)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


def time_steps(step, params, opt_state, x, y, *, repeats: int = 50, warmup: int = 3) -> float:
    """Seconds per step of a jitted step over a block of ``repeats`` consecutive steps (compile excluded).

    The block is timed whole, as a training loop runs it, so a transform that recomputes something every
    k steps is charged its amortised cost when ``repeats`` is a multiple of k (the median of single steps
    would hide it). Works on copies (the step donates its params and state).
    """
    params, opt_state = jax.tree_util.tree_map(jnp.copy, (params, opt_state))
    for _ in range(warmup):
        params, opt_state, loss = step(params, opt_state, x, y)
    jax.block_until_ready((params, opt_state, loss))
    t0 = time.perf_counter()
    for _ in range(repeats):
        params, opt_state, loss = step(params, opt_state, x, y)
    jax.block_until_ready((params, opt_state, loss))
    return (time.perf_counter() - t0) / repeats


def host_us(step, params, opt_state, x, y, *, repeats: int = 50) -> float:
    """Microseconds that one call of the step takes to return, the device idle before it (the median of
    ``repeats``): the host's share of a step, dispatch and whatever the runtime does on the calling thread to
    launch the kernels. A step whose time is near this is host-bound: fewer kernels or buffers may shorten it,
    faster kernels do not. (Not the loop of `time_steps` without waiting: there a call also waits once a few
    steps are queued.)"""
    params, opt_state = jax.tree_util.tree_map(jnp.copy, (params, opt_state))
    times = []
    for _ in range(repeats + 3):
        jax.block_until_ready((params, opt_state))
        t0 = time.perf_counter()
        params, opt_state, _ = step(params, opt_state, x, y)
        times.append(time.perf_counter() - t0)
    return round(1e6 * sorted(times[3:])[repeats // 2], 1)


MIN_BLOCK_S = 0.02


def block_repeats(step, params, opt_state, x, y, repeats: int) -> int:
    """``repeats``, or a multiple of it, so that a block of `time_steps` lasts at least `MIN_BLOCK_S`. A GPU step
    of a small model takes 0.1 ms: twenty of them are a block of 2 ms, in which the start and end of the block
    (an idle device after `jax.block_until_ready`, the launch queue filling again) weigh as much as a few
    kernels. A multiple keeps the amortised cost of a transform that refreshes every k steps, k | repeats."""
    t = time_steps(step, params, opt_state, x, y, repeats=repeats)
    return repeats * math.ceil(MIN_BLOCK_S / (t * repeats))  # 1 when a block already lasts long enough


def step_ms(step, params, opt_state, x, y, *, rounds: int = 3, repeats: int = 20) -> float:
    """Milliseconds per step, the median of ``rounds`` blocks of `time_steps`: the baseline's absolute time
    beside the ratios, so that runs on two machines can be told apart (a ratio moves with either step)."""
    repeats = block_repeats(step, params, opt_state, x, y, repeats)
    times = sorted(time_steps(step, params, opt_state, x, y, repeats=repeats) for _ in range(rounds))
    return round(1e3 * times[len(times) // 2], 4)


def interleaved_ratio(
    step_a, step_b, params, state_a, state_b, x, y, *, rounds: int = 5, repeats: int = 20, params_b=None
) -> float:
    """Median over rounds of time(step_a) / time(step_b), alternating to cancel drift (``params_b``: step_b's
    own params, when the two models differ)."""
    repeats = block_repeats(step_b, params if params_b is None else params_b, state_b, x, y, repeats)
    ratios = []
    for _ in range(rounds):
        ta = time_steps(step_a, params, state_a, x, y, repeats=repeats)
        tb = time_steps(step_b, params if params_b is None else params_b, state_b, x, y, repeats=repeats)
        ratios.append(ta / tb)
    ratios.sort()
    return ratios[len(ratios) // 2]


def platform_name() -> str:
    """``cpu``, or the backend and the accelerator's model (``gpu-h100``, ``gpu-h200``): timings of two GPUs differ."""
    backend = jax.default_backend()
    if backend == "cpu":
        return backend
    kind = jax.devices()[0].device_kind.lower().removeprefix("nvidia ")
    return f"{backend}-" + re.sub(r"[^a-z0-9]+", "-", kind).strip("-")


def results_folder() -> Path:
    """``results/<platform>-jax<version>/`` (one folder per platform and JAX release), created if missing."""
    folder = RESULTS / f"{platform_name()}-jax{jax.__version__}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def write_results(name: str, rows: dict[str, Any]) -> Path:
    """Write ``results/<platform>-jax<version>/<name>.json`` with the platform and versions it was taken on."""
    path = results_folder() / f"{name}.json"
    path.write_text(json.dumps({"meta": run_meta(), "results": rows}, indent=2) + "\n")
    return path


def run_meta() -> dict[str, Any]:
    """The platform and versions a measurement is taken on."""
    return {
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "device_kind": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "date": datetime.date.today().isoformat(),
        **{m.__name__: m.__version__ for m in (jaxlib, optax, flax)},
    }
