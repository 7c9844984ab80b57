"""Layer stacks kept rolled (`rolled`): a scan over layers (``nn.scan``) whose layers the interpreter recorded alike
stays one ``scan`` over the stacked leaves in κ's and DDP's programs, which then stop growing with depth."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from pathspace_jax import jaxpr as jx
from pathspace_jax.ir import Eqn, Frame, LayerStack


def all_eqns(eqns):
    """``eqns`` and the equations of the custom calls among them (`Eqn.inner`), depth first."""
    for e in eqns:
        yield e
        if e.inner is not None:
            yield from all_eqns(e.inner)


def _same(a, b) -> bool:
    """Whether two equation params, literals or constants are the same value (arrays by their entries)."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray | jax.Array):
        return a.shape == b.shape and a.dtype == b.dtype and bool(np.array_equal(a, b))
    if isinstance(a, tuple | list):
        return len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:  # a tracer, or a type whose == is not a truth value
        return False


def rolled(frame: Frame, flags: dict, n_params: int, min_layers: int) -> Frame:
    """``frame`` with each scan over ``min_layers`` layers or more (`pathspace_jax.program.ROLL_LAYERS`;
    `pathspace_jax.ir.LayerStack`: ``nn.scan`` over layers, its body recorded once per layer) kept as one ``scan``
    equation over the stacked leaves, its body the recording of the layer that ran first, wherever every layer's
    recording is that one up to ids (equations, params, constants and flags). The |·|^p network and DDP's forward
    pass then run it as they run a recurrence, each layer's slices the inputs of its step, and never unroll it
    (`Eqn.layers`): the programs that κ and DDP's statistics compile are one layer long however deep the stack. A
    stack is left unrolled (as recorded: the same network) where that is not so, or where its layers read a value
    computed from the parameters alone or from the inputs alone other than through their slices (a weight shared by
    the layers: tying; a mask: a gate), where something outside a layer reads a value inside it, or where its final
    carry is not read (the unrolled program drops the last layer's dead code)."""
    stacks = [s for s in frame.stacks if s.plain and s.scan.length >= max(min_layers, 2)]
    if not stacks:
        return frame
    params = set(frame.in_ids[:n_params])
    dep: dict = {i: frozenset({"p" if i in params else "x"}) for i in frame.in_ids}  # params, inputs upstream
    readers: dict = {}
    for k, e in enumerate(frame.eqns):
        for sub in all_eqns([e]):
            for x in sub.ins:
                if not isinstance(x, tuple):
                    readers.setdefault(x, set()).add(k)
        d = frozenset().union(*(dep.get(x, frozenset()) for x in e.ins if not isinstance(x, tuple)))
        dep.update(dict.fromkeys(e.outs, d))
    for i in frame.out_ids:
        if not isinstance(i, tuple):
            readers.setdefault(i, set()).add(len(frame.eqns))
    rolled: dict[int, Eqn] = {}  # start of a rolled stack's first layer -> its scan equation
    skip: set[int] = set()
    for st in sorted(stacks, key=lambda st: st.spans[0][0] - st.spans[-1][1]):  # a stack in a layer: in its body
        if st.spans[0][0] in skip:
            continue
        found = _roll(frame, flags, st, dep, readers)
        if found is not None:
            eqn, drop = found
            rolled[st.spans[0][0]] = eqn
            skip |= drop
    if not rolled:
        return frame
    eqns = []
    for k, e in enumerate(frame.eqns):
        if k in rolled:
            eqns.append(rolled[k])
        if k not in skip:
            eqns.append(e)
    return dataclasses.replace(frame, eqns=eqns, stacks=[])


