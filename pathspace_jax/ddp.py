"""DDP-SGD's κ: data-dependent path normalisation, from the path norm to the diagonal natural gradient.

Seed 002 (Neyshabur, Salakhutdinov, Tomioka, Srebro) defines, for every non-input node v,

    γ_v² = α S(z_v) + (1 − α) Σ_{u→v} γ_u² w²_{u→v},      γ² = 1 on inputs and the bias node,
    γ²_net = Σ_{v ∈ outputs} γ_v²,                        κ_e = ½ ∂²γ²_net / ∂w_e²,

with S the uncentred second moment (``moment="second"``) or the variance (``moment="variance"``) of
the pre-activation z_v over the batch. DDP-SGD divides each gradient entry by κ_e.

**Nodes of a conv net.** The recursion runs on the *unrolled* network that the forward function
computes: a node is one entry of an activation tensor (a channel at one position), the batch axis
excepted, and a shared kernel entry is one parameter w whose second derivative is taken as a whole
(so at α = 1 the per-example gradient is summed over positions before it is squared, which is the
Fisher identity of seed 002 Thm 2). S(z_v) is the mean over the batch at each position. At α = 0
the recursion is the "squared network" on an all-ones input: every linear coefficient squared,
ReLU, leaky ReLU and max pooling applied to the (non-negative) γ² values as they are, average
pooling with its squared 1/k, and γ²_net the sum of its outputs.

**Which values are nodes.** A pre-activation is a value produced by a parameterised linear map
(``dot_general``/``conv`` with a parameter operand), possibly plus biases, residual branches and
constant factors; it becomes a node where it is used by anything else (a ReLU, the next layer, two
consumers, or the function's output). Every output of the function is an output node.

**Computing κ.** Writing λ_v = ∂γ²_net/∂γ_v² for the backward pass of the γ² recursion (seed 002
eq. 29) and ν_v = α λ_v, the diagonal of the Hessian splits into (seed 002 eq. 32, derived again here
because a path uses every feed-forward parameter at most once, so γ²_net is quadratic in each single
w_e and the ReLU network is piecewise linear in it):

    κ_{u→v} = (1 − α) λ_v γ_u²  +  Σ_nodes t ν_t · mean_i (∂z_t(x_i)/∂w_{u→v})²            (second)
    κ_{u→v} = (1 − α) λ_v γ_u²  +  Σ_nodes t ν_t · mean_i (∂z_t(x_i)/∂w − mean_j ∂z_t(x_j)/∂w)²   (variance)

The first term is one VJP of the γ² recursion with respect to the squared weights (S held fixed),
like Path-SGD's κ⁽¹⁾; ν comes out of the same VJP. The second term ("second-order terms", eq. 30) is

* ``estimator="exact"``: per-example Jacobians of every node with ν ≠ 0: at α = 1 only the outputs
  (one backward pass per output entry and example, vectorised), for 0 < α < 1 every non-input node
  of the unrolled network (one backward pass per node). Memory O(batch · nodes · m): small nets only.
* ``estimator="probes"``: random signs r over (example, node) pairs, one ordinary batched VJP per
  probe with cotangent r_{i,t} √ν_t at node t of example i: E[(Σ r a)²] = Σ a² makes it unbiased
  (for the variance the signs are centred over the batch, E[(Σ (r_i − r̄) a_i)²] = Σ (a_i − ā)²). Cost
  of one probe: one forward and one backward pass of the network. Its variance is that of a
  squared Rademacher sum: at most 2·(exact)² per probe and entry, divided by ``num_probes``.

Scope: feed-forward ReLU networks that ``trace`` finds fully homogeneous (MLP, CNN, residual nets,
linen / nnx / plain JAX). The inputs' leading axis is the batch axis, and the function is applied
to each example as a batch of one (``jax.vmap``), so functions that mix examples are not supported.
Recurrent kernels, weight tying, pinned node groups and non-float inputs raise an error that says
why (a path through a recurrent kernel uses it several times, so γ²_net is no longer quadratic in
that weight and the closed form above does not hold).

References:
  Neyshabur, Salakhutdinov, Tomioka, Srebro, "Data-dependent path normalization in neural networks",
  ICLR 2016 (seed 002): eqs. (4), (5), (15), App. A.2, Thm 2, §6.1.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from pathspace_jax.graph import PathSpace

__all__ = ["ddp_kappa", "DDPUnsupportedError"]


class DDPUnsupportedError(ValueError):
    """Raised when a model is outside what DDP-SGD's κ is defined for here (see the module docstring)."""


