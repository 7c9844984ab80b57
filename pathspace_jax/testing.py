"""chex-based assertions that users can call in their own tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import chex
import jax
import numpy as np

from pathspace_jax.graph import PathSpace
from pathspace_jax.rescale import random_rescale

__all__ = ["assert_function_invariant"]


def assert_function_invariant(
    fn: Callable[..., Any],
    space: PathSpace,
    params,
    *args,
    key=None,
    num_draws: int = 3,
    max_exponent: int = 4,
    rtol: float = 1e-6,
    atol: float = 0.0,
    **kwargs,
) -> None:
    """Assert that ``fn`` is unchanged by random node-wise rescalings of ``params``.

    Draws ``num_draws`` power-of-two rescalings (exact in floating point), and
    checks with chex that ``fn(T_α(params), *args)`` equals ``fn(params, *args)``
    while ``T_α(params)`` differs from ``params`` (so the check cannot pass
    vacuously). A space without hidden nodes fails the second check: there is
    nothing to test.

    Raises:
      AssertionError: with chex's description of the first mismatch.
    """
    if space.num_hidden == 0:
        raise AssertionError("the PathSpace has no hidden nodes: rescaling changes nothing, nothing to test")
    key = jax.random.key(0) if key is None else key
    expected = fn(params, *args, **kwargs)
    for k in jax.random.split(key, num_draws):
        scaled = random_rescale(space, params, k, max_exponent=max_exponent)
        changed = any(
            not np.array_equal(np.asarray(a), np.asarray(b))
            for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(scaled))
        )
        if not changed:
            raise AssertionError("random_rescale left params unchanged: the rescaling test would be vacuous")
        chex.assert_trees_all_close(fn(scaled, *args, **kwargs), expected, rtol=rtol, atol=atol)
