"""The flat program of a traced function, shared by the |·|^p network, DDP's forward pass and
DDP-Normalization.

`program` re-traces ``space.fn`` at given shapes and runs the interpreter on its jaxpr once
(`pathspace_jax.trace.record`), which records the equations it runs on integer value ids (calls inlined, a
scan over layers once per layer: `pathspace_jax.ir`, which `pathspace_jax.rolled` keeps one scan where the layers
are the same network up to ids) and flags the values in node groups it pins. `_finish`
gives each value its kind, ``"param"`` (a view of the parameters), ``"act"`` (depends on the inputs) or
``"const"``; a recurrence is kept as one ``scan`` equation with its finished body (its carry kinds iterated
to a fixed point). It also marks the *node* pre-activations that DDP's recursion mixes statistics into: a
value produced by a parameterised linear map (possibly plus biases, residual branches and constant factors)
that is used by anything else (a ReLU, the next layer, two consumers, the function's output); every output
of the function is a node. The flagged values make the boundary: pinned nodes are *sinks* and what is
computed from them *boundary values* (`_find_boundary`). Integer inputs are token ids, and a gather of a
parameter by them an embedding lookup (the |·|^p network looks it up: `pathspace_jax.squared`); cast to floats,
an integer input is the input's values (uint8 pixels).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pathspace_jax import jaxpr as jx
from pathspace_jax.cut_nodes import cut_nodes
from pathspace_jax.graph import PathSpace
from pathspace_jax.ir import Eqn, Frame, Program, Role
from pathspace_jax.rolled import all_eqns, rolled
from pathspace_jax.rules import Op, draws
from pathspace_jax.trace import Cut, record

# The scans that κ and γ² add run a recurrence step by step, often at a tiny size (Path-SGD's |·|^p network on
# one all-ones example), where a GPU spends most of a loop iteration launching it: they are unrolled by up to
# SCAN_UNROLL steps, and by no more than keep the unrolled steps' carries within UNROLL_BYTES. A long sequence keeps
# a loop of ⌈length / SCAN_UNROLL⌉ iterations (compile time); a large carry (DDP's batch, κ⁽²⁾'s n × n lag sum)
# has enough work per step to hide the loop, and unrolled it would multiply the step's temporaries
# (benchmarks/README.md).
SCAN_UNROLL = 32
UNROLL_BYTES = 1 << 20


# A scan over at least ROLL_LAYERS layers (``nn.scan``) stays one scan in κ's and DDP's programs
# (`pathspace_jax.rolled`), which then compile in the same time at any depth and run as fast; a shallower one is
# written out layer by layer, which runs faster there.
ROLL_LAYERS = 16


def scan_unroll(length: int, carry_bytes: int) -> int:
    """The ``unroll`` of a scan of ``length`` steps that κ or γ² adds (`SCAN_UNROLL`, `UNROLL_BYTES`)."""
    return max(1, min(int(length), SCAN_UNROLL, UNROLL_BYTES // max(int(carry_bytes), 1)))


def nbytes(tree) -> int:
    """The bytes of the arrays in ``tree``."""
    return sum(int(np.prod(jnp.shape(a), dtype=np.int64)) * jnp.result_type(a).itemsize for a in jax.tree.leaves(tree))


# Why a program refuses a control-flow primitive (a scan only where ``allow_scan`` is off: DDP-Normalization).
_UNSUPPORTED = {
    Op.SCAN: (
        "a recurrence feeds its nodes through the same kernel at every step, while the normalisation divides each "
        "node's incoming weights by one statistic of that node: it is defined for feed-forward networks."
    ),
    Op.WHILE: (
        "the loop's number of steps is decided at run time (lax.while_loop, or lax.fori_loop with traced bounds), "
        "so its paths are not known from the program. Use lax.scan, or lax.fori_loop with Python int bounds."
    ),
    Op.COND: (
        "the paths of the network depend on the branch taken (lax.cond, lax.switch, nn.cond). Choose the branch "
        "in Python (a static argument of the traced function: one network per branch)."
    ),
}


def _join(a: str, b: str) -> str:
    order = {"const": 0, "param": 1, "act": 2}
    return a if order[a] >= order[b] else b


def _finish(
    frame: Frame,
    flags: dict,
    n_params: int,
    *,
    who: str,
    err: type,
    allow_scan: bool = False,
    inline_custom: bool = False,
    in_kinds: Sequence[str] | None = None,
    in_pinned: Sequence[bool] | None = None,
    int_inputs: Sequence[bool] = (),
    numbers: Sequence[bool] = (),
) -> Program:
    """The `Program` of a recorded ``frame`` (`pathspace_jax.trace.record`; ``flags`` its values' flags): each
    value's kind, the values in boundary groups, the nodes and the boundary. ``allow_scan`` keeps each recorded
    ``scan`` as one equation whose ``body`` is the finished body (its in_ids: consts, carry, xs; carry kinds
    joined with the body's carry outputs); otherwise scan, while and cond raise ``err``. ``inline_custom``
    enters every ``custom_jvp``/``custom_vjp`` call (``jax.nn.relu`` becomes a plain ``max``); otherwise
    ReLU-like ones are kept whole (`_kept_whole`). ``in_kinds`` overrides the kinds of the inputs (a scan
    body's), ``in_pinned`` their flags; ``numbers`` the integer inputs that are values where cast to floats (uint8
    pixels); ``int_inputs`` marks the inputs that are token ids (or boolean masks:
    constants of the network too). Each equation of the result has its `pathspace_jax.ir.Role`."""
    eqns: list[Eqn] = []
    kinds: dict[int, str] = dict.fromkeys(frame.consts, "const")
    pinned: set[int] = set()
    tokens: set[int] = set()  # integer values computed from integer inputs (token ids), of kind "const"
    lookups: set[int] = set()
    fixed: set[int] = set()
    cut: dict[int, Cut] = {}
    in_ids = frame.in_ids

    def kind_of(x):
        return "const" if isinstance(x, tuple) else kinds[x]

    def walk(raw: list[Eqn]) -> None:
        for e in raw:
            ks = [kind_of(x) for x in e.ins]
            op = e.rule.op
            if e.inner is not None and (inline_custom or not _kept_whole(e, ks)):
                walk(e.inner)
                continue
            if op is Op.SCAN and allow_scan:
                eqns.append(_finish_scan(e, ks, kinds, pinned, flags, who, err, inline_custom))
                continue
            if op in _UNSUPPORTED:
                raise err(f"{who}: {e.prim.name} at {e.where} is not supported: {_UNSUPPORTED[op]}")
            k = functools.reduce(_join, ks, "const")
            ins_ids = [x for x in e.ins if not isinstance(x, tuple)]
            if op is Op.CAST and ins_ids and ins_ids[0] in number_ids:
                if jnp.issubdtype(jx.cast_dtype(e.params), jnp.floating):
                    k = "act"  # integer features read as numbers (uint8 pixels cast to float): the input's values
            from_tokens = any(x in tokens for x in ins_ids)
            lookup = from_tokens and op is Op.GATHER and ks[0] == "param"
            if lookup:
                k = "act"  # an embedding lookup: the one-hot input times the table (`pathspace_jax.squared`)
            if draws(e.prim.name):
                k = "act"  # random numbers: a value of the inputs alone (their keys), a gate (`_input_gates`)
            for i in e.outs:
                kinds[i] = k
                if flags.get(i) is True and k == "act":
                    pinned.add(i)
                elif isinstance(flags.get(i), Cut) and k == "act":
                    cut[i] = flags[i]
                elif flags.get(i) in ("const", True) and k == "param":
                    # parameters combined into fixed coefficients (not an edge), or into values the trace read as
                    # activations of pinned groups (a power iteration from a constant vector: spectral normalisation)
                    fixed.add(i)
                if lookup:
                    lookups.add(i)
                elif from_tokens and k == "const":
                    tokens.add(i)
            eqns.append(e if e.inner is None else dataclasses.replace(e, inner=None, whole=True))  # a call kept whole

    for j, i in enumerate(in_ids):
        kinds[i] = in_kinds[j] if in_kinds is not None else "param" if j < n_params else "act"
    for i, is_int in zip(in_ids[n_params:], int_inputs, strict=False):  # token ids select embedding rows
        if is_int:
            kinds[i] = "const"
            tokens.add(i)
    number_ids = {i for i, is_number in zip(in_ids[n_params:], numbers, strict=False) if is_number}
    in_flags = in_pinned if in_pinned is not None else [flags.get(i) for i in in_ids]
    pinned.update(i for i, f in zip(in_ids, in_flags, strict=True) if f is True and kinds[i] == "act")
    walk(frame.eqns)
    eqns = _live(eqns, frame.out_ids)
    prog = Program(eqns, n_params, in_ids, frame.out_ids, frame.consts, kinds, [], [], who, err, pinned,
                   lookups=lookups, fixed=fixed, cut=cut)  # fmt: skip
    _mark(prog, body=in_kinds is not None)
    return prog


def _mark(prog: Program, body: bool) -> None:
    """Mark a program's gates and masks, its nodes (cut into their groups where those are pinned in part) and its
    boundary, then give each equation its `Role` (`_role`). ``body``: a scan's body."""
    _input_gates(prog, body)
    prog.masks = _masks(prog)
    fresh = _find_nodes(prog, body=body)
    if (joined := cut_nodes(prog, fresh)) is not None:
        fresh = _find_nodes(prog, body=body)
        # a cut output: its paths end at its pieces, the sinks (`_find_boundary`), and not again at their concatenation
        pieces = [p for ps in joined.values() for p in ps]
        prog.pinned.update(pieces)
        prog.nodes = [v for v in prog.nodes if v not in joined] + [p for p in pieces if p not in prog.nodes]
        prog.outputs = [v for v in prog.outputs if v not in joined]
    _find_boundary(prog, fresh, body=body)
    prog.eqns = [dataclasses.replace(e, role=_role(prog, e)) for e in prog.eqns]


def _role(prog: Program, e: Eqn) -> Role:
    """What the finished program ``prog`` made of its equation ``e`` (`pathspace_jax.ir.Role`), from its kinds and
    the values it marked: what the executors dispatch on."""
    kind = prog.kinds[e.outs[0]]
    if e.body is not None:
        return Role.SCAN
    if kind in ("const", "param"):
        return Role.CONST if kind == "const" else Role.PARAM
    if e.outs[0] in prog.masks:
        return Role.MASK
    if all(o in prog.bnd for o in e.outs):
        return Role.BOUNDARY
    return Role.LOOKUP if e.outs[0] in prog.lookups else Role.ACT


def _live(eqns: list[Eqn], out_ids) -> list[Eqn]:
    """The equations that the outputs depend on: a value computed and never used (a jaxpr keeps it) would read as
    one more consumer of a pre-activation, making it a node of its own (`_find_nodes`)."""
    need = {x for x in out_ids if not isinstance(x, tuple)}
    live = []
    for e in reversed(eqns):
        if any(o in need for o in e.outs):
            live.append(e)
            need.update(x for x in e.ins if not isinstance(x, tuple))
    return live[::-1]


def _kept_whole(e: Eqn, ks) -> bool:
    """Whether a custom_jvp/custom_vjp call is kept as one equation (not entered): ReLU-like code (``jax.nn.relu``)
    whose primitives the |·|^p network evaluates as they are, without sums and without parameters, and whose
    results its body computes."""
    made = {o for x in e.inner for o in x.outs}
    return (
        "param" not in ks
        and all(not isinstance(o, tuple) and o in made for o in e.outs)
        and all(x.rule.as_is and not x.rule.sums for x in all_eqns(e.inner) if x.inner is None)
    )


def _finish_scan(e: Eqn, ks, kinds, pinned, flags, who, err, inline_custom) -> Eqn:
    """A recorded recurrence (``scan``): its body finished with the carry kinds iterated to a fixed point."""
    sc = e.scan
    nc, ncar = sc.num_consts, sc.num_carry
    in_k = list(ks)
    in_p = [not isinstance(x, tuple) and x in pinned for x in e.ins]
    for j in range(ncar):  # a carry is pinned where its result is (trace ties their atoms)
        in_p[nc + j] = flags.get(e.outs[j]) is True
    for _ in range(len(in_k) + 2):
        bp = _finish(e.body, flags, 0, who=who, err=err, allow_scan=True, inline_custom=inline_custom,
                     in_kinds=in_k, in_pinned=in_p)  # fmt: skip
        out_k = [("const" if isinstance(x, tuple) else bp.kinds[x]) for x in bp.out_ids]
        new_k = list(in_k)
        for j in range(ncar):
            new_k[nc + j] = _join(in_k[nc + j], out_k[j])
        if new_k == in_k:
            break
        in_k = new_k
    for j, o in enumerate(e.outs):
        kinds[o] = in_k[nc + j] if j < ncar else out_k[j]
        if flags.get(o) is True:
            pinned.add(o)
    return dataclasses.replace(e, body=bp)


def _find_nodes(prog: Program, body: bool = False) -> set[int]:
    """Mark the node pre-activations (see the module docstring); returns the linear accumulations. In a
    scan ``body``, the nodes are its pre-activations at one step of the unrolled network."""
    kinds, uses = prog.kinds, prog.uses
    fresh: set[int] = set()

    def cut(e: Eqn) -> bool:  # a split that is its operand's only use: its pieces are the nodes (`cut_nodes`)
        return e.rule.op is Op.SPLIT and uses.get(e.ins[0]) == [e]

    def concatenated(e: Eqn) -> bool:  # pre-activations side by side, each read there alone: one node where read
        acts = [x for x in e.ins if not isinstance(x, tuple) and kinds[x] == "act"]
        if e.rule.op is not Op.CONCAT or e.outs[0] in prog.joins:  # (not the pieces of a cut node joined back)
            return False
        return all(x in fresh and uses[x] == [e] for x in acts)

    for e in prog.eqns:
        ids = [x for x in e.ins if not isinstance(x, tuple)]
        if kinds[e.outs[0]] != "act":
            continue
        if prog.is_edge(e) or e.outs[0] in prog.lookups:
            fresh.add(e.outs[0])
        elif cut(e) and ids[0] in fresh:
            fresh.update(e.outs)
        elif concatenated(e):  # (a residual added to it: the sum is the node, as with one kernel per piece)
            fresh.add(e.outs[0])
        elif e.rule.continues_node and not any(x in prog.masks for x in ids):  # a gate ends it, as ReLU does
            # (a pre-activation read by anything else is a node there, and what it goes on to is no node again)
            if any(x in fresh and all(u is e for u in uses[x]) for x in ids):
                fresh.add(e.outs[0])
    outs = [x for x in prog.out_ids if not isinstance(x, tuple) and kinds[x] == "act"]
    nodes = []
    for e in prog.eqns:
        for v in e.outs:
            if kinds[v] != "act":
                continue
            us = uses.get(v, [])
            if v in outs and (not body or v in fresh):  # a body's outputs (carry, ys) are not nodes as such
                nodes.append(v)
                continue
            if v not in fresh:
                continue
            merged = len(us) == 1 and (us[0].rule.continues_node or cut(us[0]) or concatenated(us[0]))
            if merged and us[0].rule.scales:  # by constant factors, or a gate (a pinned value)
                other = [x for x in us[0].ins if x != v]
                merged = all(isinstance(x, tuple) or kinds[x] == "const" or x in prog.pinned for x in other)
            if not merged:
                nodes.append(v)
    for i in prog.in_ids[prog.n_params :]:  # an input returned as it is
        if i in outs and not body:
            nodes.append(i)
    prog.nodes = nodes
    prog.outputs = list(dict.fromkeys(outs))
    return fresh


def _find_boundary(prog: Program, fresh: set[int], body: bool = False) -> None:
    """Pinned groups as boundaries: the pinned nodes are *sinks* (the paths that reach them end there, and
    their |·|^p values are added to the total) and, for everything downstream, *sources* of value 1, like
    inputs. Values computed from boundary values without a parameter edge (a LayerNorm, a tanh head) are
    boundary values too (`prog.bnd`): they are 1 in the |·|^p network, and parameter edges leaving them
    start new paths. A bias added to a boundary value (a LayerNorm's offset without a scale) ends at a sink of
    its own. A gate computed from the inputs alone (``h * sigmoid(x)``, a dropout mask) is a boundary value too: no
    rescaling changes it, and the |·|^p network takes it as 1, as attention's weights (in a scan ``body``, the random
    draws only: its other inputs are the carry's and the steps').
    """
    gates = _input_gates(prog, body)
    if not prog.pinned and not gates:
        return
    kinds, pinned, node_set, of_inputs = prog.kinds, prog.pinned, set(prog.nodes), prog.of_inputs
    sinks: list[int] = []
    bnd = {i for i in prog.in_ids if i in pinned} | gates
    for e in prog.eqns:
        if e.outs[0] in gates:
            continue
        if e.body is not None:  # a scan
            body_bnd = e.body.bnd | set(e.body.sinks)
            for j, o in enumerate(e.outs):
                x = e.body.out_ids[j]
                if o in pinned or (not isinstance(x, tuple) and x in body_bnd):
                    bnd.add(o)
            continue
        act_ins = [x for x in e.ins if not isinstance(x, tuple) and kinds[x] == "act"]
        edge = prog.is_edge(e)
        for o in e.outs:
            if kinds[o] != "act":
                continue
            if (
                act_ins
                and not edge
                and all(x in bnd or x in of_inputs for x in act_ins)
                and any(x in bnd for x in act_ins)
            ):
                bnd.add(o)  # computed from boundary values only (and values of the inputs alone: an additive mask)
                if e.rule.elementwise_sum and any(map(prog.edge_param, e.ins)):
                    sinks.append(o)  # a bias edge enters a boundary node (an offset without a scale)
            elif o in pinned and o in node_set:
                sinks.append(o)  # the paths of the homogeneous part end here
                bnd.add(o)
            elif o in pinned and o not in fresh:
                bnd.add(o)
    prog.sinks = sinks
    prog.bnd = bnd - set(sinks)
    prog.into_sinks = _into_sinks(prog, fresh)
    keep = (node_set - prog.bnd) | set(sinks)
    prog.nodes = [o for e in prog.eqns for o in e.outs if o in keep]
    prog.nodes += [i for i in prog.in_ids if i in keep]
    prog.outputs = [v for v in prog.outputs if v not in bnd]


def _into_sinks(prog: Program, fresh: set[int]) -> set[int]:
    """The sums that a sink continues as its node (a residual ``x + f(x)`` reshaped, its only use, into the pinned
    node): only the paths of the homogeneous part end at the sink, so the sum's boundary operands (``x``, 1 in the
    |·|^p network) are left out there, as where the sum itself is the sink."""
    made, uses = prog.made, prog.uses
    found, todo = set(), list(prog.sinks)
    while todo:
        e = made.get(todo.pop())
        if e is None or prog.is_edge(e) or not e.rule.continues_node:
            continue
        for x in e.ins:
            if not isinstance(x, tuple) and x in fresh and len({id(u) for u in uses[x]}) == 1 and x not in found:
                found.add(x)
                todo.append(x)
    return {x for x in found if made[x].rule.elementwise_sum}


def _masks(prog: Program) -> set[int]:
    """The activation values of degree 0: comparisons of activations (``h > 0``) and other operations whose result
    does not scale with their operands (``sign``), and what is computed from them and constants alone (a cast, a
    ``(sign(h) + 1) / 2``). The trace reads them as constants of the structure (a mask: ReLU written as
    ``h * (h > 0)``); the |·|^p network evaluates them as they are on its non-negative values, where they are
    ReLU's gate, and a product raises them to p as it does any constant coefficient (`pathspace_jax.squared`). What is
    computed from a random draw (``prog.gates``) is no mask, whatever else it reads (a token sampled from logits): the
    |·|^p network never evaluates a draw."""
    kinds, masks, drawn = prog.kinds, set(), set(prog.gates)
    for e in prog.eqns:
        ids = [x for x in e.ins if not isinstance(x, tuple)]
        acts = [x for x in ids if kinds[x] == "act"]
        if any(x in drawn for x in ids) and not prog.is_edge(e):  # (a token sampled from logits: never evaluated)
            drawn.update(e.outs)
            continue
        if not acts or e.body is not None or any(kinds[x] == "param" for x in ids):
            continue
        if e.rule.structure in ("compare", "degree0") or all(x in masks for x in acts):
            masks.update(o for o in e.outs if kinds[o] == "act")
    return masks


def _input_gates(prog: Program, body: bool = False) -> set[int]:
    """The results of operations that the |·|^p network does not evaluate (a sigmoid, an exp, a product of two such
    values: an input masked by another) applied to values computed from the inputs without parameters:
    coefficients of the examples (a gate), never rescaled; and the random draws (`rules.draws`) and what is computed
    from them and the inputs alone (a dropout mask, a VAE's noise), values of the inputs (the keys) that the |·|^p
    network does not compute. In a scan ``body``, the draws only. Sets ``prog.gates`` and ``prog.of_inputs``, all
    the values computed from the inputs alone."""
    kinds = prog.kinds
    plain = set() if body else {i for i in prog.in_ids[prog.n_params :] if kinds[i] == "act"}
    gates: set[int] = set()
    drawn: set[int] = set()  # the gates computed from draws
    for e in prog.eqns:
        ids = [x for x in e.ins if not isinstance(x, tuple)]
        acts = [x for x in ids if kinds[x] == "act"]
        if draws(e.prim.name):
            gates.update(e.outs)
            drawn.update(e.outs)
            continue
        if any(x in drawn for x in acts) and any(map(prog.edge_param, ids)) and e.rule.multiplicative:
            if not prog.is_edge(e):
                raise prog.err(
                    f"{prog.who}: {e.prim.name} at {e.where} multiplies parameters by random numbers (DropConnect, "
                    "weight noise): path sums are defined for the weights themselves. Apply the noise to the "
                    "activations (dropout), or use G-SGD"
                )
        if not acts or any(kinds[x] == "param" for x in ids) or not all(x in plain or x in gates for x in acts):
            continue
        product = e.rule.multiplicative and len(acts) > 1
        known = e.rule.evaluated and not product and not any(x in gates for x in acts)
        (plain if known else gates).update(o for o in e.outs if kinds[o] == "act")
        if any(x in drawn for x in acts):
            drawn.update(o for o in e.outs if kinds[o] == "act")
    prog.of_inputs, prog.gates = plain | gates, gates
    return gates


def program(space: PathSpace, param_key: tuple, input_key: tuple, *, dtype=None, **options) -> Program:
    """The flat program of ``space.fn`` at these (shape, dtype) keys, for the abstract mesh in context.

    Cached per space, keys and mesh: under a mesh (``jax.set_mesh``) JAX records shardings in the equations'
    params, and a program traced under one mesh (or none) does not run under another. ``options``: ``who`` and
    ``err`` (the public function and the error it raises), ``allow_scan``, ``inline_custom`` (see `_finish`),
    ``const_inputs`` (a bool per input: constants of the network, of kind ``"const"`` like a value closed over).

    ``dtype``: the floating-point type to compute in at least (`widen`), where the function computes in a
    narrower one (a model with ``dtype=jnp.bfloat16`` and float32 parameters): κ and DDP's statistics are
    the network's, not its rounding's (in float16, squares and sums of paths overflow). Its floating-point
    inputs are then to be given in ``dtype`` at least (`at_least`).
    """
    return _program(space, param_key, input_key, jax.sharding.get_abstract_mesh(), dtype=dtype, **options)


def narrower(t, dtype) -> bool:
    """Whether ``t`` is a floating-point type narrower than ``dtype`` (bfloat16 or float16 than float32)."""
    return jnp.issubdtype(t, jnp.floating) and np.dtype(t) != np.dtype(dtype) and jnp.promote_types(t, dtype) == dtype


def at_least(values: Sequence, dtype) -> list:
    """``values`` with floating-point arrays narrower than ``dtype`` cast to ``dtype`` (a widened program's inputs)."""
    return [v.astype(dtype) if narrower(jnp.result_type(v), dtype) else v for v in values]


def widen(prog: Program, dtype) -> Program:
    """``prog`` computing in ``dtype`` wherever it computed in a narrower floating-point type: casts to a narrower
    type, products accumulating in one, and literals and constants of one, raised to ``dtype``, scan bodies
    included. Run on inputs cast up (`at_least`), every floating-point value is at least ``dtype``."""
    up = functools.partial(narrower, dtype=dtype)

    def value(v):
        return v.astype(dtype) if up(jnp.result_type(v)) else v

    def operand(x):
        return ("lit", value(np.asarray(x[1]))) if isinstance(x, tuple) else x

    eqns = [
        dataclasses.replace(
            e,
            params=jx.widened_params(e.prim.name, e.params, dtype, up),
            ins=[operand(x) for x in e.ins],
            body=None if e.body is None else widen(e.body, dtype),
        )
        for e in prog.eqns
    ]
    with jax.ensure_compile_time_eval():  # the cached program outlives the trace that builds it: no tracers in it
        consts = {i: value(v) for i, v in prog.consts.items()}
    return dataclasses.replace(prog, eqns=eqns, consts=consts, out_ids=[operand(x) for x in prog.out_ids])


@functools.lru_cache(maxsize=64)
def _program(space: PathSpace, param_key: tuple, input_key: tuple, mesh, dtype=None, **options) -> Program:
    param_specs = [jax.ShapeDtypeStruct(s, d) for s, d in param_key]
    keys = {str(x.dtype): x.dtype for x in jax.tree_util.tree_leaves(space.arg_specs)}  # (a PRNG key's has no name)
    input_specs = [jax.ShapeDtypeStruct(s, keys.get(d, d)) for s, d in input_key]
    args_def = jax.tree_util.tree_structure(space.arg_specs)

    def f(ps, xs):
        return space.fn(jax.tree_util.tree_unflatten(space.treedef, ps), *jax.tree_util.tree_unflatten(args_def, xs))

    try:
        closed = jax.make_jaxpr(f)(param_specs, input_specs)
    except Exception as e:  # the user's function, at batch sizes of the library's choosing
        traced = [tuple(x.shape) for x in jax.tree_util.tree_leaves(space.arg_specs)]
        if [tuple(x.shape) for x in input_specs] == traced:
            raise
        raise options["err"](
            f"{options['who']} runs the traced function on batches of another size (inputs of shapes "
            f"{[tuple(x.shape) for x in input_specs]}; traced with {traced}), taking the first axis of every input "
            f"as the examples, and the function fails there ({type(e).__name__}: {e}). Put the examples first in "
            "every input (an nn.vmap over members: in_axes=1, or in_axes=None for one input shared by all)."
        ) from e
    frame, flags = record(closed, len(param_specs), [leaf.path for leaf in space.leaves])
    if options.get("allow_scan"):  # (DDP-Normalization divides each layer's slice: it keeps them apart)
        frame = rolled(frame, flags, len(param_specs), ROLL_LAYERS)
    # ``const_inputs``: inputs that are constants of the network, as if closed over (DDP's inputs shared by the batch)
    const = options.pop("const_inputs", None) or (False,) * len(input_specs)
    int_inputs = [c or not jnp.issubdtype(s.dtype, jnp.floating) for s, c in zip(input_specs, const, strict=True)]
    # integers read as numbers where cast to floats, not masks (a mask cast to floats stays one), nor constants
    numbers = [not c and jnp.issubdtype(s.dtype, jnp.integer) for s, c in zip(input_specs, const, strict=True)]
    narrow = dtype is not None and any(narrower(t, dtype) for t in jx.float_dtypes(closed))
    if narrow:  # a custom call kept whole would run its own jaxpr, typed in the narrow type: entered instead
        options["inline_custom"] = True
    prog = _finish(frame, flags, len(param_specs), int_inputs=int_inputs, numbers=numbers, **options)
    return widen(prog, dtype) if narrow else prog


def supported_input(dtype) -> bool:
    """Whether path sums and DDP's statistics are defined for an input of ``dtype``: floats, token ids (integers,
    one-hot inputs times an embedding table), masks (booleans, constants of the network) and PRNG keys (what is
    drawn from them: gates, `_input_gates`)."""
    return is_key(dtype) or any(jnp.issubdtype(dtype, t) for t in (jnp.floating, jnp.integer, jnp.bool_))


def is_key(dtype) -> bool:
    """Whether ``dtype`` is a typed PRNG key's (``jax.random.key``)."""
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def all_ones_dtype(dtype, float_dtype):
    """The dtype of an input on the all-ones input of the |·|^p network: ``float_dtype`` for a float input; token
    ids and masks keep theirs (1: any id, the lookup sums the rows; True: every position counts)."""
    return float_dtype if jnp.issubdtype(dtype, jnp.floating) else dtype


def bind(e: Eqn, vals) -> list:
    """Apply the equation's primitive to ``vals``."""
    return jx.bind(e.prim, e.params, vals)


def live(eqns, out_ids) -> list:
    """The equations whose outputs reach ``out_ids`` (dead code, e.g. flax's unused reshapes, dropped)."""
    live = {x for x in out_ids if not isinstance(x, tuple)}
    kept = []
    for e in reversed(eqns):
        if live & set(e.outs):
            kept.append(e)
            live |= {x for x in e.ins if not isinstance(x, tuple)}
    return kept[::-1]
