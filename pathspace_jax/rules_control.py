"""The tracing rules of control flow: ``scan`` (a recurrence, or layers stacked in a params leaf), ``while``,
``cond``."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pathspace_jax import ir
from pathspace_jax import jaxpr as jx
from pathspace_jax.atoms import ACT, CONST, PARAM, Val

if TYPE_CHECKING:
    from pathspace_jax.tracer import Walker


def _carry_in(w: Walker, v: Val) -> Val:
    if v.kind == CONST:
        return Val(ACT, [list(ax) for ax in v.axes], id=v.id) if v.zero else v
    if v.kind == PARAM:
        w.mark_other(v, "carried through a loop")
        return Val(CONST, [list(ax) for ax in v.axes], id=v.id)
    return v


def _tie_carry(w: Walker, init: Sequence[Val], carry_in: Sequence[Val], carry_out: Sequence[Val]):
    for i0, ci, co in zip(init, carry_in, carry_out):
        if ci.kind == ACT or co.kind == ACT:
            for a, b in zip(ci.axes, co.axes):
                w.atoms.unify(a, b, w.reason("loop carry"))
            if i0.kind == CONST and not i0.zero:
                w.atoms.pin(w.all_atoms(ci), w.reason("loop carry starts from a non-zero constant"))
            if co.kind == PARAM:
                w.mark_other(co, "carried through a loop")


def _layer_counter(w: Walker, sc, consts, init) -> int | None:
    """The carry index of the counter of a loop over layers stacked in a params leaf that reads them by it
    (``lax.fori_loop(0, n, lambda i, h: relu(h @ ws[i]), x)``): a counter from a known start, and a whole
    params leaf among the consts that the body slices dynamically. Else None."""
    k = jx.loop_counter(sc)
    if k is None or sc.reverse or not isinstance(init[k].id, tuple):
        return None
    whole = [j for j, v in enumerate(consts) if v.kind == PARAM and v.axes == w.leaf_axes[v.leaf]]
    return k if any(jx.dynamically_sliced(sc, j) for j in whole) else None


def _layer_stack(w: Walker, sc, consts, init, xs, counter: int | None = None):
    """A scan that slices params leaves along its axis (``nn.scan`` over layers, with or without remat) is a
    stack of distinct layers, not a recurrence: the body runs (and is recorded) once per layer, with layer
    i's slices as leaves of their own, and each layer's carry feeds the next (their groups are not tied).
    With ``counter`` (`_layer_counter`), that carry is a literal at each step, so the body's ``ws[i]`` is a
    static slice: layer i's. Returns the last carry and the per-step outputs (``ys``, recorded stacked), their
    atoms tied across the layers. The frame notes where each layer's equations lie (`pathspace_jax.ir.LayerStack`),
    for the programs that run the stack as one scan (`pathspace_jax.program`)."""
    nk = len(init)
    x_avals, y_avals = jx.in_avals(sc.body)[len(consts) + nk :], jx.out_avals(sc.body)[nk:]
    carry, per_layer = [v if k == counter else _carry_in(w, v) for k, v in enumerate(init)], {}
    slices = [w.rec.layers(v.id, (sc.length, *a.shape), a.dtype) for v, a in zip(xs, x_avals, strict=True)]
    frame, eqn = w.rec.frames[-1], w.eqn
    spans, body_ins, body_outs = [], [], []
    for layer in reversed(range(sc.length)) if sc.reverse else range(sc.length):
        body_xs = []
        for v, ids in zip(xs, slices, strict=True):
            i = ids[layer]
            if v.layers is not None:  # leaves stacked for the scan (`rule_stack`): layer i reads leaf i
                body_xs.append(v.layers[layer])
            elif v.kind == PARAM:
                leaf = w.layer_slice(v.leaf, layer)
                body_xs.append(Val(PARAM, [list(ax) for ax in w.leaf_axes[leaf]], leaf=leaf, id=i))
            else:
                body_xs.append(dataclasses.replace(v, axes=[list(ax) for ax in v.axes[1:]], id=i))
        start = len(frame.eqns)
        outs = w.run_closed(sc.body, list(consts) + carry + body_xs)
        spans.append((start, len(frame.eqns)))
        body_ins.append([v.id for v in list(consts) + carry + body_xs])
        body_outs.append([v.id for v in outs])
        carry, per_layer[layer] = (
            [v if k == counter else _carry_in(w, v) for k, v in enumerate(outs[:nk])],
            outs[nk:],
        )
    ys = []
    for j, a in enumerate(y_avals):
        vals = [per_layer[layer][j] for layer in range(sc.length)]
        # the layers' params given back stacked (nnx.scan returns the modules it scanned over; under nnx.remat
        # JAX cannot see that they are its inputs) are the leaf again, not a value the layers share: untied
        tied = vals[1:] if vals[0].kind != PARAM else []
        for v in tied:
            for a0, b in zip(vals[0].axes, v.axes, strict=True):
                w.atoms.unify(a0, b, w.reason("stacked over the layers of a scan"))
        ys.append(dataclasses.replace(vals[0], id=w.rec.stack([v.id for v in vals], a.shape, a.dtype)))
    plain = counter is None and all(v.layers is None for v in xs)
    frame.stacks.append(ir.LayerStack(eqn, tuple(w.callers), sc, [v.id for v in init], [v.id for v in xs], spans,
                                   body_ins, body_outs, [v.id for v in ys], plain))  # fmt: skip
    return carry, ys


def rule_scan(w: Walker, eqn, ins):
    sc = jx.scan(eqn)
    nc, nk = sc.num_consts, sc.num_carry
    consts, init, xs = ins[:nc], ins[nc : nc + nk], ins[nc + nk :]
    for v in xs:  # the scanned axis: positions (time steps, or layers)
        if v.axes:
            w.atoms.make_positions(v.axes[0])
    sliced = [v for v in xs if v.kind == PARAM]
    stacked = [v for v in xs if v.layers is not None]
    counter = None if sliced or stacked else _layer_counter(w, sc, consts, init)
    layers = bool(sliced or stacked) and all(v.axes == w.leaf_axes[v.leaf] for v in sliced)
    layers = layers or counter is not None
    if layers:
        carry, ys = _layer_stack(w, sc, consts, init, xs, counter)
    else:  # a recurrence: its body recorded as a program of its own
        carry = [_carry_in(w, v) for v in init]
        body_xs = []
        for v in xs:
            for leaf in v.layers or ():
                w.mark_other(leaf, "stacked and sliced by a scan")
            if v.kind == PARAM:
                w.mark_other(v, "sliced by a scan")
                body_xs.append(Val(CONST, [list(ax) for ax in v.axes[1:]]))
            else:
                body_xs.append(dataclasses.replace(v, axes=[list(ax) for ax in v.axes[1:]]))
        body = w.rec.push()
        body_ins = [v.with_id(w.rec.new()) for v in list(consts) + carry + body_xs]
        body.in_ids = [v.id for v in body_ins]
        outs = w.run_closed(sc.body, body_ins)
        body.out_ids = [v.id for v in outs]
        w.rec.pop()
        _tie_carry(w, init, carry, outs[:nk])
        ys = outs[nk:]
    time = [w.atoms.new(sc.length, position=True)]
    ys = [dataclasses.replace(v, axes=[list(time)] + v.axes, kind=v.kind if v.kind != PARAM else CONST) for v in ys]
    return ir.Recorded(carry + ys) if layers else w.record(eqn, ins, carry + ys, scan=sc, body=body)


def rule_while(w: Walker, eqn, ins):
    loop = jx.while_loop(eqn)
    cn, bn = loop.cond_nconsts, loop.body_nconsts
    bconsts, init = ins[cn : cn + bn], ins[cn + bn :]
    carry = [_carry_in(w, v) for v in init]
    w.rec.push()  # recorded as one equation (the programs refuse while loops)
    outs = w.run_closed(loop.body, list(bconsts) + carry)
    w.rec.pop()
    _tie_carry(w, init, carry, outs)
    return carry


def rule_cond(w: Walker, eqn, ins):
    ops = ins[1:]
    w.rec.push()  # recorded as one equation (the programs refuse cond)
    results = [w.run_closed(br, ops) for br in jx.cond_branches(eqn)]
    w.rec.pop()
    outs = []
    for vals in zip(*results):
        acts = [v for v in vals if v.kind == ACT]
        if not acts:
            outs.append(Val(CONST, [list(a) for a in vals[0].axes]))
            continue
        for v in acts[1:]:
            for a, b in zip(acts[0].axes, v.axes):
                w.atoms.unify(a, b, w.reason("branches of cond"))
        outs.append(acts[0])
    return outs
