"""`trace`: find the reduction graph of a forward function by abstract interpretation.

``jax.make_jaxpr(fn)(params, *args)`` is interpreted once, abstractly, by `pathspace_jax.tracer.Walker`
(every array axis carries atoms, labels in a union-find; each primitive's rule says how they flow, and what is
not positively homogeneous pins them). This module turns the atoms into node groups, edge leaves and pinned
groups: a `PathSpace`. Parameter names, module names and leaf order are never read.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pathspace_jax import jaxpr as jx
from pathspace_jax import leaf_roles, roles
from pathspace_jax.atoms import ACT, CONST, PARAM, Val
from pathspace_jax.edge_leaves import leaf_edges, stack_layers
from pathspace_jax.errors import UnsupportedModelError
from pathspace_jax.graph import (
    NodeGroup,
    PathSpace,
    leaf_path_strings,
    pin_hint,
)
from pathspace_jax.ir import Frame
from pathspace_jax.rules import is_random
from pathspace_jax.skeleton import choose_by_value, off_zeros
from pathspace_jax.tracer import Walker

__all__ = ["trace", "UnsupportedModelError", "leaf_path_strings"]


# ---------------------------------------------------------------------------
# Building the PathSpace.
# ---------------------------------------------------------------------------


def _check_params(params) -> tuple[list[Any], Any, list[str]]:
    leaves, treedef = jax.tree_util.tree_flatten(params)
    paths = leaf_path_strings(params)
    if not leaves:
        raise TypeError("params has no array leaves: pass the parameter pytree (e.g. variables['params']).")
    for path, leaf in zip(paths, leaves):
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            raise TypeError(
                f"params leaf {path!r} is a {type(leaf).__name__}, not an array: params must be a pytree of "
                "arrays (for Flax linen pass variables['params']; for nnx pass the nnx.State of nnx.Param)."
            )
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            raise TypeError(
                f"params leaf {path!r} has dtype {leaf.dtype}; parameters must be floating point arrays "
                "(move integer or boolean state out of the params pytree)."
            )
    return leaves, treedef, paths


def trace(fn: Callable[..., Any], params, *args, strict: bool = False, skeleton: str = "index", **kwargs) -> PathSpace:
    """Find the reduction graph of the ReLU part of ``fn``.

    ``fn(params, *args, **kwargs)`` must return the network's outputs (an array or
    a pytree of arrays). The structure is read off ``jax.make_jaxpr(fn)`` by
    abstract interpretation (see the module docstring): parameter names, module
    names and leaf order are never used, so linen, nnx and plain JAX functions
    all work the same way.

    Node groups that meet an operation that is not positively homogeneous per node
    (tanh, softmax, normalisation, gating products, an unknown primitive) are
    *pinned*: treated as boundary nodes and never rescaled. `describe` lists them.

    Args:
      fn: the forward function, ``fn(params, *args, **kwargs) -> outputs``.
      params: pytree of floating point arrays (or ``jax.ShapeDtypeStruct``).
      *args: example inputs (arrays or ``ShapeDtypeStruct``); only shapes and
        dtypes are used. Integer inputs are token ids (an embedding lookup).
      strict: raise `UnsupportedModelError` instead of pinning, naming the
        primitive, the source line and the parameter paths involved.
      skeleton: how the skeleton (the basis paths of `to_coords` and G-SGD) is
        chosen. ``"index"`` (default): from the graph alone (the ``j mod n``
        pattern), so the space describes structure only and serves any params of
        that structure (an ensemble, a checkpoint, another seed); only a node whose
        index-rule edge is exactly 0 in these ``params`` (a zero-initialised
        BatchNorm scale closing a residual block) takes a nonzero one instead
        (`pathspace_jax.skeleton.off_zeros`; `describe` says so). ``"values"``
        (opt-in): per node, the incoming and outgoing edge of the largest path value
        in *these* ``params`` (`pathspace_jax.skeleton.choose_by_value`; the same for
        every rescaling of them), which ties the chart to them: use it only with
        these params and their descendants. It falls back to ``"index"`` when
        ``params`` are abstract (``ShapeDtypeStruct``, tracers).
      **kwargs: static keyword arguments bound into ``fn`` (e.g. ``train=False``).

    Returns:
      A `PathSpace` (frozen, hashable, holds no JAX arrays).

    Example:
      >>> dense = flax.linen.Dense(3)
      >>> p = dense.init(key, x)["params"]
      >>> s = pj.trace(lambda p, x: dense.apply({"params": p}, x), p, x)
      >>> s.num_hidden  # one layer: no hidden node
      0

    References:
      Meng et al., "G-SGD: Optimizing ReLU neural networks in its positively
      scale-invariant space", ICLR 2019; "Path Space for Recurrent Neural Networks with ReLU
      Activations" (the reduction graph).
    """
    if skeleton not in ("values", "index"):
        raise ValueError(f"skeleton must be 'values' or 'index', got {skeleton!r}")
    leaves, treedef, paths = _check_params(params)
    bound = functools.partial(fn, **kwargs) if kwargs else fn
    arg_specs = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a)), args)
    space = _run_trace(bound, leaves, treedef, paths, arg_specs, strict)[0]
    concrete = all(
        isinstance(x, (np.ndarray, np.generic)) or (isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer))
        for x in leaves
    )
    if skeleton == "values" and concrete:
        space = dataclasses.replace(space, skeleton_edges=choose_by_value(space, leaves), skeleton_rule="values")
    elif concrete and all(getattr(x, "is_fully_addressable", True) for x in leaves):
        edges = off_zeros(space, leaves)
        if edges is not None:
            space = dataclasses.replace(space, skeleton_edges=edges, skeleton_rule="index, off zeros")
    return space


def _run_trace(bound, leaves, treedef, paths, arg_specs, strict):
    param_specs = [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in leaves]
    try:
        closed = jax.make_jaxpr(lambda ps, a: bound(jax.tree_util.tree_unflatten(treedef, ps), *a))(
            param_specs, arg_specs
        )
    except Exception as e:
        shapes = jax.tree_util.tree_map(lambda s: f"{s.dtype}{list(s.shape)}", arg_specs)
        hint = ""
        if type(e).__name__ == "TraceContextError":  # flax: a Variable created outside the trace is written in it
            hint = (
                ". fn closes over flax.nnx state that the forward pass writes (e.g. the nnx.Rngs stream from which "
                "nnx.RNN draws its initial carry): pass that state as an argument instead, e.g. "
                "`graphdef, params, rest = nnx.split(model, nnx.Param, ...)`, then "
                "`pj.trace(lambda p, x, rest: nnx.merge(graphdef, p, rest)(x), params, x, rest)`"
            )
        raise ValueError(
            f"fn(params, *args) could not be traced with args of shapes {shapes}: {type(e).__name__}: {e}{hint}"
        ) from e
    interp = _interpret(closed, param_specs, jax.tree_util.tree_leaves(arg_specs), paths)
    random_state = jx.random_state_only(closed, is_random)[len(leaves) :]
    return _build(interp, treedef, leaves, paths, bound, arg_specs, strict, random_state), closed, interp


def _interpret(closed, param_specs, input_specs, paths) -> Walker:
    """Run the abstract interpreter on ``closed``, a jaxpr of ``(param leaves, input leaves)``."""
    interp = Walker(paths)
    n_leaves = len(param_specs)
    in_vals: list[Val] = []
    for i, leaf in enumerate(param_specs):
        axes = interp.fresh(leaf.shape)
        interp.leaf_axes.append(axes)
        in_vals.append(Val(PARAM, axes, leaf=i))
    for a in input_specs:
        if jnp.issubdtype(a.dtype, jnp.floating):
            in_vals.append(Val(ACT, interp.fresh(a.shape, input=True)))
        else:
            in_vals.append(Val(CONST, interp.fresh(a.shape, input=True)))  # token ids, masks, PRNG keys
    rec = interp.rec
    in_vals = [v.with_id(rec.new()) for v in in_vals]
    rec.top.in_ids = [v.id for v in in_vals]
    for v in in_vals[n_leaves:]:
        rec.notes[v.id] = interp.axes_note(v) if v.kind == ACT else None
    interp.input_axes = [v.axes for v in in_vals[n_leaves:]]
    for i, eqn in interp.read_only_by_dead_code(closed.jaxpr, n_leaves):  # (no error: a head whose output is dropped)
        interp.eqn = eqn  # (its reason names the line)
        interp.mark_other(in_vals[i], "read only by values fn computes and drops: it does not reach the outputs")
    interp.eqn = None
    consts = [interp.const_val(c) for c in closed.consts]
    outs = interp.run(closed.jaxpr, consts, in_vals)
    rec.top.out_ids = [v.id for v in outs]
    interp.eqn = None
    roles.settle(interp)
    for v in outs:
        if v.kind == ACT:
            for a in interp.atoms.resolve(interp.all_atoms(v)):
                interp.atoms.output[a] = True
    used = [bool(u or o) for u, o in zip(interp.uses, interp.other, strict=True)]
    for (leaf, _), j in sorted(interp.slices.items(), key=lambda kv: -kv[1]):  # used where its slices are
        used[leaf] |= used[j]
    if not any(used[:n_leaves]):
        raise ValueError(
            "fn does not use params: its outputs do not depend on any parameter leaf. trace(fn, params, *args) "
            "expects fn(params, *args) to compute the network's outputs from params."
        )
    unused = [paths[i] for i in range(n_leaves) if not used[i]]
    if unused:
        raise ValueError(
            f"params leaves {unused} are not used by fn: remove them from the params pytree passed to trace "
            "(or make fn use them)."
        )
    return interp


def record(closed, n_params: int, paths: Sequence[str]) -> tuple[Frame, dict[int, bool | str | Cut]]:
    """The flat program of ``closed`` as the interpreter records it (`pathspace_jax.ir`), and which of its
    values lie in a node group that is not positively homogeneous.

    ``closed`` is a jaxpr of ``(param leaves..., input leaves...)`` (as `pathspace_jax.program` makes it). The
    interpreter runs on it once, and every recorded value gets a flag: True where its node axis belongs to a
    pinned group, or to an output group that meets an operation that is not positively homogeneous (a tanh
    head), or where fixed coefficients produce or read it (a kernel concatenated from parameters); ``"const"``
    for a value that depends on no input (parameters combined into fixed coefficients included); a `Cut` where
    its node axis is groups side by side of which some are pinned and some not (a fused kernel's output, cut
    into a gate and a linear half). Path-SGD and DDP-SGD treat the flagged values as boundaries.
    """
    avals = jx.in_avals(closed)
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
    interp = _interpret(closed, specs[:n_params], specs[n_params:], paths)
    _groups(interp, specs[:n_params], paths)  # sets interp.pinned_roots; no PathSpace (no per-entry arrays)
    atoms = interp.atoms
    roots = interp.pinned_roots | {atoms.find(r) for r in atoms.resolve(interp.fixed)}

    def flag(axes) -> bool | str | Cut:
        if axes is None or isinstance(axes, str):
            return axes is not None and axes
        cut = None
        for k, ax in enumerate(axes[:-1]):
            fs, segs = atoms.factors(ax), atoms.segments(ax)
            pins = [any(r in roots for r in atoms.resolve(seg)) for seg in segs]
            if len(segs) > 1 and any(pins) and not all(pins):
                sizes = tuple(int(np.prod([atoms.size[r] for r in seg])) for seg in segs)
                if sum(sizes) != atoms.size[fs[0]]:  # a reshaped output's pieces axis: w entries per group
                    sizes = (atoms.size[fs[0]] // len(segs),) * len(segs)
                cut = Cut(k, sizes, tuple(pins), atoms.blocks[fs[0]])
            elif any(pins):
                return True
        return cut or any(atoms.find(r) in roots for r in atoms.resolve(axes[-1]))

    return interp.rec.top, {i: flag(a) for i, a in interp.rec.notes.items()}


class Cut(NamedTuple):
    """The flag of a value whose node axis ``axis`` is groups side by side, of ``sizes``, some ``pinned`` and some
    not (`record`): the pinned ones are boundaries, the others not."""

    axis: int
    sizes: tuple[int, ...]
    pinned: tuple[bool, ...]
    blocks: int = 1  # the groups' entries in this many blocks, each the groups' blocks side by side (interleaved)


def _groups(interp: Walker, leaves, paths):
    """Each leaf's role (`pathspace_jax.leaf_roles.resolve`; the layer slices of stacked leaves appended,
    `Walker.layer_slice`) and the node groups (`_node_groups`): ``(leaves, paths, leaf_info, groups, key_index,
    num_nodes)``."""
    n = len(leaves)
    for (leaf, _), _j in sorted(interp.slices.items(), key=lambda kv: kv[1]):  # in the order of their indices
        leaves = [*leaves, jax.ShapeDtypeStruct(leaves[leaf].shape[1:], leaves[leaf].dtype)]
    paths = list(paths) + interp.leaf_paths[n:]
    leaf_info = leaf_roles.resolve(interp, leaves, paths)
    return (leaves, paths, leaf_info, *_node_groups(interp, leaf_info))


def _build(interp: Walker, treedef, leaves, paths, fn, arg_specs, strict, random_state) -> PathSpace:
    """The `PathSpace` from the interpreter's atoms: the node groups (`_groups`), then every entry's source and
    destination nodes (`pathspace_jax.edge_leaves.leaf_edges`). ``random_state``: per input, whether it is random
    state alone (a key, an nnx stream's counter): one whose first axis a scan over layers reads per layer is no batch
    of examples."""
    n = len(leaves)
    leaves, paths, leaf_info, groups, key_index, num_nodes = _groups(interp, leaves, paths)
    edge_leaves = stack_layers(interp.slices, leaf_edges(interp.atoms, leaves, paths, leaf_info, groups, key_index))
    atoms = interp.atoms
    first = tuple(
        i for i, axes in enumerate(interp.input_axes) if axes and any(atoms.position[f] for f in atoms.factors(axes[0]))
    )
    per_layer = tuple(i for i in first if random_state[i])
    first = tuple(i for i in first if i not in per_layer)
    space = PathSpace(treedef, tuple(edge_leaves[:n]), tuple(groups), num_nodes, fn, arg_specs,
                      positions_first=first, random_per_layer=per_layer)  # fmt: skip
    if strict:
        _check_strict(space)
    return space


def _node_groups(interp: Walker, leaf_info) -> tuple[list[NodeGroup], dict, int]:
    """The node groups (keys: tuples of atom roots, aliases resolved), ordered by first use, each input,
    output, hidden or pinned (with its reasons); also the key of each group and the number of nodes. Sets
    ``interp.pinned_roots``."""
    atoms = interp.atoms
    group_order: dict[tuple[int, ...], float] = {}
    fed: set[tuple[int, ...]] = set()  # groups that some edge enters
    read: set[tuple[int, ...]] = set()  # groups that some edge leaves

    by: dict[tuple[int, ...], str] = {}  # a parameter whose edges enter or leave the group, for messages

    def add_key(key: tuple[int, ...], step: float, entered: bool, path: str):
        if len(key) == 1 and atoms.alias[key[0]] is not None:
            for seg in atoms.segments(key):  # (a flattened feature map's positions are no part of its nodes)
                if nodes := tuple(r for r in seg if not atoms.position[r]):
                    add_key(nodes, step, entered, path)
            return
        canon = tuple(sorted(key))
        group_order[canon] = min(group_order.get(canon, np.inf), step)
        by.setdefault(canon, path)
        (fed if entered else read).add(canon)

    for (kind, factors, node_in, node_out, _, step, ends), path in zip(leaf_info, interp.leaf_paths, strict=True):
        if kind == "other":
            continue
        if node_in:
            add_key(tuple(factors[k] for k in node_in), step - 0.5, False, path)
        add_key(tuple(ends[k] for k in node_out), step, True, path)
    for key, other in leaf_roles.clashes(group_order):
        if all(any(atoms.reasons[r] for r in k) for k in (key, other)):
            continue  # both pinned already (attention's queries and keys, their heads tied by the scores)
        atoms.pin(
            list(key) + list(other),
            f"one array axis belongs to node groups of different shapes (those of {by[other]} and {by[key]}): a "
            "layer reads or writes a group only in part, along with other axes",
        )

    keys = sorted(group_order, key=lambda k: (group_order[k], k))
    groups: list[NodeGroup] = []
    key_index: dict[tuple[int, ...], int] = {}
    offset = 1  # node 0 is the bias node
    for gi, key in enumerate(keys):
        size = int(np.prod([atoms.size[r] for r in key]))
        reasons = tuple(dict.fromkeys(x for r in key for x in atoms.reasons[r]))
        if key not in fed and not any(atoms.input[r] or atoms.output[r] for r in key):
            # rescaling nodes that no parameter enters would change the function (e.g. a unit channel axis
            # made by a reshape of a hidden layer's output, whose own kernel then has no node axis)
            guess = "" if reasons else " (a node axis created by a reshape?)"  # (else the reasons say how)
            reasons = reasons + (f"no parameter edge enters these nodes{guess}",)
        elif not reasons and key not in read and not any(atoms.output[r] for r in key):
            # a layer's units that nothing reads (a slice leaves them out): no path through them reaches an output
            reasons = reasons + (f"no parameter edge leaves these nodes, and they are no output (units of {by[key]} "
                                 "that a slice leaves out?)",)  # fmt: skip
        if any(atoms.input[r] for r in key):
            kind = "input"
        elif any(atoms.output[r] for r in key):
            kind = "output"
        elif reasons:
            kind = "pinned"
        else:
            kind = "hidden"
        pinned = kind != "input"  # an input group's reasons do not apply: inputs are never rescaled
        groups.append(NodeGroup(f"g{gi}", size, kind, offset, reasons if pinned else ()))
        key_index[key] = gi
        offset += size
    # the boundary of κ and DDP (`pathspace_jax.program`): the pinned groups, and an input group that a layer writes
    # into (a residual stream that starts from the inputs) where it meets an operation that is not positively
    # homogeneous (a LayerNorm): no rescaling changes its values, and the paths into it end there, as at a pinned group
    interp.pinned_roots = {
        r for key, gi in key_index.items() for r in key
        if groups[gi].reasons or groups[gi].kind == "input" and key in fed and any(atoms.reasons[a] for a in key)
    }  # fmt: skip
    return groups, key_index, offset


def _check_strict(space: PathSpace) -> None:
    """`UnsupportedModelError` listing one short line per pinned group and per parameter that is not an edge."""

    def short(reasons) -> str:
        first = reasons[0] if len(reasons[0]) <= 150 else reasons[0][:147] + "..."
        return first + (f" (and {len(reasons) - 1} more)" if len(reasons) > 1 else "")

    problems = []
    for gi, g in enumerate(space.groups):
        if g.kind == "pinned":
            near = [leaf.path for leaf in sorted(space.leaves, key=lambda leaf: leaf.kind != "weight")
                    if gi in leaf.src_groups or gi in leaf.dst_groups]  # fmt: skip
            near = ", ".join(near[:2]) + (", ..." if len(near) > 2 else "") if near else "no parameter"
            hint = pin_hint(g.reasons)
            problems.append(f"group {g.name} ({g.size} nodes; {near}): {short(g.reasons)}"
                            + (f"\n      what you can do: {hint}" if hint else ""))  # fmt: skip
    for leaf in space.leaves:
        if leaf.kind == "other":
            problems.append(f"parameter {leaf.path} is not an edge: {short(leaf.note.split('; '))}")
    if problems:
        raise UnsupportedModelError(
            "the model is not positively homogeneous everywhere (strict=True):\n  - "
            + "\n  - ".join(problems)
            + "\npathspace_jax.describe(space) lists every reason; strict=False pins these node groups (treats them "
            "as boundary nodes) instead."
        )