# ----------------------------------------------------------------------------- the flat program

_CALL_KEYS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
# ops through which a pre-activation passes without becoming a node (one consumer)
_TRANSPARENT = {"reshape", "squeeze", "expand_dims", "broadcast_in_dim", "transpose", "convert_element_type", "copy",
                "copy_p", "reduce_precision", "neg"}  # fmt: skip
_MERGE = {"add", "add_any", "sub", "mul", "div"}
# ops evaluated as they are on the (non-negative) γ² values of the squared network
_AS_IS = {"max", "select_n", "gt", "ge", "lt", "le", "eq", "ne", "reduce_window_max", "reduce_max", "reduce_sum",
          "reduce_window_sum", "reshape", "squeeze", "expand_dims", "broadcast_in_dim", "transpose",
          "convert_element_type", "copy", "copy_p", "reduce_precision", "concatenate", "slice", "pad", "rev",
          "dynamic_slice", "add", "add_any", "stop_gradient", "not", "and", "or"}  # fmt: skip
_LITERAL = -1


@dataclasses.dataclass
class _Eqn:
    prim: Any
    params: dict
    ins: list  # var ids, or ("lit", value)
    outs: list[int]
    where: str


@dataclasses.dataclass
class _Program:
    eqns: list[_Eqn]
    n_params: int
    in_ids: list[int]  # param ids then input ids
    out_ids: list  # var ids or ("lit", value)
    consts: dict[int, Any]
    kinds: dict[int, str]  # "act" | "param" | "const"
    nodes: list[int]  # var ids that are node pre-activations (in order of finalisation)
    outputs: list[int]  # var ids of the function's outputs that are nodes


def _where(eqn) -> str:
    try:
        from jax._src import source_info_util

        return source_info_util.summarize(eqn.source_info)
    except Exception:  # pragma: no cover - private API drift
        return "<unknown source>"


def _sub_jaxpr(eqn):
    for k in _CALL_KEYS:
        sub = eqn.params.get(k)
        if isinstance(sub, (jcore.Jaxpr, jcore.ClosedJaxpr)):
            return sub
    return None


def _prims(jaxpr) -> set[str]:
    inner = jaxpr.jaxpr if isinstance(jaxpr, jcore.ClosedJaxpr) else jaxpr
    out = set()
    for e in inner.eqns:
        sub = _sub_jaxpr(e)
        out |= _prims(sub) if sub is not None else {e.primitive.name}
    return out


def _join(a: str, b: str) -> str:
    order = {"const": 0, "param": 1, "act": 2}
    return a if order[a] >= order[b] else b


