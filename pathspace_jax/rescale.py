"""Node-wise rescaling T_α, random power-of-two rescalings, and `describe`."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pathspace_jax.errors import PathKappaUnsupportedError
from pathspace_jax.exact import pow2
from pathspace_jax.frames import jit_when_eager
from pathspace_jax.graph import PathSpace, check_path_space, pin_hint, reduced

__all__ = ["rescale", "random_alphas", "random_rescale", "describe", "node_vector"]


def node_vector(space: PathSpace, alphas: Sequence[Any], fill: float = 1.0) -> jax.Array:
    """Concatenate one vector per hidden group into a vector over all nodes.

    Boundary nodes (bias, inputs, outputs, pinned groups) get ``fill``.
    """
    hidden = space.hidden_groups
    if len(alphas) != len(hidden):
        raise ValueError(
            f"expected one vector per hidden group ({len(hidden)}: "
            f"{[space.groups[i].name for i in hidden]}), got {len(alphas)}"
        )
    dtype = jnp.result_type(*alphas) if len(alphas) else jnp.float32
    given = dict(zip(hidden, alphas))
    parts = [jnp.full((1,), fill, dtype)]
    for i, g in enumerate(space.groups):
        if i in given:
            a = jnp.asarray(given[i], dtype)
            if a.shape != (g.size,):
                raise ValueError(f"alpha for hidden group {g.name} has shape {a.shape}, expected ({g.size},)")
            parts.append(a)
        else:
            parts.append(jnp.full((g.size,), fill, dtype))
    return jnp.concatenate(parts)


def rescale(space: PathSpace, params, alphas: Sequence[Any]):
    """Apply the node-wise rescaling T_α: ``w[u -> v] ↦ (α_v / α_u) · w[u -> v]``.

    ReLU networks compute the same function before and after; the parameters
    change. α = 1 on the bias node, inputs, outputs and pinned groups.

    Args:
      space: from `pathspace_jax.trace`.
      params: a params pytree of the traced structure.
      alphas: one positive vector per hidden group, in the order of
        ``space.hidden_groups`` (group ``space.groups[i]`` takes a vector of
        shape ``(space.groups[i].size,)``).

    Returns:
      The rescaled params, same structure and dtypes.

    References:
      Neyshabur et al., "Path-SGD", NeurIPS 2015; Neyshabur et al., "Path-normalized optimization of
      recurrent neural networks with ReLU activations", NeurIPS 2016, Thm 1.
    """
    check_path_space(space, "rescale")
    for a in alphas:
        if not isinstance(a, jax.core.Tracer) and not np.all(np.asarray(a) > 0):
            raise ValueError("rescaling factors must be positive (T_α needs α > 0)")
    return _rescale(space, params, alphas)


@jit_when_eager()
def _rescale(space: PathSpace, params, alphas: Sequence[Any]):
    leaves = space.leaves_of(params)
    a = node_vector(space, alphas)
    out = []
    for spec, w in zip(space.leaves, leaves):
        if spec.kind == "other":
            out.append(w)
        else:
            factor = a[reduced(spec.dst)[0]] / a[reduced(spec.src)[0]]  # small arrays: no index per entry
            out.append(w * factor.astype(w.dtype))
    return space.unflatten_like(params, out)


def random_alphas(space: PathSpace, key, *, max_exponent: int = 4) -> list[jax.Array]:
    """Power-of-two factors 2^k, k uniform in [-max_exponent, max_exponent], per hidden node."""
    keys = jax.random.split(key, max(len(space.hidden_groups), 1))
    return [
        pow2(jax.random.randint(k, (space.groups[i].size,), -max_exponent, max_exponent + 1), jnp.float32)
        for k, i in zip(keys, space.hidden_groups)
    ]


@jit_when_eager("max_exponent")
def random_rescale(space: PathSpace, params, key, *, max_exponent: int = 4):
    """`rescale` by random powers of two, which is exact in floating point.

    Each hidden node gets its own factor 2^k with k uniform in
    ``[-max_exponent, max_exponent]``, so the network function is unchanged
    bit for bit (barring overflow) while the parameters change.
    """
    return _rescale(space, params, random_alphas(space, key, max_exponent=max_exponent))


def _plain_note(space: PathSpace) -> str:
    """What `describe`'s first line adds where the path-space part is absent or small."""
    if space.num_hidden == 0:
        return ("; NO hidden node can be rescaled, so the path-space optimisers reduce to their plain forms "
                "(the pinned groups below say why)")  # fmt: skip
    edges = sum(int(np.prod(leaf.shape, dtype=np.int64)) for leaf in space.leaves if leaf.kind != "other")
    if edges < 0.1 * space.num_params:
        return f"; only {edges / space.num_params:.1%} of the parameters are edges of the path-space part"
    return ""


