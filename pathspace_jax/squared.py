"""The |·|^p network of a traced function, shared by path norms, Path-SGD's κ and DDP-SGD's γ² recursion.

`evaluate` runs the flat program (`pathspace_jax.program`) with every linear coefficient replaced by its |·|^p: the
parameters arrive raised, fixed coefficients on a path (average pooling's 1/k, a constant scale) are raised
here, ``sub``/``neg``/``abs`` become ``add``/identity, and ReLU, max pooling and the other primitives whose
rule is ``as_is`` (`pathspace_jax.rules`) are applied as they are to the non-negative values; weights that are
boundary values (attention's softmax times its values, a gate) are 1. On an all-ones input its outputs (and, with
boundaries, the sums at the sinks: `total`) sum to Σ_paths Π |p_e|^p. Values
are carried as `V` (a mantissa and an optional int32 power-of-two exponent renormalised after every
operation that can change magnitudes, so products neither overflow nor underflow). Hooks let the callers
mix node statistics in (DDP), perturb a scan's carries and record what κ⁽²⁾ needs (Path-SGD).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pathspace_jax import jaxpr as jx
from pathspace_jax.exact import V, align, is_float, ldexp, power_v, raise_power, renorm
from pathspace_jax.ir import Role
from pathspace_jax.program import Eqn, Program, bind
from pathspace_jax.rules import Op
from pathspace_jax.squared_scan import eval_scan, sum_v

# ----------------------------------------------------------------------------- evaluation


def _nonzero(v) -> bool:
    """True for a concrete non-zero constant (values computed under a trace are not checked)."""
    if isinstance(v, jax.core.Tracer):
        return False
    return bool(np.any(np.asarray(v)))


def _squared_op(e: Eqn, ks: Sequence[str], vals: list, out_kind: str, power: float, who: str, err: type) -> list:
    """One equation of the |·|^power ("squared" for power 2) network, on non-negative activation values.

    Linear coefficients that are constants (average pooling's 1/k, a fixed scale) are raised to ``power``
    (parameters arrive already raised, and so do coefficients computed from them: kind ``"raised"``), and so is a
    constant offset c (an input's ``x - mean``: a bias of fixed weight c from the bias node, |c|^p, whatever its sign);
    a difference becomes a sum, and a sign dropped (``neg``, ``abs``, ``stop_gradient``) the identity; ReLU, max
    pooling and the other ops whose rule is ``as_is`` (`pathspace_jax.rules`), and the custom calls kept whole around
    such code (`Eqn.whole`), are applied as they are. Anything else raises ``err``.
    """
    r = e.rule
    if out_kind == "const":
        return bind(e, vals)
    if r.scales and sum(k not in ("const", "raised") for k in ks) == 1:
        vals = [v if k != "const" else raise_power(v, power) for v, k in zip(vals, ks, strict=False)]
        return bind(e, vals)
    ks = ["param" if k == "raised" else k for k in ks]  # a coefficient computed from parameters, raised already
    if e.edge or e.coefficient:  # a per-unit scale or a learned scalar, as the trace recorded it: raised already
        return bind(e, vals)
    if r.linear_map:
        if ks.count("const") == 0 and "act" in ks and "param" in ks or ks.count("const") == 1:
            vals = [v if k != "const" else raise_power(v, power) for v, k in zip(vals, ks, strict=False)]
            return bind(e, vals)
        raise err(
            f"{who}: {e.prim.name} at {e.where} multiplies two activations (or two parameters); the network "
            "is not a ReLU network of the form path norms are defined for."
        )
    if r.elementwise_sum and "act" in ks:  # a constant offset: a bias of fixed weight c, |c|^p
        vals = [raise_power(v, power) if k == "const" else v for v, k in zip(vals, ks, strict=True)]
    if r.op is Op.SUB:
        return [jnp.add(*vals)]
    if r.op is Op.SIGN_FREE:
        return [vals[0]]
    if r.as_is or e.whole:
        if r.fills_neg_inf and ks[0] == "const":  # −∞ where no update lands: no path, 0 here
            vals = [jnp.maximum(vals[0], 0), *vals[1:]]
        if r.zero_only and "act" in ks:  # (an offset is a bias of fixed weight: above)
            for k, v in zip(ks, vals, strict=True):
                if k == "const" and _nonzero(v):
                    why = "not positively homogeneous"
                    raise err(f"{who}: {e.prim.name} with a non-zero constant at {e.where} ({why})")
        return bind(e, vals)
    raise err(
        f"{who}: primitive {e.prim.name!r} at {e.where} is not positively homogeneous (or not supported by "
        "the γ² recursion); it is defined here for ReLU networks only."
    )


def _raised_view(e: Eqn, ks: Sequence[str], vals: list) -> bool:
    """Whether an equation computing from parameters gives its |·|^p from its operands' |·|^p: a view (`Rule.view`:
    it moves, copies or negates a parameter's entries without combining them) whose floating-point constant
    operands are zero (a zero padding), or a product of one parameter and constants (raised by `_squared_op`; a
    quotient with the parameter in the numerator; a kernel applied to a constant input). Anything else computed
    from parameters alone (weight normalisation's g·v/‖v‖, a merged low-rank update w + a·b) is evaluated on the
    raw parameters and raised where the |·|^p network reads it (`_Evaluation.raw_coefficient`)."""
    r = e.rule
    if r.scales:
        return ks.count("param") == 1 and (r.op is Op.MUL or ks[0] == "param")
    if r.linear_map:  # a layer with a constant input: paths from that input
        return sorted(ks) == ["const", "param"]
    consts = [v for v, k in zip(vals, ks, strict=True) if k == "const" and is_float(v)]
    return r.view and not any(isinstance(v, jax.core.Tracer) or _nonzero(v) for v in consts)


def _is_relu(e, ks, vals) -> int | None:
    """Index of the activation operand of a ReLU (`Rule.relu`: one operand, or ``max(x, 0)``), the identity on
    non-negative values, else None."""
    if not e.rule.relu:
        return None
    if len(vals) == 1:
        return 0 if list(ks) == ["act"] else None
    if len(vals) != 2 or sorted(ks) != ["act", "const"]:
        return None
    c = vals[ks.index("const")]
    if isinstance(c, jax.core.Tracer) or np.any(np.asarray(c)):
        return None
    if jnp.shape(c) not in ((), jnp.shape(vals[ks.index("act")].m)):
        return None
    return ks.index("act")


def evaluate(
    prog: Program,
    invals: list,
    power: float,
    *,
    post: Callable[[int, V], V] | None = None,
    hooks: dict | None = None,
    record: dict | None = None,
    sinks: list | None = None,
    scan_posts: dict | None = None,
    taps: dict | None = None,
    unroll: bool = True,
    ones: bool = False,
    raw: Sequence | None = None,
):
    """Evaluate the |·|^power network on ``invals`` (params raised to ``power``, then inputs, as `V`s).

    Returns the values of ``prog.out_ids``; ``sinks`` receives the sums (scalar `V`s) of the paths that
    end at boundary nodes (`_find_boundary`), which `total` adds to the outputs. ``post(var, value)``
    replaces the value of every input and every non-constant var where it is produced (DDP mixes node
    statistics in). ``scan_posts`` maps the index of a top-level scan equation to ``(data, make_post)``: at
    every step, the body is evaluated with ``post=make_post(data_t)``, ``data_t`` the step's slice of the
    pytree ``data`` (leading axis: the steps, in index order). For κ⁽²⁾: ``hooks`` maps
    the index of a top-level scan equation to a zero array (T, n) added to the carry it produces at every
    step (its gradient is the carry adjoint ν), and ``record`` receives, under that index, a
    `pathspace_jax.squared_scan.ScanRecord` and, under ``("entries", index)``, the recurrent entries found by
    `pathspace_jax.squared_scan`.

    ``taps`` (κ⁽¹⁾ from a product's operand and result cotangent, `pathspace_jax.squared_scan.Tap`): maps the
    index of a top-level scan equation to ``{body equation index: Tap}``, whose products each step then records (in
    ``Tap.seen``, stacked over the steps), adding ``Tap.pert``'s slice to their results with the parameter's
    gradient stopped there; and the index of any other equation to a `Tap` for that product.

    ``unroll=False`` keeps the scans rolled instead of unrolling them within `scan_unroll`'s budget.

    ``ones=True`` says that the floating-point inputs are all ones (κ's and the path norm's evaluation): a dense
    layer applied to them (through reshapes and casts) is then the column sums of its kernel (`_dense_of_ones`).

    ``raw``: the parameters as they are (in ``invals``' order). A coefficient computed from parameters other than
    as a view of one (`_raised_view`: weight normalisation's g·v/‖v‖, a merged low-rank update) is computed from
    them and raised to ``power`` where the network reads it; no gradient reaches ``invals`` through it (its leaves
    are no edges: "other"). Without ``raw`` (inside a scan body) such a coefficient raises ``prog.err``.
    """
    run = _Evaluation(prog, invals, power, post=post, hooks=hooks, record=record, sinks=sinks, scan_posts=scan_posts,
                      taps=taps, unroll=unroll, ones=ones, raw=raw)  # fmt: skip
    for idx, e in enumerate(prog.eqns):
        run.step(idx, e)
    return [run.read(x) for x in prog.out_ids]


class _Evaluation:
    """The state of one `evaluate`: the values computed so far (``env``; ``raw_env``, the parameter-kind values as
    they are, and ``raw_only``, those known only so), and its options. `step` evaluates one equation, by its
    `pathspace_jax.ir.Role`."""

    def __init__(self, prog: Program, invals: list, power: float, *, post, hooks, record, sinks, scan_posts, taps,
                 unroll: bool, ones: bool, raw):  # fmt: skip
        self.prog, self.power, self.unroll, self.raw = prog, power, unroll, raw
        self.post, self.hooks, self.record = post, hooks, record
        self.sinks, self.scan_posts, self.taps = sinks, scan_posts, taps
        kinds = prog.kinds
        self.env: dict[int, Any] = dict(prog.consts)
        self.raw_env: dict[int, Any] = {} if raw is None else dict(zip(prog.in_ids[: prog.n_params], raw, strict=True))
        self.raw_only: set[int] = set()  # parameter-kind values known only raw (`_raised_view`)
        self.tracked = any(isinstance(v, V) and v.e is not None for v in invals[: prog.n_params])
        inputs = zip(prog.in_ids[prog.n_params :], invals[prog.n_params :], strict=True)
        self.ones_ids = {i for i, v in inputs if kinds[i] == "act" and is_float(v.m)} if ones else set()
        for i, v in zip(prog.in_ids, invals, strict=True):
            self.env[i] = v.m if kinds[i] == "const" and isinstance(v, V) else v  # token ids
            if self.post is not None and kinds[i] != "const":
                self.env[i] = self.post(i, self.env[i])
        self.sink_set = set(prog.sinks)
        self.boundary = prog.bnd | self.sink_set
        self.spread = set(prog.joins)  # values whose pinned groups' entries are boundary values (`_joined_boundary`)

    def read(self, x):
        """The value of operand ``x`` (a literal, or an id), a coefficient known only raw raised where first read."""
        if isinstance(x, tuple):
            return jnp.asarray(x[1])
        if x in self.raw_only and x not in self.env:  # a coefficient computed from parameters, raised where read
            w = self.raw_env[x]
            self.env[x] = power_v(w, self.power) if self.tracked else V(raise_power(w, self.power), None)
        return self.env[x]

    def raw_coefficient(self, e: Eqn, ks: list) -> bool:
        """Compute a parameter-kind equation's raw results; True where its results are known only raw."""
        if self.raw is not None:
            raw = [k in ("param", "raised") for k in ks]
            ins = [self.raw_env[x] if r else self.read(x) for x, r in zip(e.ins, raw, strict=True)]
            self.raw_env.update(zip(e.outs, bind(e, ins), strict=True))
        derived = any(x in self.raw_only for x in e.ins if not isinstance(x, tuple))
        if derived or not _raised_view(e, ks, [self.read(x) for x in e.ins]):
            if self.raw is None:
                raise self.prog.err(
                    f"{self.prog.who}: {e.prim.name} at {e.where} computes a coefficient from parameters other than as "
                    "a view of one (weight normalisation, a merged low-rank update) inside a recurrence; compute it "
                    "outside the scan"
                )
            self.raw_only.update(e.outs)
            return True
        return False

    def operand_kinds(self, e: Eqn) -> list[str]:
        """The kinds of ``e``'s operands as the |·|^p network reads them: ``"raised"`` for a coefficient computed
        from parameters, and ``"const"`` (1) for the boundary operand of a product of two activations (attention's
        weights) and for the mask of a gate (``h * (h > 0)``)."""
        prog = self.prog
        ks = [("const" if isinstance(x, tuple) else prog.kinds[x]) for x in e.ins]
        ks = ["raised" if k == "param" and x in self.raw_only else k for k, x in zip(ks, e.ins, strict=True)]
        if e.rule.op in (Op.DOT, Op.MUL) and ks == ["act", "act"] and len(set(e.ins) & self.boundary) == 1:
            ks = ["const" if x in self.boundary else k for k, x in zip(ks, e.ins, strict=True)]  # attention's weights
        if e.rule.op is Op.MUL and ks == ["act", "act"] and len(set(e.ins) & prog.masks) == 1:
            ks = ["const" if x in prog.masks else k for k, x in zip(ks, e.ins, strict=True)]  # a gate: h * (h > 0)
        return ks

    def step(self, idx: int, e: Eqn) -> None:
        """Evaluate equation ``idx``, ``e``, and store its results."""
        prog, ks = self.prog, self.operand_kinds(e)
        out_kind = prog.kinds[e.outs[0]]
        if e.role is Role.PARAM and self.raw_coefficient(e, ks):
            return
        if any(prog.edge_param(x) and x in self.raw_only for x in e.ins) and prog.is_edge(e):  # the trace disagrees
            raise prog.err(f"{prog.who}: the edge parameter of {e.prim.name} at {e.where} is computed from parameters "
                           "other than as a view of one; path sums are not defined for it")  # fmt: skip
        vals = [self.read(x) for x in e.ins]
        if e.outs[0] in self.sink_set or e.outs[0] in prog.into_sinks:  # only the paths of the homogeneous part end
            # at a sink (not a constant offset, not the boundary values of a sum that the sink continues)
            offset = e.rule.elementwise_sum
            vals = [V(jnp.zeros_like(v.m), v.e) if not isinstance(x, tuple) and x in self.boundary
                    else jnp.zeros_like(v) if offset and k == "const" else v
                    for x, v, k in zip(e.ins, vals, ks, strict=True)]  # fmt: skip
        elif self.spread and e.outs[0] in prog.cut:
            vals = _joined_into_paths(prog, e, ks, vals, self.spread, self.boundary)
        outs = self.results(idx, e, ks, vals, out_kind)
        if self.spread and out_kind == "act" and e.role not in (Role.SCAN, Role.MASK):
            outs = _joined_boundary(prog, e, ks, outs, self.spread, self.boundary)
        for o, v in zip(e.outs, outs, strict=True):
            if self.post is not None and out_kind != "const":
                v = self.post(o, v)
            if o in self.sink_set:
                if self.sinks is not None:
                    self.sinks.append(V(jnp.sum(v.m), v.e))  # `total` aligns them: no renormalisation
                v = _ones(v)
            self.env[o] = v

    def results(self, idx: int, e: Eqn, ks: list, vals: list, out_kind: str) -> list:
        """The results of equation ``idx``, ``e``, on its operands ``vals``, by its role."""
        prog = self.prog
        if e.role is Role.SCAN:
            hooks, taps, posts = self.hooks or {}, self.taps or {}, self.scan_posts or {}
            return eval_scan(e, vals, self.power, hooks.get(idx), self.record, idx, self.sinks, posts.get(idx),
                             taps.get(idx), self.unroll, evaluate=evaluate)  # fmt: skip
        if e.role is Role.CONST:
            return bind(e, vals)
        if e.role is Role.MASK:  # (`pathspace_jax.program._masks`): evaluated as it is, with no exponent
            return [V(m, None) for m in bind(e, align(vals)[0])]
        if e.role is Role.BOUNDARY:
            return _boundary_op(prog, e, ks, vals)
        if e.role is Role.LOOKUP:
            return [_lookup(prog, e, vals)]
        if (r := _is_relu(e, ks, vals)) is not None:
            return [vals[r]]
        return self.computed(idx, e, ks, vals, out_kind)

    def computed(self, idx: int, e: Eqn, ks: list, vals: list, out_kind: str) -> list:
        """The results of an operation of the |·|^p network (`_squared_op`), in the exponent of its operands' (their
        sum for a product), renormalised where they can change magnitudes."""
        prog, r = self.prog, e.rule
        if r.op is Op.CONCAT and "act" in ks:  # a constant beside activations: inputs, 1 (0 if zeros)
            vals = _as_inputs(e, ks, vals, prog.cut.get(e.outs[0]), self.tracked)
        if r.multiplicative:
            es = [v.e for v in vals if isinstance(v, V) and v.e is not None]
            top = functools.reduce(lambda a, b: a + b, es) if es else None
            ms = [v.m if isinstance(v, V) else v for v in vals]
        else:
            ms, top = align(vals)
        tap = None if self.taps is None else self.taps.get(idx)
        if tap is not None:  # the parameter's gradient is taken from x and ȳ (`Tap`)
            ms = [jax.lax.stop_gradient(m) if j == tap.param else m for j, m in enumerate(ms)]
        of_ones = not isinstance(e.ins[0], tuple) and e.ins[0] in self.ones_ids
        res = _dense_of_ones(e, ks, ms) if of_ones else None
        res = res or _squared_op(e, ks, ms, out_kind, self.power, prog.who, prog.err)
        if of_ones and r.keeps_ones and e.outs[0] not in self.sink_set:
            self.ones_ids.add(e.outs[0])
        if tap is not None:
            tap.seen.append(ms[tap.act])
            res = [res[0] + tap.pert if tap.pert is not None else res[0]]
            tap.shapes[idx] = jax.ShapeDtypeStruct(jnp.shape(res[0]), res[0].dtype)
        norm = renorm if _rescales(r) else (lambda v: v)
        outs = [norm(V(m, top if is_float(m) else None)) for m in res]
        if any(o in prog.bnd for o in e.outs):  # the pinned pieces of a value cut into groups: 1
            outs = [_ones(v) if o in prog.bnd else v for o, v in zip(e.outs, outs, strict=True)]
        return outs


def _joined_boundary(prog: Program, e: Eqn, ks, outs: list, spread: set, boundary: set) -> list:
    """The pieces of a cut node read whole are joined back (`pathspace_jax.cut_nodes`), its pinned pieces
    1 there (sinks); what is computed from them without a parameter edge (a ReLU, a mean over positions) keeps its
    pinned groups' entries at 1, as the network with one kernel per piece makes the values computed from boundary
    values alone (`pathspace_jax.program._find_boundary`). Adds such a result to ``spread``."""
    acts = [x for x, k in zip(e.ins, ks, strict=True) if k == "act"]
    if len(e.outs) != 1 or not any(x in spread for x in acts) or prog.is_edge(e):
        return outs
    if not all(x in spread or x in boundary for x in acts) or (cut := prog.cut.get(e.outs[0])) is None:
        return outs
    spread.add(e.outs[0])
    v = outs[0]
    pinned = _pinned_entries(cut, jnp.ndim(v.m))
    if v.e is None:
        return [V(jnp.where(pinned, jnp.ones((), v.m.dtype), v.m), None)]
    top = jnp.maximum(v.e, 0)  # (1 = 2^-top at exponent top: neither overflows)
    return [V(jnp.where(pinned, ldexp(jnp.ones((), v.m.dtype), -top), ldexp(v.m, v.e - top)), top)]


def _joined_into_paths(prog: Program, e: Eqn, ks, vals: list, spread: set, boundary: set) -> list:
    """A join (or what `_joined_boundary` computes from it) added to paths of the homogeneous part (a residual added
    to a node cut into groups): its pinned groups' entries meet those paths at pinned nodes, sinks once the node
    is cut, where only the paths of the homogeneous part end, as at every sink. Those entries are 0 here."""
    acts = [j for j, k in enumerate(ks) if k == "act"]
    mine = [j for j in acts if e.ins[j] in spread]
    if not mine or all(e.ins[j] in spread or e.ins[j] in boundary for j in acts):
        return vals
    out = list(vals)
    for j in mine:
        if (cut := prog.cut.get(e.ins[j])) is not None:
            m = vals[j].m
            out[j] = V(jnp.where(_pinned_entries(cut, jnp.ndim(m)), jnp.zeros((), m.dtype), m), vals[j].e)
    return out


def _pinned_entries(cut, ndim: int) -> np.ndarray:
    """Where the entries of a value flagged ``cut`` (a `pathspace_jax.trace.Cut`, of ``ndim`` axes) lie in its
    pinned groups, broadcastable to it."""
    line = np.concatenate([np.full(s // cut.blocks, p) for s, p in zip(cut.sizes, cut.pinned, strict=True)])
    return np.tile(line, cut.blocks).reshape([-1 if k == cut.axis else 1 for k in range(ndim)])


def _as_inputs(e: Eqn, ks, vals: list, cut, tracked: bool) -> list:
    """A constant concatenated beside activations (CoordConv's coordinates) as the inputs it is in the |·|^p network
    (`rules_shape.side_by_side`): 1, or 0 where it is all zeros (channels padded) or its
    group is pinned (a layer writes into it too: a constant offset, no path)."""
    dim, out, start = jx.param(e, "dimension"), [], 0
    along = cut is not None and cut.axis == dim and cut.blocks == 1
    ends = np.cumsum(cut.sizes) if along else None
    for v, k in zip(vals, ks, strict=True):
        size = jnp.shape(v.m if isinstance(v, V) else v)[dim]
        if k == "const":  # pinned: every group in its entries of the result is (`pathspace_jax.trace.Cut`)
            offset = along and all(p for p, end in zip(cut.pinned, ends, strict=True) if start < end <= start + size)
            nonzero = jnp.any(v != 0) & (not offset)
            ones = jnp.broadcast_to(nonzero.astype(jnp.result_type(v)), jnp.shape(v))
            v = V(ones, jnp.zeros((), jnp.int32) if tracked else None)
        out.append(v)
        start += size
    return out


def _ones(v: V) -> V:
    """A boundary value in the |·|^p network: 1 where ``v`` is."""
    return V(jnp.ones_like(v.m), None if v.e is None else jnp.zeros((), jnp.int32))


def _rescales(r) -> bool:
    """Whether an operation's result needs renormalising: not for a relabelling (a reshape, a cast) or an
    elementwise sum of aligned operands (``add``, ``sub``), whose largest entry is at most the operands' count
    times theirs. Skipping those renormalisations (each a reduction and three products) halves the |·|^p
    network a Transformer compiles to, and changes no value (they are exact)."""
    return not (r.passes_node or (r.merges_node and not r.multiplicative))


def _dense_of_ones(e: Eqn, ks, ms) -> list | None:
    """``x @ W`` of a dense layer whose input x is all ones, as the column sums of W broadcast to the result, or
    None for any other product: one fused reduction over W, where XLA:CPU writes ``W²`` into a buffer of its own
    before a matrix-vector product."""
    if e.rule.op is not Op.DOT or list(ks) != ["act", "param"]:
        return None
    if not jx.contracts_last_with_first(e.params, jnp.ndim(ms[0])) or jnp.ndim(ms[1]) != 2:
        return None
    out = jax.eval_shape(lambda x, w: bind(e, [x, w])[0], ms[0], ms[1])
    return [jnp.broadcast_to(jnp.sum(ms[1], axis=0).astype(out.dtype), out.shape)]


def _boundary_op(prog: Program, e: Eqn, ks, vals) -> list:
    """An operation whose result is a boundary value (`_find_boundary`): 1 in the |·|^p network. A parameter
    that multiplies it other than as an edge (an "other" leaf) lies on no path. It may read the pinned part of a
    value whose groups are pinned in part (``prog.cut``: a gate sliced out of a fused kernel's output), and values
    of the inputs alone (a gate; an additive attention mask ``(1 - mask) * -1e9``: no parameter, no path)."""
    inside = prog.bnd | set(prog.sinks) | set(prog.cut) | prog.of_inputs  # (an additive mask of the inputs alone)
    outside = [x for k, x in enumerate(e.ins) if ks[k] == "act" and x not in inside]
    if outside:
        raise prog.err(
            f"{prog.who}: {e.prim.name} at {e.where} combines a value of the positively homogeneous part with a "
            "value of a pinned node group other than by a parameter edge or a sum; path sums are not defined there"
        )
    ms = [v.m if isinstance(v, V) else v for v in vals]
    tracked = any(isinstance(v, V) and v.e is not None for v in vals)
    out = []
    for sd in jax.eval_shape(lambda *a: bind(e, list(a)), *ms):
        tracked_here = tracked and jnp.issubdtype(sd.dtype, jnp.inexact)
        out.append(V(jnp.ones(sd.shape, sd.dtype), jnp.zeros((), jnp.int32) if tracked_here else None))
    return out


def _lookup(prog: Program, e: Eqn, vals) -> V:
    """An embedding lookup ``table[ids]`` in the |·|^p network: the lookup is the one-hot input (one node per
    row) times the table, so on the all-ones input every looked-up vector is the table's column sums of
    |·|^p: Σ_rows |table[row, :]|^p (the table arrives raised)."""
    table = vals[0]
    shape = jnp.shape(table.m)
    out_ndim = jnp.ndim(vals[1]) - 1 + len(shape) - 1
    if not jx.is_row_lookup(e.params, len(shape), tuple(shape[1:]), out_ndim):
        raise prog.err(
            f"{prog.who}: the gather at {e.where} indexes a parameter with token ids other than as an embedding "
            "lookup of whole rows (table[ids]); path sums are defined here for lookups of whole rows"
        )
    col = jnp.sum(table.m, axis=0)
    out_shape = tuple(jnp.shape(vals[1])[:-1]) + tuple(shape[1:])
    return renorm(V(jnp.broadcast_to(col, out_shape), table.e))


def total(prog: Program, outs: list, sinks: list) -> V:
    """The sum of the |·|^p network's outputs that are nodes of the homogeneous part and of the ``sinks``
    (`evaluate`): Σ_paths Π |p_e|^p over the paths from the inputs, the bias node and the boundary nodes to
    the outputs and the boundary nodes. A scalar `V` (exponent None when nothing is tracked)."""
    skip = prog.bnd | set(prog.sinks)
    parts = list(sinks)
    for o, x in zip(outs, prog.out_ids, strict=True):
        if isinstance(x, tuple) or prog.kinds[x] == "const" or x in skip:
            continue
        parts.append(renorm(V(jnp.sum(o.m), o.e)) if isinstance(o, V) else V(jnp.sum(jnp.abs(o)), None))
    return sum_v(parts)