def _flatten(
    closed: jcore.ClosedJaxpr,
    n_params: int,
    *,
    allow_scan: bool = False,
    inline_custom: bool = False,
    in_kinds: Sequence[str] | None = None,
) -> _Program:
    """Flatten ``closed`` (calls inlined) into a `_Program`.

    ``allow_scan`` keeps each ``scan`` as one equation whose ``params["_body"]`` is the flattened body
    (its in_ids: consts, carry, xs; carry kinds joined with the body's carry outputs); otherwise a scan
    raises. ``inline_custom`` enters every ``custom_jvp``/``custom_vjp`` call (ReLU written as
    ``jax.nn.relu`` becomes a plain ``max``). ``in_kinds`` overrides the kinds of the inputs.
    """
    counter = iter(range(10**9))
    eqns: list[_Eqn] = []
    consts: dict[int, Any] = {}
    kinds: dict[int, str] = {}

    def kind_of(x):
        return "const" if isinstance(x, tuple) else kinds[x]

    def walk(jaxpr, const_vals, in_ids):
        env = {}
        for v, c in zip(jaxpr.constvars, const_vals, strict=False):
            i = next(counter)
            consts[i], kinds[i], env[v] = c, "const", i
        for v, i in zip(jaxpr.invars, in_ids, strict=False):
            env[v] = i

        def read(x):
            return ("lit", np.asarray(x.val, x.aval.dtype)) if isinstance(x, jcore.Literal) else env[x]

        for e in jaxpr.eqns:
            ins = [read(x) for x in e.invars]
            ks = [kind_of(x) for x in ins]
            sub = _sub_jaxpr(e)
            name = e.primitive.name
            if name == "scan" and allow_scan:
                outs, scan_eqn = _flatten_scan(e, ins, ks, kinds, counter, inline_custom)
                eqns.append(scan_eqn)
                for v, o in zip(e.outvars, outs, strict=True):
                    env[v] = o
                continue
            if name in ("scan", "while", "cond"):
                raise DDPUnsupportedError(
                    f"ddp_kappa: {name} at {_where(e)} is not supported: DDP-SGD's closed-form κ holds for "
                    "feed-forward networks, where every path uses a parameter at most once (a recurrent kernel "
                    "is used at every time step, so γ²_net is not quadratic in it)."
                )
            opaque = (
                sub is not None
                and not inline_custom
                and name.startswith("custom_")
                and "param" not in ks
                and _prims(sub) <= (_AS_IS - {"add", "add_any", "reduce_sum", "reduce_window_sum"})
            )
            if sub is not None and not opaque:
                cj = sub if isinstance(sub, jcore.ClosedJaxpr) else jcore.ClosedJaxpr(sub, ())
                inner = cj.jaxpr
                sub_in = []
                for x in ins:
                    if isinstance(x, tuple):
                        i = next(counter)
                        consts[i], kinds[i] = x[1], "const"
                        x = i
                    sub_in.append(x)
                outs = walk(inner, cj.consts, sub_in[len(sub_in) - len(inner.invars) :])
                for v, o in zip(e.outvars, outs, strict=False):
                    if isinstance(o, tuple):
                        i = next(counter)
                        consts[i], kinds[i] = o[1], "const"
                        o = i
                    env[v] = o
                continue
            outs = []
            k = "act" if "act" in ks else "param" if "param" in ks else "const"
            for v in e.outvars:
                i = next(counter)
                env[v], kinds[i] = i, k
                outs.append(i)
            eqns.append(_Eqn(e.primitive, dict(e.params), ins, outs, _where(e)))
        return [read(x) for x in jaxpr.outvars]

    top = closed.jaxpr
    in_ids = [next(counter) for _ in top.invars]
    for j, i in enumerate(in_ids):
        kinds[i] = in_kinds[j] if in_kinds is not None else "param" if j < n_params else "act"
    out_ids = walk(top, closed.consts, in_ids)
    prog = _Program(eqns, n_params, in_ids, out_ids, consts, kinds, [], [])
    _find_nodes(prog)
    return prog


def _flatten_scan(e, ins, ks, kinds, counter, inline_custom) -> tuple[list[int], _Eqn]:
    """One ``scan`` equation: flatten its body (carry kinds iterated to a fixed point), append it."""
    nc, ncar = e.params["num_consts"], e.params["num_carry"]
    body = e.params["jaxpr"]
    body = body if isinstance(body, jcore.ClosedJaxpr) else jcore.ClosedJaxpr(body, ())
    in_k = list(ks)
    for _ in range(len(in_k) + 2):
        bp = _flatten(body, 0, allow_scan=True, inline_custom=inline_custom, in_kinds=in_k)
        out_k = [("const" if isinstance(x, tuple) else bp.kinds[x]) for x in bp.out_ids]
        new_k = list(in_k)
        for j in range(ncar):
            new_k[nc + j] = _join(in_k[nc + j], out_k[j])
        if new_k == in_k:
            break
        in_k = new_k
    params = dict(e.params)
    params["_body"] = bp
    outs = []
    for j, _v in enumerate(e.outvars):
        i = next(counter)
        kinds[i] = in_k[nc + j] if j < ncar else out_k[j]
        outs.append(i)
    return outs, _Eqn(e.primitive, params, ins, outs, _where(e))


