"""What DDP-SGD's statistics need of the inputs, and where they find the examples (``batch_axes``).

The inputs are the positional arguments of the traced function after ``params``: any pytree it takes (arrays, a
dict, a ``jraph.GraphsTuple``, nnx state, a PRNG key). ``batch_axes`` says, as ``jax.vmap``'s ``in_axes`` does, where
the examples are: a pytree prefix of the inputs tuple with 0 (the examples along the leading axis) or None (shared
by every example: a key, a scale, a mask of the model, nnx state) at each leaf. The statistics are means over the
examples, the function applied to each as a batch of one (a ``vmap`` over the batched leaves, the others passed
whole). With no batched leaf (``batch_axes=None``) the whole batch is one example: a graph batch, which has no
per-example axis (`pathspace_jax.ddp_kappa` says what the statistics then are).

An input shared by every example while others carry the examples is a constant of the network, as if the function
closed over it: the statistics and the γ² recursion (the 1 − α part) read its values, so κ is that of the closed
function at every α (a mask of the model prunes its paths, a scale is a coefficient on them). The batched inputs are
the network's inputs: γ² = 1 there, masks all True, as in `pathspace_jax.path_kappa`. Where the whole batch is one
example, its floating-point leaves (the features) are the network's inputs and the others (a graph's indices, masks,
keys) constants.
"""

from __future__ import annotations

from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np

from pathspace_jax import jaxpr as jx
from pathspace_jax import program as flat
from pathspace_jax.errors import DDPUnsupportedError
from pathspace_jax.graph import PathSpace

__all__ = [
    "as_args",
    "check_inputs",
    "refuse_local_batch",
    "batch_size",
    "example_shapes",
    "per_example",
    "take_examples",
    "all_ones",
    "constant_inputs",
    "is_key",
    "dtype_of",
]

_AXES_HELP = "0: examples on the leading axis, None: shared by every example; a prefix of the inputs tuple"


def dtype_of(x):
    """``x``'s dtype, a typed PRNG key's included (which ``jnp.result_type`` does not take)."""
    return x.dtype if hasattr(x, "dtype") else jnp.result_type(x)


def is_key(x) -> bool:
    """Whether ``x`` is an array of typed PRNG keys."""
    return flat.is_key(dtype_of(x))


def as_args(space: PathSpace, inputs) -> tuple:
    """The inputs as the tuple of the traced function's arguments after params: a plain tuple or list of as many
    arguments is that tuple; anything else (an array, a dict, a named tuple such as a ``jraph.GraphsTuple``) is the
    one argument."""
    n = len(space.arg_specs)
    if type(inputs) in (tuple, list) and len(inputs) == n:
        if n != 1 or jax.tree_util.tree_structure(tuple(inputs)) == jax.tree_util.tree_structure(space.arg_specs):
            return tuple(inputs)
    return (inputs,)


def _leaf_axes(batch_axes, args: tuple) -> list:
    """``batch_axes`` (a pytree prefix of ``args``, or of the one argument) broadcast to ``args``' leaves."""

    def spread(ax, sub):
        return [ax] * len(jax.tree_util.tree_leaves(sub))

    for tree in (args, args[0]) if len(args) == 1 else (args,):
        try:
            nested = jax.tree_util.tree_map(spread, batch_axes, tree, is_leaf=lambda a: a is None)
        except (ValueError, TypeError):
            continue
        axes = jax.tree_util.tree_leaves(nested, is_leaf=lambda a: isinstance(a, list))
        return [a for part in axes for a in part]
    raise ValueError(
        f"batch_axes={_short(batch_axes)} is not a pytree prefix of the inputs tuple ({len(args)} argument(s)); "
        f"pass 0 or None per argument ({_AXES_HELP}, as jax.vmap's in_axes)"
    )