def _roll(frame: Frame, flags: dict, st: LayerStack, dep: dict, readers: dict):
    """The scan equation of `_rolled` for ``st`` and the indices of the equations it replaces, or None."""
    nc, nk, length = st.scan.num_consts, st.scan.num_carry, st.scan.length
    spans, eqns, consts = st.spans, frame.eqns, frame.consts
    first = [eqns[k] for k in range(*spans[0])]
    if any(e.body is not None for e in all_eqns(first)) or len({b - a for a, b in spans}) != 1:
        return None
    inside = set().union(*(range(a, b) for a, b in spans))
    after = spans[-1][1]  # the equations that stack the ys follow the last layer's
    made = {o: k for k in range(after, len(eqns)) for o in eqns[k].outs}
    if not all(y in made for y in st.ys):
        return None
    group = inside | set(range(after, max((made[y] + 1 for y in st.ys), default=after)))
    last = st.outs[-1]
    defined = {o for k in group for e in all_eqns([eqns[k]]) for o in e.outs}
    final = set(last[:nk])
    if any(isinstance(x, tuple) for ids in st.ins + st.outs for x in ids) or not final <= defined:
        return None  # (a literal operand or result: a zero carry to start from)
    for o in defined - final - set(st.ys):
        if not readers.get(o, set()) <= group:  # a value inside a layer read outside the stack
            return None
    if not all(readers.get(o, set()) - group for o in final):  # the final carry is read
        return None
    ys_read = [j for j, y in enumerate(st.ys) if readers.get(y)]
    for layer in range(1, length):
        m = dict(zip(st.ins[layer], st.ins[0], strict=True))

        def same(a, b, m=m):
            if isinstance(a, tuple) or isinstance(b, tuple):
                return isinstance(a, tuple) and isinstance(b, tuple) and _same(a[1], b[1])
            if a in m:
                return m[a] == b
            if a in consts and b in consts and a != b:
                return _same(consts[a], consts[b])
            return a == b

        def match(el, e0, m=m):
            if el.prim is not e0.prim or el.source is not e0.source or len(el.ins) != len(e0.ins):
                return False
            if (el.edge, el.coefficient, el.exclusive, el.inner is None) != (e0.edge, e0.coefficient, e0.exclusive,
                                                                             e0.inner is None):  # fmt: skip
                return False
            if not _same(el.params, e0.params) or not all(map(same, el.ins, e0.ins)):
                return False
            if el.inner is not None and (len(el.inner) != len(e0.inner) or not all(map(match, el.inner, e0.inner))):
                return False
            for a, b in zip(el.outs, e0.outs, strict=True):
                if m.setdefault(a, b) != b:
                    return False
            return True

        here = [eqns[k] for k in range(*spans[layer])]
        if not all(map(match, here, first)) or not all(map(same, st.outs[layer], st.outs[0])):
            return None
        if any(flags.get(a) != flags.get(b) for a, b in m.items()):
            return None
    own = set(st.ins[0]) | {o for e in all_eqns(first) for o in e.outs}
    free = list(dict.fromkeys(x for e in all_eqns(first) for x in e.ins
                              if not isinstance(x, tuple) and x not in own and x not in consts))  # fmt: skip
    read = [x for e in all_eqns(first) for x in e.ins] + st.outs[0]
    body_consts = {x: consts[x] for x in read if not isinstance(x, tuple) and x in consts}
    outer = free + st.ins[0][:nc]
    if any(dep.get(x) in ({"p"}, {"x"}) for x in outer + st.init if not isinstance(x, tuple)):
        return None  # a weight every layer reads (tying), a value of the inputs alone (a mask)
    if any(dep.get(x) == {"x"} for x in st.xs) or any(flags.get(x) in ("const", True) for x in st.ins[0][nc + nk :]):
        return None  # the inputs scanned along the layers; slices of fixed coefficients
    if set(outer) & {x for ins in st.ins for x in ins[nc:]}:
        return None
    body = Frame(free + st.ins[0], first, body_consts, st.outs[0][:nk] + [st.outs[0][nk + j] for j in ys_read])
    scan = jx.Scan(len(outer), nk, length, st.scan.reverse, None)  # (no jaxpr of its own: no κ⁽²⁾ term)
    eqn = Eqn(*jx.primitive_and_params(st.eqn), outer + st.init + st.xs, last[:nk] + [st.ys[j] for j in ys_read],
              st.eqn, st.callers, scan=scan, body=body, layers=True)  # fmt: skip
    return eqn, group