def _find_nodes(prog: _Program) -> None:
    """Mark the node pre-activations (see the module docstring)."""
    kinds = prog.kinds
    uses: dict[int, list[_Eqn]] = {}
    for e in prog.eqns:
        for x in e.ins:
            if not isinstance(x, tuple):
                uses.setdefault(x, []).append(e)
    fresh: set[int] = set()
    for e in prog.eqns:
        name = e.prim.name
        ins_k = [("const" if isinstance(x, tuple) else kinds[x]) for x in e.ins]
        if kinds[e.outs[0]] != "act":
            continue
        if name in ("dot_general", "conv_general_dilated") and "param" in ins_k:
            fresh.add(e.outs[0])
        elif name in _TRANSPARENT or name in _MERGE:
            if any((not isinstance(x, tuple)) and x in fresh for x in e.ins):
                fresh.add(e.outs[0])
    outs = [x for x in prog.out_ids if not isinstance(x, tuple) and kinds[x] == "act"]
    nodes = []
    for e in prog.eqns:
        for v in e.outs:
            if kinds[v] != "act":
                continue
            us = uses.get(v, [])
            if v in outs:
                nodes.append(v)
                continue
            if v not in fresh:
                continue
            merged = len(us) == 1 and (us[0].prim.name in _TRANSPARENT or us[0].prim.name in _MERGE)
            if merged and us[0].prim.name in ("mul", "div"):
                other = [x for x in us[0].ins if x != v]
                merged = all(isinstance(x, tuple) or kinds[x] == "const" for x in other)
            if not merged:
                nodes.append(v)
    for i in prog.in_ids[prog.n_params :]:  # an input returned as it is
        if i in outs:
            nodes.append(i)
    prog.nodes = nodes
    prog.outputs = list(dict.fromkeys(outs))


@functools.lru_cache(maxsize=64)
def _program(space: PathSpace, param_key: tuple, input_key: tuple, **flatten_options) -> _Program:
    """The flat program of ``space.fn`` at these (shape, dtype) keys (cached: a `PathSpace` is hashable)."""
    param_specs = [jax.ShapeDtypeStruct(s, d) for s, d in param_key]
    input_specs = [jax.ShapeDtypeStruct(s, d) for s, d in input_key]
    args_def = jax.tree_util.tree_structure(space.arg_specs)

    def f(ps, xs):
        return space.fn(jax.tree_util.tree_unflatten(space.treedef, ps), *jax.tree_util.tree_unflatten(args_def, xs))

    closed = jax.make_jaxpr(f)(param_specs, input_specs)
    return _flatten(closed, len(param_specs), **flatten_options)


# ----------------------------------------------------------------------------- evaluation


def _bind(e: _Eqn, vals):
    bp = e.prim.get_bind_params(e.params)
    subfuns, params = bp if isinstance(bp, tuple) else ((), bp)
    out = e.prim.bind(*subfuns, *vals, **params)
    return list(out) if e.prim.multiple_results else [out]


def _read(env, x):
    return jnp.asarray(x[1]) if isinstance(x, tuple) else env[x]


def _forward(prog: _Program, params: Sequence, inputs: Sequence, want: Sequence[int]) -> list:
    """The real forward pass (one example, batch of one); returns the values of the vars in ``want``."""
    env = dict(prog.consts)
    env.update(zip(prog.in_ids, list(params) + list(inputs), strict=False))
    for e in prog.eqns:
        vals = [_read(env, x) for x in e.ins]
        if e.prim.name == "max" and prog.kinds[e.outs[0]] == "act":
            # a ReLU max(x, 0): use jax.nn.relu (derivative 0 at 0, as the user's model has)
            a, b = e.ins
            x, zero = (vals[0], b) if isinstance(b, tuple) else (vals[1], a)
            if isinstance(zero, tuple) and not np.any(np.asarray(zero[1])) and jnp.ndim(zero[1]) == 0:
                env[e.outs[0]] = jax.nn.relu(x)
                continue
        for o, v in zip(e.outs, _bind(e, vals), strict=False):
            env[o] = v
    return [env[i] for i in want]


def _nonzero(v) -> bool:
    """True for a concrete non-zero constant (values computed under a trace are not checked)."""
    if isinstance(v, jax.core.Tracer):
        return False
    return bool(np.any(np.asarray(v)))


def _power(v, power: float):
    """|v|^power of a constant coefficient (``v * v`` for power 2, exact)."""
    return v * v if power == 2.0 else jnp.abs(v) ** power


