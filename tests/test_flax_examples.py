"""google/flax's official examples (`flax_examples`: mnist linen and nnx, imagenet's ResNet18 in training and
eval mode, lm1b, wmt, seq2seq, sst2, the linen and nnx VAEs, ogbg_molpcba's GraphConvNet, nnx's scan over
layers) through pathspace_jax, each in training mode with its own loss: the trace and `describe`, the function
unchanged by node-wise rescaling, 20 jitted steps of each optimiser (finite, the loss lower), and the steps
commuting with rescaling. Random numbers (dropout, the VAEs' noise, seq2seq's sampled feedback) come from key
inputs; BatchNorm's statistics are bound into the function.

The default run builds one model (the first parametrisation, see conftest); the rest are ``slow``.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
import pytest
from flax_examples import CASES

import pathspace_jax as pj

NAMES = list(CASES)  # mnist_linen first: the one the default run builds
# No hidden node by structure: BatchNorm on running statistics after every convolution (docs/models.md), LSTMs whose
# only layer after the gates is the readout (seq2seq), tanh layers (sst2), GELU blocks (nnx's scan over layers).
# Their optimisers are the plain ones.
NO_HIDDEN = ("resnet18_eval", "seq2seq", "sst2", "scan_over_layers")
RESCALABLE = [name for name in NAMES if name not in NO_HIDDEN]

OPTIMISERS = {
    "g_sgd": lambda space, case: pj.g_sgd(space, case.sgd_lr),
    "g_adam": lambda space, case: pj.g_adam(space, case.adam_lr),
    "path_sgd": lambda space, case: pj.path_sgd(space, case.sgd_lr),
    "ddp_sgd": lambda space, case: pj.ddp_sgd(space, case.sgd_lr, alpha=1.0, batch_axes=case.batch_axes()),
}


@functools.cache
def _case(name):
    return CASES[name]()


@functools.cache
def _space(name):
    case = _case(name)
    return pj.trace(case.fn, case.params, *case.inputs)


def _update_kwargs(name, optimiser):
    """DDP-SGD's update reads the batch: every positional input of the traced function (keys included)."""
    return {"inputs": _case(name).inputs, "key": jax.random.key(0)} if optimiser == "ddp_sgd" else {}


@pytest.mark.parametrize("name", NAMES)
def test_example_traces_and_rescaling_keeps_its_function(name):
    """The trace finds hidden nodes (none in `NO_HIDDEN`, which `describe` says), and random power-of-two
    rescalings of them leave the outputs (float32) unchanged, with the same dropout masks and noise (the same keys)."""
    case, space = _case(name), _space(name)
    text = pj.describe(space)
    assert text.startswith("PathSpace:"), text
    if name in NO_HIDDEN:
        assert space.num_hidden == 0 and "NO hidden node" in text, text
        return
    assert space.num_hidden > 0, text
    pj.testing.assert_function_invariant(case.fn, space, case.params, *case.inputs)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_example_path_norm_is_finite_and_unchanged_by_rescaling(name):
    """The path norm of every example (seq2seq's decoder feeds back a sampled token: a carry its |·|^2 network
    computes from values without a tracked exponent, which once changed the scan's carry from one step to the next)
    is finite and positive, and random power-of-two rescalings leave it unchanged."""
    case, space = _case(name), _space(name)
    norm = float(pj.path_norm(space, case.params))
    assert np.isfinite(norm) and norm > 0, norm
    rescaled = pj.random_rescale(space, case.params, jax.random.key(1))
    np.testing.assert_allclose(float(pj.path_norm(space, rescaled)), norm, rtol=1e-5)


@pytest.mark.slow
def test_exact_ddp_kappa_of_float32_params_with_x64_enabled():
    """DDP's exact estimator on float32 params while float64 is enabled (the tests' setting): its per-entry
    weights may be float64, its sums stay in the params' dtype (they once changed a scan's carry dtype)."""
    case = _case("vae")
    x = case.inputs[0] if len(case.inputs) == 1 else case.inputs
    kappa = pj.ddp_kappa(_space("vae"), case.params, x, alpha=0.5, key=jax.random.key(0),
                         batch_axes=case.batch_axes())  # fmt: skip
    for k, p in zip(jax.tree.leaves(kappa), jax.tree.leaves(case.params), strict=True):
        assert k.dtype == p.dtype and bool(np.all(np.isfinite(k))) and bool(np.all(k >= 0))


@pytest.mark.slow
@pytest.mark.optimised
@pytest.mark.parametrize("optimiser", list(OPTIMISERS))
@pytest.mark.parametrize("name", NAMES)
def test_example_trains_with_every_optimiser(name, optimiser):
    """20 jitted steps of the example's own loss (the same batch, dropout masks and noise at every step), at the
    example's learning rate: every loss finite, the last lower than the first."""
    case, space = _case(name), _space(name)
    tx, kw = OPTIMISERS[optimiser](space, case), _update_kwargs(name, optimiser)

    @jax.jit
    def step(p, s, kw):
        loss, g = jax.value_and_grad(case.loss)(p, *case.inputs)
        u, s = tx.update(g, s, p, **kw)
        return optax.apply_updates(p, u), s, loss

    params, state, losses = case.params, tx.init(case.params), []
    for _ in range(20):
        params, state, loss = step(params, state, kw)
        losses.append(float(loss))
    losses.append(float(jax.jit(case.loss)(params, *case.inputs)))
    assert np.all(np.isfinite(losses)), losses
    assert losses[-1] < losses[0], losses


@pytest.mark.slow
@pytest.mark.optimised
@pytest.mark.parametrize("optimiser", list(OPTIMISERS))
@pytest.mark.parametrize("name", RESCALABLE)
def test_example_steps_commute_with_rescaling(name, optimiser):
    """Three steps from the params and from two `pj.random_rescale`d copies (powers of two) end at the same function,
    up to float32 rounding (`pj.testing`'s default tolerances), on the loss without its weight decay: a sum of
    squared weights is no function of the network, and rescaling changes it."""
    case, space = _case(name), _space(name)
    pj.testing.assert_update_invariant(
        OPTIMISERS[optimiser](space, case),
        lambda p, batch: (case.data_loss or case.loss)(p, *batch),
        space,
        case.params,
        case.inputs,
        inputs=case.inputs,
        update_kwargs=_update_kwargs(name, optimiser),
        num_steps=3,
    )
