"""pathspace_jax's transformations inside ``optax.partition`` / ``optax.masked``: `path_labels` for the partition, and
`accept_masked`, which lets a path-space transformation take the masked trees those hand it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from pathspace_jax.frames import on_mesh_of
from pathspace_jax.graph import check_path_space

__all__ = ["path_labels", "accept_masked", "unmask", "remask"]


def path_labels(space, params=None, *, path: str = "path", other: str = "other"):
    """Labels for ``optax.partition``: ``path`` at the edge leaves of the traced network, ``other`` elsewhere.

    The edge leaves (roles ``u -> v`` in `pathspace_jax.describe`) are the parameters of the positively
    homogeneous part, which path-space transformations act on together; the leaves of kind ``"other"``
    ("not an edge": a LayerNorm scale, a learned temperature) can go to another optimizer::

        tx = optax.partition({"path": pj.g_sgd(space, 0.05), "other": optax.adam(1e-3)},
                             pj.path_labels(space, params))

    Args:
      space: the `PathSpace` of the whole model.
      params: a params tree to label (its structure is used: nnx states, plain dicts); None for the
        traced structure. An nnx ``State`` of ``Param`` variables is labelled in its pure form
        (``nnx.as_pure``): the structure in which ``nnx.Optimizer`` passes the updates, and which its ``init``
        on the ``State`` accepts too, so ``nnx.Optimizer(model, optax.partition(..., pj.path_labels(space,
        state)), wrt=nnx.Param)`` works as written.
      path, other: the two labels.

    Returns:
      A pytree of strings with the structure of ``params`` (or of the traced params).
    """
    check_path_space(space, "path_labels")
    labels = [path if leaf.kind != "other" else other for leaf in space.leaves]
    if params is None:
        return jax.tree_util.tree_unflatten(space.treedef, labels)
    space.leaves_of(params, "params")
    if any(isinstance(x, nnx.Variable) for x in jax.tree_util.tree_leaves(params, is_leaf=_is_variable)):
        params = nnx.as_pure(params)
    return space.unflatten_like(params, labels)


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def _is_masked(x) -> bool:
    return isinstance(x, optax.MaskedNode)


def unmask(space, tree, who: str):
    """``(tree, flags)`` with masked leaves of kind "other" replaced by zeros, or ``(tree, None)``.

    ``optax.partition`` and ``optax.masked`` hand a transformation its trees with the leaves of other
    labels replaced by ``optax.MaskedNode``. Path-space transformations need every edge of the network
    (coordinates, κ and the balanced frame involve them all), so a masked edge leaf is an error; masked
    leaves of kind "other", which they pass through anyway, get placeholders here and are masked again in
    the result (`_remask`).
    """
    if tree is None:
        return tree, None
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=_is_masked)
    flags = tuple(_is_masked(x) for x in leaves)
    if not any(flags) or len(leaves) != len(space.leaves):
        return tree, None  # nothing masked (or another structure, which leaves_of reports)
    edges = [leaf.path for leaf, f in zip(space.leaves, flags) if f and leaf.kind != "other"]
    if edges:
        raise ValueError(
            f"{who}: optax.partition / optax.masked masked edge leaves of the network: {edges}. Path-space "
            "transformations act on every edge of the positively homogeneous part at once (path coordinates and "
            "κ involve all of them): give every edge leaf this transformation's label, e.g. with "
            "pj.path_labels(space, params), and only leaves of kind 'other' another one."
        )
    filled = [jnp.zeros(leaf.shape, leaf.dtype) if f else x for x, f, leaf in zip(leaves, flags, space.leaves)]
    return jax.tree_util.tree_unflatten(treedef, filled), flags


def remask(tree, flags):
    if flags is None:
        return tree
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return jax.tree_util.tree_unflatten(treedef, [optax.MaskedNode() if f else x for x, f in zip(leaves, flags)])


def accept_masked(space, who: str, tx, *, runs_network: bool = False):
    """``tx`` that also takes the masked trees of ``optax.partition`` / ``optax.masked`` (see `unmask`).

    ``runs_network``: ``tx`` evaluates the real network (DDP-SGD's statistics), which needs the values of
    every leaf, so masked leaves in ``params`` are an error that says how to compose instead.
    """

    def init_fn(params):
        with on_mesh_of(params):
            return tx.init(unmask(space, params, who)[0])

    def update_fn(updates, state, params=None, **extra_args):
        with on_mesh_of(updates):
            return _update(updates, state, params, **extra_args)

    def _update(updates, state, params, **extra_args):
        updates, flags = unmask(space, updates, who)
        params, pflags = unmask(space, params, who)
        if runs_network and pflags is not None:
            masked = [leaf.path for leaf, f in zip(space.leaves, pflags) if f]
            raise ValueError(
                f"{who}: optax.partition / optax.masked hid the values of {masked}, but DDP-SGD's node statistics "
                "(alpha > 0) run the whole network, which needs them. Scale the whole tree, then split: "
                "optax.chain(pj.scale_by_ddp(space, alpha=...), optax.partition({'path': optax.sgd(lr), "
                "'other': ...}, pj.path_labels(space, params))); scale_by_ddp passes the leaves of kind 'other' "
                "through unscaled."
            )
        new, state = tx.update(updates, state, params, **extra_args)
        return remask(new, flags), state

    return type(tx)(init_fn, update_fn)


# ---------------------------------------------------------------------------- κ scaling (Path-SGD, DDP-SGD)
