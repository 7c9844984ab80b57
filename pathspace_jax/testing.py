"""chex-based assertions that users can call in their own tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import chex
import jax
import numpy as np

from pathspace_jax.frames import eager_jit
from pathspace_jax.graph import PathSpace
from pathspace_jax.rescale import random_rescale

__all__ = ["assert_function_invariant", "assert_update_invariant", "default_tolerances"]


def assert_function_invariant(
    fn: Callable[..., Any],
    space: PathSpace,
    params,
    *args,
    key=None,
    num_draws: int = 3,
    max_exponent: int = 4,
    rtol: float | None = None,
    atol: float | None = None,
    **kwargs,
) -> None:
    """Assert that ``fn`` is unchanged by random node-wise rescalings of ``params``.

    Draws ``num_draws`` power-of-two rescalings (exact in floating point), and
    checks with chex that ``fn(T_α(params), *args)`` equals ``fn(params, *args)``
    while ``T_α(params)`` differs from ``params`` (so the check cannot pass
    vacuously). A space without hidden nodes fails the second check: there is
    nothing to test. ``rtol`` and ``atol`` default to the output's precision relative to its scale
    (`default_tolerances`).

    Raises:
      AssertionError: with chex's description of the first mismatch.
    """
    if space.num_hidden == 0:
        raise AssertionError("the PathSpace has no hidden nodes: rescaling changes nothing, nothing to test")
    key = jax.random.key(0) if key is None else key
    expected = fn(params, *args, **kwargs)
    rtol, atol = default_tolerances(expected, rtol, atol)
    for k in jax.random.split(key, num_draws):
        scaled = random_rescale(space, params, k, max_exponent=max_exponent)
        changed = any(
            not np.array_equal(np.asarray(a), np.asarray(b))
            for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(scaled))
        )
        if not changed:
            raise AssertionError("random_rescale left params unchanged: the rescaling test would be vacuous")
        chex.assert_trees_all_close(fn(scaled, *args, **kwargs), expected, rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------- update invariance


def assert_update_invariant(
    tx,
    loss_fn: Callable[..., Any],
    space: PathSpace,
    params,
    batch,
    *,
    inputs=None,
    update_kwargs: dict[str, Any] | None = None,
    num_steps: int = 1,
    key=None,
    num_draws: int = 2,
    max_exponent: int = 4,
    rtol: float | None = None,
    atol: float | None = None,
) -> None:
    """Assert that optimizer steps commute with node-wise rescaling: same function after the steps.

    For each of ``num_draws`` power-of-two rescalings T_α (exact in floating point), runs
    ``num_steps`` steps of ``tx`` from ``params`` and from ``T_α(params)``, each step being
    ``g = ∇ loss_fn(p, batch)``, ``u, s = tx.update(g, s, p, **update_kwargs)``,
    ``p = optax.apply_updates(p, u)`` (compiled with ``jax.jit``, as in training), and checks with chex
    that the traced function ``space.fn(p_final, *inputs)`` agrees from both starts. It also checks that the rescaling
    changed the parameters and that the steps moved the function (so it cannot pass vacuously).
    Works with any optax transformation: rescaling-invariant ones (G-SGD, Path-SGD, DDP-SGD) pass,
    plain SGD/Adam fail on an unbalanced rescaling.

    Args:
      tx: an ``optax.GradientTransformation`` (or ``...ExtraArgs``).
      loss_fn: ``loss_fn(params, batch) -> scalar``.
      space: the `PathSpace` of the network (``pathspace_jax.trace``).
      params: the starting parameters.
      batch: passed to ``loss_fn`` unchanged.
      inputs: positional arguments of the traced function on which the functions are compared
        (a tuple, or one array). Default: ``batch[0]`` if ``batch`` is a tuple or list, else ``batch``.
      update_kwargs: extra keyword arguments for ``tx.update`` (e.g. ``{"inputs": x}``).
      num_steps: number of optimizer steps from each start.
      key, num_draws, max_exponent: the random rescalings (see `random_rescale`).
      rtol, atol: tolerances of the comparison of function outputs; by default the outputs' precision relative
        to their scale (`default_tolerances`): rounding in a float32 Transformer's steps passes, a step that is
        not invariant (plain SGD or Adam) changes the outputs by a fair part of their scale and fails.

    Raises:
      AssertionError: with chex's description of the first mismatch.

    Example:
      >>> loss = lambda p, b: ((space.fn(p, b[0]) - b[1]) ** 2).mean()
      >>> tx = pj.g_sgd(space, 0.1)
      >>> pj.testing.assert_update_invariant(tx, loss, space, params, (x, y))
    """
    import optax  # local: keeps importing pathspace_jax.testing light

    if space.num_hidden == 0:
        raise AssertionError("the PathSpace has no hidden nodes: rescaling changes nothing, nothing to test")
    key = jax.random.key(0) if key is None else key
    kwargs = dict(update_kwargs or {})
    if inputs is None:
        inputs = batch[0] if isinstance(batch, tuple | list) else batch
    if not isinstance(inputs, tuple):
        inputs = (inputs,)
    grad_fn = jax.grad(loss_fn)
    fn = eager_jit(lambda p, xs: space.fn(p, *xs))
    # arrays (the batch, update's inputs= and key=) are arguments of the compiled step, not constants baked into
    # it; anything else (refresh_kappa, a Python bool; a batch holding Python numbers) is part of the program
    arrays = {k: v for k, v in kwargs.items() if _is_arrays(v)}
    static = {k: v for k, v in kwargs.items() if k not in arrays}
    batch_arg = batch if _is_arrays(batch) else None

    @eager_jit  # as in training; op by op, a step dispatches (and first compiles) each of its many operations alone
    def step(p, state, batch_arg, arrays):
        grads = grad_fn(p, batch if batch_arg is None else batch_arg)
        updates, state = tx.update(grads, state, p, **arrays, **static)
        return optax.apply_updates(p, updates), state

    def run(p):
        state = tx.init(p)
        for _ in range(num_steps):
            p, state = step(p, state, batch_arg, arrays)
        return fn(p, inputs)

    def differs(a, b):
        return any(
            not np.array_equal(np.asarray(x), np.asarray(y))
            for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b))
        )

    before = fn(params, inputs)
    expected = run(params)
    rtol, atol = default_tolerances(expected, rtol, atol)
    if not differs(expected, before):
        raise AssertionError("the optimizer steps left the function unchanged: the invariance test would be vacuous")
    for k in jax.random.split(key, num_draws):
        scaled = random_rescale(space, params, k, max_exponent=max_exponent)
        if not differs(params, scaled):
            raise AssertionError("random_rescale left params unchanged: the rescaling test would be vacuous")
        chex.assert_trees_all_close(run(scaled), expected, rtol=rtol, atol=atol)


def default_tolerances(outputs, rtol: float | None = None, atol: float | None = None) -> tuple[float, float]:
    """``(rtol, atol)`` for comparing ``outputs`` across rescalings, each the one given or its default.

    Default: ``rtol = max(1e-6, 64 ε)`` (ε of the outputs' floating dtype: 7.6e-6 in float32, 1e-6 in float64)
    and ``atol = rtol · max |outputs|``, so an output near 0 is held to the precision of the output's scale
    rather than to its own (a float32 Transformer's steps round at about 1e-6 of its largest logit).
    """
    leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(outputs)]
    floats = [x for x in leaves if np.issubdtype(x.dtype, np.floating) and x.size]
    eps = max((float(np.finfo(x.dtype).eps) for x in floats), default=float(np.finfo(np.float32).eps))
    rtol = max(1e-6, 64 * eps) if rtol is None else rtol
    if atol is None:
        atol = rtol * max((float(np.max(np.abs(x))) for x in floats), default=0.0)
    return rtol, atol


def _is_arrays(tree) -> bool:
    """A non-empty pytree whose leaves are all arrays."""
    leaves = jax.tree_util.tree_leaves(tree)
    return bool(leaves) and all(isinstance(x, jax.Array | np.ndarray) for x in leaves)