def _short(obj, limit: int = 80) -> str:
    s = repr(obj)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _suggest(args: tuple):
    """A ``batch_axes`` for ``args``: 0 on the arguments whose leaves all have the batch's leading size (the size of
    most plain-array arguments, else of most arguments), None on the others; inside a small container, per leaf."""

    def lead(a):  # the leading size of every leaf, or None (a scalar leaf, or sizes that differ)
        sizes = {jnp.shape(x)[0] if jnp.ndim(x) else None for x in jax.tree_util.tree_leaves(a)}
        return next(iter(sizes)) if len(sizes) == 1 else None

    sizes = [lead(a) for a in args]
    plain = [s for a, s in zip(args, sizes, strict=True) if jax.tree_util.tree_structure(a).num_nodes == 1]
    counts = Counter(s for s in (plain if any(s is not None for s in plain) else sizes) if s is not None)
    n = counts.most_common(1)[0][0] if counts else None
    out = []
    for a, s in zip(args, sizes, strict=True):
        ax = jax.tree_util.tree_map(lambda x: 0 if jnp.ndim(x) and jnp.shape(x)[0] == n else None, a)
        per_leaf = 0 in jax.tree_util.tree_leaves(ax) and len(repr(ax)) <= 60
        out.append(0 if s is not None and s == n else ax if n is not None and per_leaf else None)
    return out[0] if len(out) == 1 else tuple(out)


def _fix(args: tuple) -> str:
    axes = _suggest(args)
    whole = " (the whole batch one example)" if axes is None else ""
    return f"pass batch_axes={_short(axes, 120)}{whole} ({_AXES_HELP})"


def refuse_local_batch(xs, what: str) -> None:
    """A batch split over the manual axes of ``jax.shard_map`` is an error: ``what`` is a mean over the batch,
    and each device would take it over its own part."""
    axes = sorted(set().union(*(jx.varying_axes(x) for x in xs)))
    if axes:
        raise ValueError(
            f"inputs differ between devices along the mesh axes {axes} of jax.shard_map: {what} is a mean over the "
            "batch, and each device would take it over its own part. Run the step under jax.jit with the batch "
            "sharded instead (jax.device_put(x, NamedSharding(mesh, P('data'))) or in_shardings): the statistics "
            "are then summed over the whole batch. G-SGD, G-Adam and Path-SGD, which read only the params, run "
            "inside jax.shard_map."
        )


def _check_structure(space: PathSpace, args: tuple) -> None:
    want, got = jax.tree_util.tree_structure(space.arg_specs), jax.tree_util.tree_structure(args)
    if want != got:
        raise ValueError(
            f"inputs must be the arguments after params that the space was traced with ({len(space.arg_specs)}; a "
            f"tuple for several): expected the structure {_short(want, 80)}, got {_short(got, 80)}"
        )


def _as_int(a):
    """A batch axis that ``optax.inject_hyperparams`` made an integer array (it injects every number): its value,
    or 0 when traced (0 is the one number allowed)."""
    if not isinstance(a, jax.Array | np.ndarray) or jnp.ndim(a) or not jnp.issubdtype(jnp.result_type(a), jnp.integer):
        return a
    return 0 if isinstance(a, jax.core.Tracer) else int(a)


def check_inputs(space: PathSpace, inputs, batch_axes=0, who: str = "ddp_kappa") -> tuple[list, tuple]:
    """The inputs' leaves and each one's batch axis (0 or None), checked against the traced arguments.

    Args:
      space: the `PathSpace` the inputs are for.
      inputs: the traced function's arguments after params (`as_args`).
      batch_axes: 0 or None, or a pytree prefix of the arguments' tuple with 0 or None at its leaves.
      who: the public function, named in the errors.

    Returns:
      ``(xs, axes)``: the leaves of the arguments, and a tuple with 0 or None per leaf.
    """
    args = as_args(space, inputs)
    _check_structure(space, args)
    axes = [_as_int(a) for a in _leaf_axes(batch_axes, args)]
    bad = [a for a in axes if a is not None and (isinstance(a, bool) or not isinstance(a, (int, np.integer)) or a)]
    if bad:
        raise ValueError(
            f"batch_axes takes 0 or None at each leaf, got {_short(bad[0])}: put the examples on the leading axis "
            "(jnp.moveaxis) and pass 0 there"
        )
    axes = [None if a is None else 0 for a in axes]
    paths, _ = jax.tree_util.tree_flatten_with_path(args)
    specs = jax.tree_util.tree_leaves(space.arg_specs)
    xs = [x for _, x in paths]
    n, first = None, None
    for (path, x), spec, ax in zip(paths, specs, axes, strict=True):
        where, shape = f"inputs{jax.tree_util.keystr(path)}", tuple(jnp.shape(x))
        dt = dtype_of(x)
        if not flat.supported_input(dt):  # (PRNG keys included)
            raise DDPUnsupportedError(f"{who}: {where} must be floating point, token ids, a mask or a key, got {dt}")
        if ax is None:
            if shape != tuple(spec.shape):
                raise ValueError(
                    f"{where} has shape {shape}, traced with {tuple(spec.shape)}: an input shared by every example "
                    "(batch axis None) keeps its traced shape; pad it to that (jraph.pad_with_graphs) or trace again"
                )
            continue
        if not shape or not spec.shape:
            raise ValueError(f"{where} (shape {shape}) has no leading batch axis: {_fix(args)}")
        if shape[1:] != tuple(spec.shape)[1:]:
            raise ValueError(
                f"{where} has shape {shape}, but the space was traced with examples of shape {tuple(spec.shape)[1:]} "
                "(batch axis first): pass a batch of the traced example shape"
            )
        if n is not None and shape[0] != n:
            raise ValueError(f"{where} has {shape[0]} examples on its leading axis, {first} {n}: {_fix(args)}")
        n, first = shape[0], first or where
    if n == 0:
        raise ValueError("inputs: the batch is empty")
    refuse_local_batch(xs, "DDP-SGD's κ")
    return xs, tuple(axes)


