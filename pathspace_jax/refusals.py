"""What path sums and DDP's statistics refuse in a traced network, with the reason and a fix: the first axis of
an input scanned over (not examples), a parameter crossed twice by one path outside a recurrence (weight tying), and
choices between parameters per entry (a branch, a maximum over weights)."""

from __future__ import annotations

from pathspace_jax import jaxpr as jx
from pathspace_jax.graph import PathSpace
from pathspace_jax.ir import Program
from pathspace_jax.program import live
from pathspace_jax.rules import Op


def refuse_undefined(space: PathSpace, who: str, err: type) -> None:
    """Path sums and DDP's statistics take the first axis of every input as the examples (one all-ones example; the
    statistics' average): an input whose first axis the function scans or convolves over (time-major sequences) is
    an error."""
    if space.positions_first:
        raise err(
            f"{who}: the traced function scans or convolves over the first axis of its input(s) "
            f"#{', #'.join(map(str, space.positions_first))} (time-major sequences?), which {who} takes as the "
            "batch of examples: trace a function that takes the examples first (nn.RNN(time_major=False), or "
            "transpose the inputs inside the function)."
        )


def refuse_tying(prog: Program, space: PathSpace, who: str, what: str) -> None:
    """Weight tying (one parameter used by several operations) puts it twice on a path where one use is
    downstream of another: raise ``prog.err`` for that (``who`` the function refusing, ``what`` why and what
    to do), and for a parameter used twice in a recurrence's body. Uses that no path joins (a tied embedding
    whose table is looked up into a pinned group and read again as the decoder: the paths end at the
    boundary) are no tying for path sums: no path crosses the table twice. Nor are the uses of a leaf of kind
    "other" (the slope of one ``nn.PReLU`` applied after two layers): it is no edge, so κ is not computed for it
    and no edge is crossed twice."""
    other = {i for i, leaf in zip(prog.in_ids[: prog.n_params], space.leaves, strict=True) if leaf.kind == "other"}
    todo = [(set(prog.in_ids[: prog.n_params]) - other, prog, "")]
    for e in prog.eqns:
        if e.body is not None:  # a scan
            bp = e.body
            p_ids = {i for i, x in zip(bp.in_ids, e.ins, strict=True) if bp.kinds[i] == "param" and x not in other}
            todo.append((p_ids, bp, f" (scan body at {e.where})"))
    for p_ids, pr, where in todo:
        kept = {id(e): e for e in live(pr.eqns, pr.out_ids)}
        ids = (x for e in kept.values() for x in {x for x in e.ins if not isinstance(x, tuple)} if x in p_ids)
        for x in dict.fromkeys(ids):  # (in the order of their first uses)
            es = list({id(e): e for e in pr.uses[x] if id(e) in kept}.values())  # each reader once
            if len(es) > 1 and not _disjoint_slices(es) and (where or _on_one_path(pr, es)):
                raise prog.err(
                    f"{who}: a parameter is used by several operations{where} (weight tying, at {es[0].where} "
                    f"and {es[1].where}), so a path can cross it twice outside a recurrence; {what}"
                )