def _squared_op(
    e: _Eqn, ks: Sequence[str], vals: list, out_kind: str, power: float = 2.0, who: str = "ddp_kappa", err=None
) -> list:
    """One equation of the |·|^power ("squared" for power 2) network, on non-negative activation values.

    Linear coefficients that are constants (average pooling's 1/k, a fixed scale) are raised to ``power``
    (parameters arrive already raised); ``sub``/``neg``/``abs`` become ``add``/identity; ReLU, max pooling
    and the other ops of ``_AS_IS`` are applied as they are. Anything else raises ``err``.
    """
    err = DDPUnsupportedError if err is None else err
    name = e.prim.name
    if out_kind == "const":
        return _bind(e, vals)
    if name in ("mul", "div") and sum(k != "const" for k in ks) == 1:
        vals = [v if k != "const" else _power(v, power) for v, k in zip(vals, ks, strict=False)]
        return _bind(e, vals)
    if name in ("dot_general", "conv_general_dilated"):
        if ks.count("const") == 0 and "act" in ks and "param" in ks or ks.count("const") == 1:
            vals = [v if k != "const" else _power(v, power) for v, k in zip(vals, ks, strict=False)]
            return _bind(e, vals)
        raise err(
            f"{who}: {name} at {e.where} multiplies two activations (or two parameters); the network "
            "is not a ReLU network of the form path norms are defined for."
        )
    if name == "sub":
        return [jnp.add(*vals)]
    if name in ("neg", "abs"):
        return [vals[0]]
    if name in _AS_IS or name.startswith("custom_"):  # custom_*: kept whole only around ReLU-like code
        if name in ("max", "min", "add", "add_any") and "act" in ks:
            for k, v in zip(ks, vals, strict=True):
                if k == "const" and _nonzero(v):
                    raise err(f"{who}: {name} with a non-zero constant at {e.where} (not positively homogeneous)")
        return _bind(e, vals)
    raise err(
        f"{who}: primitive {name!r} at {e.where} is not positively homogeneous (or not supported by "
        "the γ² recursion); it is defined here for ReLU networks only."
    )


def _gamma_net(prog: _Program, sq_params: Sequence, ones: Sequence, stats: Sequence, alpha: float):
    """γ²_net of the squared network with the node statistics ``stats`` mixed in (seed 002 eq. 4)."""
    kinds = prog.kinds
    node_pos = {v: k for k, v in enumerate(prog.nodes)}
    env = dict(prog.consts)
    env.update(zip(prog.in_ids, list(sq_params) + list(ones), strict=False))

    def fin(v):
        if v in node_pos:
            env[v] = alpha * stats[node_pos[v]] + (1.0 - alpha) * env[v]

    for i in prog.in_ids:
        fin(i)
    for e in prog.eqns:
        ks = [("const" if isinstance(x, tuple) else kinds[x]) for x in e.ins]
        vals = [_read(env, x) for x in e.ins]
        outs = _squared_op(e, ks, vals, kinds[e.outs[0]])
        for o, v in zip(e.outs, outs, strict=False):
            env[o] = v
            fin(o)
    total = 0.0
    for v in prog.outputs:
        total = total + jnp.sum(env[v])
    return total


# ----------------------------------------------------------------------------- public API


def _check_space(space: PathSpace) -> None:
    if not isinstance(space, PathSpace):
        raise TypeError(f"space must be a PathSpace from pathspace_jax.trace, got {type(space).__name__}")
    pinned = [g for g in space.groups if g.kind == "pinned"]
    if pinned:
        raise DDPUnsupportedError(
            "ddp_kappa needs a network that is positively homogeneous everywhere; these node groups are pinned: "
            + "; ".join(f"{g.name} (size {g.size}): {', '.join(g.reasons)}" for g in pinned)
        )
    for leaf in space.leaves:
        if leaf.recurrent:
            raise DDPUnsupportedError(
                f"ddp_kappa: parameter {leaf.path!r} is a recurrent kernel. A path through it uses it at every time "
                "step, so γ²_net is not quadratic in it and seed 002's closed-form κ (App. A.2) does not apply; "
                "DDP-SGD is supported for feed-forward networks only."
            )


