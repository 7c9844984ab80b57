"""The tracing rules of gathers and scatters."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from pathspace_jax import jaxpr as jx
from pathspace_jax import roles, rules_elementwise, rules_shape
from pathspace_jax.atoms import ACT, CONST, PARAM, Val

if TYPE_CHECKING:
    from pathspace_jax.tracer import Walker


def rule_scatter_add(w: Walker, eqn, ins):
    """``operand.at[ids].add(updates)`` with constant ``ids``: a segment sum (a graph network's messages summed
    into its nodes). The window axes of the updates are the operand's (same nodes); the axes the ids index
    and the updates' other axes are summed over, which pins them unless they are positions (graph nodes,
    edges), as a reduction does. A non-zero operand is an offset unless it is an activation itself."""
    return _scatter(w, eqn, ins, identity=False)


def rule_scatter_max(w: Walker, eqn, ins):
    """``operand.at[ids].max(updates)`` with constant ``ids``: a segment max (``jax.ops.segment_max``, a graph
    network's max aggregation), read as `rule_scatter_add`; its operand is −∞ (what ``segment_max`` leaves in
    a segment no update reaches), 0, or an activation: a constant other than those is an offset."""
    return _scatter(w, eqn, ins, identity=_all_neg_inf(w, ins[0]))


def rule_scatter(w: Walker, eqn, ins):
    """``x.at[ids].set(0)`` with constant ``ids`` on an activation: some entries set to zero, the others x's (the
    same nodes; a zero scales with any factor). Setting other values, or by computed ids, is not known to be
    positively homogeneous."""
    op, idx, upd = ins
    if op.kind == ACT and idx.kind == CONST and upd.kind == CONST and upd.zero:
        return [Val(ACT, [list(ax) for ax in op.axes], scalars=list(op.scalars))]
    return rules_elementwise.unknown(w, eqn, ins)


def _all_neg_inf(w: Walker, v) -> bool:
    """Whether a constant is −∞ everywhere (the identity of ``max``), as far as the trace can compute it."""
    c = w.rec.value(v.id) if v.kind == CONST else None
    return c is not None and c.size > 0 and bool(np.all(np.isneginf(c)))


def _scatter(w: Walker, eqn, ins, identity: bool):
    op, idx, upd = ins
    dn = jx.param(eqn, "dimension_numbers")
    window = [k for k in range(len(op.axes)) if k not in dn.inserted_window_dims]
    whole = all(w.size(upd.axes[j]) == w.size(op.axes[k]) for j, k in zip(dn.update_window_dims, window))
    if idx.kind != CONST or PARAM in (op.kind, upd.kind) or dn.operand_batching_dims or not whole:
        return rules_elementwise.unknown(w, eqn, ins)
    for j, k in zip(dn.update_window_dims, window, strict=True):
        w.atoms.unify(upd.axes[j], op.axes[k], w.reason())
    for k in dn.scatter_dims_to_operand_dims:
        w.atoms.pin(op.axes[k], w.reason("scatters into an axis"))
    for k in range(len(upd.axes)):
        if k not in dn.update_window_dims:
            w.atoms.pin(upd.axes[k], w.reason("sums over the nodes of a group"))
    if upd.kind == ACT and op.kind == CONST and not op.zero and not identity:
        w.pin(upd, "adds a constant offset")
    kind = ACT if ACT in (op.kind, upd.kind) else CONST
    return [Val(kind, [list(ax) for ax in op.axes], zero=op.zero and upd.zero)]


def _known_row(w: Walker, eqn, op: Val, idx: Val):
    """A gather of one known row of a whole params leaf (``jnp.take(ws, i, axis=0)`` with a Python ``i``): layer
    i of a leaf of stacked layers, recorded as the static slice and squeeze that ``ws[i]`` is; else None."""
    in_shape, out_shape = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
    rows = idx.id[1] if isinstance(idx.id, tuple) else None
    if rows is None or np.shape(rows) != (1,) or not 0 <= int(rows[0]) < in_shape[0] or out_shape != in_shape[1:]:
        return None
    if not jx.is_row_lookup(eqn.params, len(in_shape), tuple(in_shape[1:]), len(out_shape)):
        return None
    i = int(rows[0])
    layer = rules_shape.layer_of(w, op, in_shape, (1, *in_shape[1:]), 0, i)
    if layer is None:
        return None
    as_slice, as_squeeze = jx.static_row(eqn, i)
    [sliced] = w.record(eqn, [op], [layer], as_=as_slice)
    return w.record(eqn, [sliced], [rules_shape.squeezed(sliced, (0,))], as_=as_squeeze)


def rule_gather(w: Walker, eqn, ins):
    op, idx = ins[0], ins[1]
    dn = jx.param(eqn, "dimension_numbers")
    slice_sizes = jx.param(eqn, "slice_sizes")
    in_shape = eqn.invars[0].aval.shape
    out_shape = eqn.outvars[0].aval.shape
    if (row := _known_row(w, eqn, op, idx)) is not None:
        return row
    if idx.kind != CONST:
        return rules_elementwise.unknown(w, eqn, ins)
    # an index axis batched with an operand axis (take_along_axis: one index per example) keeps its entries
    batched = dict(zip(dn.start_indices_batching_dims, dn.operand_batching_dims, strict=True))
    # operand axes that survive as slices, in order
    offset_src = [
        k for k in range(len(in_shape)) if k not in dn.collapsed_slice_dims and k not in dn.operand_batching_dims
    ]
    batch_axes = [ax for ax in idx.axes[:-1]]
    out: list[list[int]] = []
    b = o = 0
    for k in range(len(out_shape)):
        if k in dn.offset_dims:
            src = offset_src[o]
            o += 1
            if slice_sizes[src] == in_shape[src]:
                out.append(list(op.axes[src]))
                if op.kind == PARAM:
                    w.use(op, op.axes[src], "out")
            else:
                if op.kind == PARAM:
                    w.mark_other(op, "gathered in part")
                w.atoms.pin(op.axes[src], w.reason("gathers part of an axis"))
                out.append([w.atoms.new(out_shape[k], position=True)])
        elif b in batched:
            out.append(list(op.axes[batched[b]]))
            b += 1
        else:
            ax = batch_axes[b] if b < len(batch_axes) else []
            b += 1
            out.append(list(ax) if w.size(ax) == out_shape[k] else [w.atoms.new(out_shape[k], position=True)])
            if op.kind == PARAM:  # a table looked up along the ids' axes: shared along them, as a layer's weights
                roles.shared_input(w, out[-1])
    for k in dn.start_index_map:
        if op.kind == PARAM:
            # an embedding lookup: rows of the table are edges from one-hot inputs
            for a in w.atoms.factors(op.axes[k]):
                w.atoms.input[a] = True
            w.use(op, op.axes[k], "in")
        elif op.axes[k]:
            w.atoms.pin(op.axes[k], w.reason("indexes into an axis"))
    return [Val(ACT if op.kind in (ACT, PARAM) else CONST, out)]