def refuse_exclusive_branches(prog: Program, space: PathSpace, what: str) -> None:
    """Raise ``prog.err`` for a ``max`` (maxout) or a ``select_n`` on a condition computed from the inputs (a branch
    written with ``jnp.where``) between activations that different edge parameters feed, or a maximum over pieces
    that different weights feed (``Eqn.exclusive``: maxout by a reshape, max pooling after ``nn.ConvLocal``)
    (``what``: what to do).
    The |·|^p network evaluates it on its own all-ones input and keeps one operand per entry, so the path sums
    would leave out the weights of the others, which the data still trains: κ would be 0 there and Path-SGD would
    never update them. A ReLU, a leaky ReLU, ``nn.PReLU`` (its slope is a coefficient, not an edge: kind
    "other"), max-pooling and masks pass. A recurrence's body is followed step by step until what its carry
    depends on stops growing: a maxout cell's two pieces differ at the first step, and a maximum over time steps
    (``max(h, relu(x W))`` from a zero carry) compares an activation with a constant there."""
    data = "data"  # in a value's reach: it depends on the inputs (an activation at this step)

    def upstream(reach, xs):
        return [frozenset() if isinstance(x, tuple) else reach.get(x, frozenset()) for x in xs]

    def walk(pr: Program, reach: dict) -> None:  # reach: a value's edge parameters upstream (outer ids), and data
        for e in pr.eqns:
            ups = upstream(reach, e.ins)
            if e.body is not None:
                bp, nc, ncar = e.body, e.scan.num_consts, e.scan.num_carry
                while True:
                    inner = dict(zip(bp.in_ids, ups, strict=True))
                    walk(bp, inner)
                    outs = upstream(inner, bp.out_ids)
                    carry = [a | b for a, b in zip(ups[nc : nc + ncar], outs[:ncar], strict=True)]
                    if carry == ups[nc : nc + ncar]:
                        break
                    ups[nc : nc + ncar] = carry
                reach.update(zip(e.outs, carry + outs[ncar:], strict=True))
                continue
            which, cases = (ups[0], ups[1:]) if e.rule.op is Op.SELECT else (frozenset([data]), ups)
            acts = {r for r in cases if data in r}
            if e.exclusive and data in ups[0] and e.ins[0] not in pr.pinned:  # (`Eqn.exclusive`)
                op, which = "a maximum over pieces", "pieces that different weights feed (a maxout unit, max pooling "
                which, instead = which + "after nn.ConvLocal)", "."
            elif e.rule.op in (Op.MAX, Op.SELECT) and data in which and len(acts) > 1:
                op = "a max" if e.rule.op is Op.MAX else "a jnp.where on a condition computed from the inputs"
                which = "activations that different parameters feed (a maxout unit, or a branch)"
                instead = ", or choose the branch in Python."
            else:
                op = None
            if op is not None:
                raise prog.err(
                    f"{prog.who}: {op} at {e.where} chooses between {which}: the |w|^p network keeps one of them per "
                    f"entry, so κ would be 0 on the others' weights and they would never be updated. {what}{instead}"
                )
            made = all(pr.kinds[x] != "act" for x in e.ins if not isinstance(x, tuple))  # a lookup, a cast
            up = frozenset().union(*ups) | ({data} if made else set())
            reach.update((o, up if pr.kinds[o] == "act" else up - {data}) for o in e.outs)

    params = zip(prog.in_ids[: prog.n_params], space.leaves, strict=True)
    reach = {i: frozenset([i]) for i, leaf in params if leaf.kind != "other"}
    reach.update((i, frozenset([data])) for i in prog.in_ids[prog.n_params :] if prog.kinds[i] == "act")
    walk(prog, reach)


def _on_one_path(prog: Program, uses: list) -> bool:
    """Whether some path of the |·|^p network crosses two of ``uses`` (equations reading one parameter): a use
    in a loop, or one whose operands depend on another's results through values that are not boundaries (the
    paths that reach a pinned node end there, and what is computed from it starts new ones at 1)."""
    if any(e.body is not None for e in uses):
        return True
    stop, at = prog.bnd | set(prog.sinks), {id(e) for e in uses}
    reach: set[int] = set()
    for e in prog.eqns:
        joined = any(x in reach and x not in stop for x in e.ins if not isinstance(x, tuple))
        if joined and id(e) in at:
            return True
        if joined or id(e) in at:
            reach.update(e.outs)
    return False


def _disjoint_slices(eqns) -> bool:
    """Whether every use of a parameter is a static slice and no two slices share an entry (the layers of a leaf
    stacked with ``nn.scan``): no path crosses one entry twice, so that is no weight tying."""
    boxes = [jx.slice_box(e.prim.name, e.params) for e in eqns]
    if any(b is None for b in boxes):
        return False
    return all(
        any(hi_a <= lo_b or hi_b <= lo_a for (lo_a, hi_a), (lo_b, hi_b) in zip(a, b, strict=True))
        for i, a in enumerate(boxes)
        for b in boxes[i + 1 :]
    )