# ----------------------------------------------------------------------------- the batch, by its axes


def batch_size(xs, axes) -> int:
    """The number of examples: the leading size of the batched leaves, 1 with none (the batch one example)."""
    sizes = [int(jnp.shape(x)[0]) for x, a in zip(xs, axes, strict=True) if a == 0]
    return sizes[0] if sizes else 1


def example_shapes(xs, axes) -> list:
    """The shapes of the program's inputs (one example, a batch of one): a batched leaf's with 1 on its leading
    axis, a shared leaf's as it is."""
    return [(1, *jnp.shape(x)[1:]) if a == 0 else tuple(jnp.shape(x)) for x, a in zip(xs, axes, strict=True)]


def per_example(f, xs, axes, *batched):
    """``f(inputs, *b)`` on every example, stacked on a new leading axis: ``inputs`` the program's inputs of one
    example (a batched leaf's example as a batch of one, a shared leaf whole), each ``b`` that example's entry of
    an array of ``batched`` (examples on axis 0). With no batched leaf, ``f`` runs once on the batch, one example."""
    if not any(a == 0 for a in axes):
        return jax.tree_util.tree_map(lambda v: v[None], f(list(xs), *[b[0] for b in batched]))

    def one(b, x):
        return f([xi[None] if a == 0 else xi for xi, a in zip(x, axes, strict=True)], *b)

    return jax.vmap(one, in_axes=(0, list(axes)))(list(batched), list(xs))


def take_examples(xs, axes, pick) -> list:
    """The examples ``pick`` (indices) of the batch: the batched leaves indexed, the shared ones as they are."""
    return [x[pick] if a == 0 else x for x, a in zip(xs, axes, strict=True)]


def constant_inputs(xs, axes) -> tuple:
    """Which inputs are constants of the network (of kind ``"const"`` in the program, values as if closed over): the
    inputs shared by every example, except the floating-point ones where the whole batch is one example (no input
    batched: its features are the network's inputs, γ² = 1, as in `pathspace_jax.path_kappa`)."""
    batched = any(a == 0 for a in axes)
    floats = [jnp.issubdtype(dtype_of(x), jnp.floating) for x in xs]
    return tuple(a is None and (batched or not f) for a, f in zip(axes, floats, strict=True))


def all_ones(xs, axes) -> list:
    """The inputs of the γ² recursion, one example: all ones (γ² = 1 on the network's inputs; `path_kappa`'s), in each
    input's dtype (the recursion runs the program traced on the inputs, which casts them as the model does; token
    ids stay integers, masks all True); the constants of the network (`constant_inputs`: a key, a mask or scale
    shared by every example, a graph's indices) as they are."""
    shapes, const = example_shapes(xs, axes), constant_inputs(xs, axes)
    pairs = zip(xs, shapes, const, strict=True)
    return [x if c else x[:1] if is_key(x) else jnp.ones(s, dtype_of(x)) for x, s, c in pairs]