def _as_tuple(inputs) -> tuple:
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def ddp_kappa(
    space: PathSpace,
    params,
    inputs,
    *,
    alpha: float,
    moment: str = "second",
    estimator: str = "exact",
    num_probes: int = 1,
    key=None,
):
    """DDP-SGD's scaling κ = ½ diag ∇²γ²_net on a batch (seed 002 eq. 15), as a pytree like params.

    γ_v² = α S(z_v) + (1 − α) Σ_{u→v} γ_u² w²_{u→v} (γ² = 1 on inputs and the bias node), γ²_net =
    Σ_out γ_v², S the second moment or the variance of z_v over the batch; see the module docstring
    for the conv/residual conventions and the formula used. α = 0 is Path-SGD's κ; α = 1 with the
    second moment is the diagonal of the Fisher matrix of a unit-variance Gaussian output model,
    mean_i Σ_out (∂f_out(x_i)/∂w)² (seed 002 Thm 2); with the variance, its centred version.

    Args:
      space: the `PathSpace` of the network (``pathspace_jax.trace``).
      params: the parameters (same structure as traced).
      inputs: the batch: the positional arguments of the traced function after ``params`` (an
        array, or a tuple for several); the leading axis of every input is the batch axis.
      alpha: α in [0, 1] (a Python float: it selects which terms are computed).
      moment: ``"second"`` (uncentred) or ``"variance"``.
      estimator: ``"exact"`` (per-example Jacobians: one backward pass per output at α = 1, per
        unrolled node for 0 < α < 1) or ``"probes"`` (``num_probes`` random-sign VJPs; unbiased).
      num_probes: number of probes for ``estimator="probes"``.
      key: PRNG key for the probes (required for ``estimator="probes"`` when 0 < α).

    Returns:
      κ, a pytree like ``params`` with the params' dtypes; entries are ≥ 0 (exactly 0 for a weight
      that no output depends on, e.g. into a dead unit at α = 1).

    Example:
      >>> space = pj.trace(fn, params, x)
      >>> kappa = pj.ddp_kappa(space, params, x, alpha=0.5)
      >>> kappa = pj.ddp_kappa(space, params, x, alpha=1.0, estimator="probes", key=jax.random.key(0))

    References:
      Neyshabur et al., "Data-dependent path normalization in neural networks", ICLR 2016, eq. (4),
      (15), App. A.2, Thm 2.
    """
    _check_space(space)
    alpha = float(alpha)
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if moment not in ("second", "variance"):
        raise ValueError(f"moment must be 'second' or 'variance', got {moment!r}")
    if estimator not in ("exact", "probes"):
        raise ValueError(f"estimator must be 'exact' or 'probes', got {estimator!r}")
    if estimator == "probes" and alpha > 0:
        if key is None:
            raise ValueError("ddp_kappa(estimator='probes') needs a PRNG key: pass key=jax.random.key(...)")
        if int(num_probes) < 1:
            raise ValueError(f"num_probes must be >= 1, got {num_probes}")
    leaves = space.leaves_of(params, "params")
    xs = jax.tree_util.tree_leaves(_as_tuple(inputs))
    if jax.tree_util.tree_structure(_as_tuple(inputs)) != jax.tree_util.tree_structure(space.arg_specs):
        raise ValueError(
            f"inputs must match the traced positional arguments after params: expected the structure "
            f"{jax.tree_util.tree_structure(space.arg_specs)}, got {jax.tree_util.tree_structure(_as_tuple(inputs))}"
        )
    if not xs or any(jnp.ndim(x) == 0 for x in xs):
        raise ValueError("inputs: every input needs a leading batch axis")
    n = int(jnp.shape(xs[0])[0])
    for x in xs:
        if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
            raise DDPUnsupportedError(f"ddp_kappa: inputs must be floating point, got {jnp.result_type(x)}")
        if jnp.shape(x)[0] != n:
            raise ValueError(f"inputs: all inputs need the same batch size, got {[jnp.shape(x)[0] for x in xs]}")
    if n < 1:
        raise ValueError("inputs: the batch is empty")
    leaves = [jnp.asarray(p) for p in leaves]
    kappa = _kappa_jit(space, leaves, list(xs), key, alpha, moment, estimator, int(num_probes))
    return space.unflatten_like(params, kappa)