def _off_path(space: PathSpace, params) -> list[str]:
    """Per leaf, the entries that lie on no path (Path-SGD's κ⁽¹⁾ exactly 0) and why, as `describe` shows them."""
    from pathspace_jax.kappa import path_kappa  # (kappa imports this module's neighbours; only describe needs it)

    leaves = space.leaves_of(params, "params")
    ones = space.unflatten_like(params, [jnp.ones(jnp.shape(w), jnp.result_type(w)) for w in leaves])
    on_graph = space.leaves_of(path_kappa(space, ones, second_order=False))  # 0: on no path of the graph itself
    at_values = space.leaves_of(path_kappa(space, params, second_order=False))
    notes = []
    for leaf, k1, k in zip(space.leaves, on_graph, at_values, strict=True):
        graph, dead = int(np.sum(np.asarray(k1) == 0)), int(np.sum((np.asarray(k) == 0) & (np.asarray(k1) != 0)))
        why = []
        if graph and leaf.kind != "other":
            taps = len(leaf.shape) - (leaf.stacked is not None) > 2  # a convolution's kernel
            why.append(f"{graph} {'taps that read only padding' if taps else 'on no path'}")
        if dead and leaf.kind != "other":
            why.append(f"{dead} through a dead unit (its weights in or out all 0)")
        notes.append("; ".join(why))
    return notes


def _skeleton_note(space: PathSpace) -> str:
    if space.skeleton_rule == "values":
        return "from the params' values"
    if space.skeleton_rule == "index, off zeros":
        moved = sum(int(np.sum(e >= 0)) for e in space.skeleton_edges)
        return (f"by index (from the graph alone), but {moved} skeleton edge(s) moved off weights that were exactly 0 "
                "when traced (zero-initialised scales)")  # fmt: skip
    return "by index (from the graph alone)"


def describe(space: PathSpace, params=None) -> str:
    """A readable table of the parameter leaves' roles and of the node groups.

    With ``params``, each edge leaf also says how many of its entries lie on no path: Path-SGD's κ is exactly 0
    there (taps of a convolution that read only padding, as in a 3×3 kernel on 1×1 maps; weights into or out of a
    unit whose other weights are all 0). They do not change the function, and Path-SGD and DDP-SGD give them the
    plain step of the learning rate (weight decay's, for instance), not one divided by κ.
    """
    names = [g.name for g in space.groups]
    off = [""] * len(space.leaves)
    if params is not None:
        try:
            off = _off_path(space, params)
        except PathKappaUnsupportedError:  # no path sums for this network (`path_kappa` says why): no counts
            pass

    def side(idx):
        return "|".join(names[i] for i in idx) if idx else "bias"

    rows = []
    for leaf, note in zip(space.leaves, off, strict=True):
        if leaf.kind == "other":
            role = "not an edge: " + leaf.note
        else:
            role = f"{side(leaf.src_groups)} -> {side(leaf.dst_groups)}"
            if leaf.recurrent:
                role += " (recurrent)"
            if note:
                role += f"; entries on no path: {note}"
        rows.append((leaf.path, "x".join(map(str, leaf.shape)) or "scalar", role))
    w = max(len("parameter"), *(len(r[0]) for r in rows))
    ws = max(len("shape"), *(len(r[1]) for r in rows))
    lines = [
        f"PathSpace: {space.num_params} parameters (m), {space.num_hidden} hidden nodes (H), "
        f"{space.num_coords} path coordinates (m - H); skeleton chosen " + _skeleton_note(space) + _plain_note(space),
        "",
        f"{'parameter':<{w}}  {'shape':<{ws}}  role",
    ]
    lines += [f"{p:<{w}}  {s:<{ws}}  {r}" for p, s, r in rows]
    lines += ["", "group  size    kind"]
    for g in space.groups:
        lines.append(f"{g.name:<5}  {g.size:<6}  {g.kind}" + (", because:" if g.reasons else ""))
        for reason in g.reasons:
            lines += textwrap.wrap(reason, 110, initial_indent=" " * 17 + "- ", subsequent_indent=" " * 19)
        if g.kind == "pinned" and (hint := pin_hint(g.reasons)):
            lines += textwrap.wrap(f"what you can do: {hint}", 110, initial_indent=" " * 17, subsequent_indent=" " * 19)
    return "\n".join(lines)
