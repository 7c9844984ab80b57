"""Flax ``TrainState`` with optimizers that need more than the gradient (DDP-SGD's batch)."""

from __future__ import annotations

import optax

__all__ = ["apply_gradients"]


def apply_gradients(state, *, grads, **extra_args):
    """``state.apply_gradients(grads=grads)`` that passes ``extra_args`` to the optimizer's ``update``.

    ``flax.training.train_state.TrainState.apply_gradients`` calls ``tx.update(grads, opt_state, params)``
    and uses its keyword arguments to replace fields of the state, so DDP-SGD's ``inputs=`` (and
    ``key=``) cannot reach the optimizer through it. This does the same step with them passed on; it
    works with any subclass of ``TrainState`` (extra fields such as ``batch_stats`` are kept).

    Args:
      state: a ``flax.training.train_state.TrainState`` (or subclass) whose ``tx`` is e.g. `pj.ddp_sgd`.
      grads: gradients with the structure of ``state.params``.
      **extra_args: passed to ``state.tx.update`` (``inputs=x``, ``key=k`` for DDP-SGD).

    Returns:
      The new state: ``step + 1``, updated ``params`` and ``opt_state``.

    Example:
      >>> state = TrainState.create(apply_fn=model.apply, params=params, tx=pj.ddp_sgd(space, 0.1, alpha=1.0))
      >>> state = pj.apply_gradients(state, grads=grads, inputs=x)
    """
    updates, opt_state = state.tx.update(grads, state.opt_state, state.params, **extra_args)
    return state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates), opt_state=opt_state)