@functools.partial(jax.jit, static_argnums=(0, 4, 5, 6, 7))
def _kappa_jit(space, leaves, xs, key, alpha, moment, estimator, num_probes):
    n = int(jnp.shape(xs[0])[0])
    param_key = tuple((tuple(p.shape), str(p.dtype)) for p in leaves)
    input_key = tuple(((1, *jnp.shape(x)[1:]), str(jnp.result_type(x))) for x in xs)
    prog = _program(space, param_key, input_key)
    dtype = jnp.result_type(*leaves)

    # -- the real forward pass, per example, keeping every node's pre-activation
    want = prog.nodes if alpha < 1.0 else prog.outputs

    def zs_of(ps):
        return jax.vmap(lambda *x: _forward(prog, ps, [xi[None] for xi in x], want))(*xs)

    kappa = [jnp.zeros_like(p) for p in leaves]
    zs, vjp = [], None
    if alpha > 0.0:
        zs, vjp = jax.vjp(zs_of, leaves)

    # -- the γ² recursion: term (1 − α) λ_v γ_u² and ν = ∂γ²_net/∂S
    node_index = {v: k for k, v in enumerate(prog.nodes)}
    if alpha < 1.0:
        stats = []
        for v in prog.nodes:
            if alpha == 0.0:
                stats.append(0.0)
                continue
            z = zs[want.index(v)]
            if moment == "second":
                stats.append(jnp.mean(z * z, axis=0))
            else:
                stats.append(jnp.var(z, axis=0))
        stats = [jax.lax.stop_gradient(s) for s in stats]
        ones = [jnp.ones((1, *jnp.shape(x)[1:]), dtype) for x in xs]
        sq = [p * p for p in leaves]
        kappa_a, nus = jax.grad(lambda w, s: _gamma_net(prog, w, ones, s, alpha), argnums=(0, 1))(sq, stats)
        kappa = [k + a for k, a in zip(kappa, kappa_a, strict=False)]
        nus = [nus[node_index[v]] for v in want]
    else:
        nus = [jnp.ones(jnp.shape(z)[1:], dtype) for z in zs]

    # -- the second-order term Σ_t ν_t mean_i (∂z_t(x_i)/∂w)²
    if alpha > 0.0:
        if estimator == "probes":
            scale = [jnp.sqrt(jnp.maximum(nu, 0.0)).astype(z.dtype) for nu, z in zip(nus, zs, strict=False)]

            def one(k):
                ks = jax.random.split(k, len(zs))
                cots = []
                for kk, z, s in zip(ks, zs, scale, strict=False):
                    r = jax.random.rademacher(kk, z.shape, z.dtype)
                    if moment == "variance":
                        r = r - jnp.mean(r, axis=0, keepdims=True)
                    cots.append(r * s)
                (g,) = vjp(cots)
                return [gi * gi for gi in g]

            if num_probes == 1:
                sqs = [s[None] for s in one(key)]
            else:
                sqs = jax.vmap(one)(jax.random.split(key, int(num_probes)))
            kappa = [k + jnp.mean(s, axis=0) / n for k, s in zip(kappa, sqs, strict=False)]
        else:

            def per_example(*x):
                def flat(ps):
                    return jnp.concatenate([z.ravel() for z in _forward(prog, ps, [xi[None] for xi in x], want)])

                return jax.jacrev(flat)(leaves)

            jac = jax.vmap(per_example)(*xs)  # per leaf: (n, N, *leaf)
            weights = jnp.concatenate(
                [jnp.broadcast_to(nu, jnp.shape(z)[1:]).ravel() for nu, z in zip(nus, zs, strict=False)]
            )
            for j, J in enumerate(jac):
                if moment == "variance":
                    J = J - jnp.mean(J, axis=0, keepdims=True)
                wj = weights.reshape((1, -1) + (1,) * (J.ndim - 2))
                kappa[j] = kappa[j] + jnp.sum(wj * J * J, axis=(0, 1)) / n
    kappa = [k.astype(p.dtype) for k, p in zip(kappa, leaves, strict=False)]
    return kappa
