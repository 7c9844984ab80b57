"""Path-SGD's κ and path norms: the |w|^p network on an all-ones input, feed-forward and recurrent.

For a ReLU network with parameters p (biases included: a bias is an edge from the bias node, whose
output is 1), the ℓp path norm and Path-SGD's scaling are (seed 000; Neyshabur et al. 2015)

    ‖p‖_path,p = (Σ_paths Π_{e ∈ path} |p_e|^p)^(1/p),      γ²_net = ‖p‖²_path,2,
    κ_i = ½ ∂²γ²_net / ∂p_i².

**The |·|^p network.** Σ_paths Π |p_e|^p is the sum of the outputs of the network evaluated on an
all-ones input (every input node active) with every linear coefficient replaced by its |·|^p: the
parameters, and the fixed coefficients that lie on paths too (average pooling's 1/k becomes 1/k^p, a
constant scale c becomes |c|^p, a residual skip's 1 stays 1). All values are then ≥ 0, so ReLU (and
leaky ReLU, ``abs``) act as the identity. It is evaluated from the forward function's jaxpr (the
machinery of `pathspace_jax.ddp`), so no parameter or module names are read; ``lax.scan`` (``nn.RNN``,
``nnx.RNN``) is evaluated as a scan over the |·|^p body, which is the unrolled graph at the traced
sequence length.

**Max pooling** has no path-sum form. Here, as in `pathspace_jax.ddp_kappa`, max pooling (and any
``max`` of two activations) is applied to the non-negative |·|^p values as it is: each window passes
on the largest of its incoming path sums. The result is the path norm of the network in which every
window is replaced by the single input of largest path sum (so it depends on p only through that
choice), κ is the derivative of that piecewise-polynomial function (at exact ties JAX's convention for
the derivative of a max applies), and both stay rescaling-equivariant, because node-wise rescaling
multiplies every path sum through a node by the same factor, which does not change the choice.

**κ⁽¹⁾ and κ⁽²⁾.** Let G(p̃) be γ²_net as a function of the squared parameters p̃ = p². Then
½ ∂²G(p²)/∂p² = ∂G/∂p̃ + 2 p² ∂²G/∂p̃², so κ = κ⁽¹⁾ + κ⁽²⁾ with

* κ⁽¹⁾ = ∂G/∂p̃: one VJP of the squared network. For a parameter that a path crosses at most once
  (MLP, CNN, residual nets, an RNN's input kernels, readouts and biases) G is linear in p̃_i, so
  κ = κ⁽¹⁾ exactly.
* κ⁽²⁾ = 2 p² ∂²G/∂p̃², non-zero for recurrent kernels, which a path of the unrolled network crosses
  at several time steps. In the squared scan body c_s = A c_{s−1} + u_s (A: the carry-to-carry
  Jacobian, for a SimpleCell the squared recurrent kernel transposed) an entry e of a recurrent
  kernel adds p̃_e c_{s−1}[j] to c_s[i] at every step s (j = its source, i = its destination carry
  entry). Differentiating G once at step s and once at a later step t gives

      ∂²G/∂p̃_e² = 2 Σ_{s<t} c_{s−1}[j] · (A^{t−1−s})[j, i] · ν_t[i]  =  2 Σ_k (A^k)[j, i] C_k[j, i],
      C_k = Σ_s c_{s−1} ⊗ ν_{s+1+k},

  with ν_t = ∂G/∂c_t the adjoint of the carry produced at step t (one VJP, via a zero perturbation
  added to it) and c_{s−1} the forward carries. The lag sum runs as a ``lax.scan`` over k = 0…T−2,
  updating A^k by one matrix product: **time O(T·n³ + T²·n²), memory O(T·n + n²)** for a carry of n
  entries and T steps (on top of the squared network's own O(T·n²) forward and backward pass). The
  entries j, i of every recurrent parameter entry are found once per traced shape by probing the
  squared body with concrete carries (never from names). This was checked against ``jax.hessian`` of
  γ²_net in float64 (tests/test_kappa.py); seed 000's printed closed form was not used.

**Scope.** Networks that `trace` finds positively homogeneous everywhere. Pinned node groups are
refused (a pinned group is not a boundary of the path sum: the |·|^p network cannot pass through a
tanh or a normalisation), as are integer inputs (an embedding lookup on an all-ones input would pick
one row; the path sum over one-hot inputs is not what it computes) and, for κ⁽²⁾, recurrent bodies
that are not linear in the carry after squaring, weight tying (a parameter used by two operations),
and recurrent parameters that are not leaves of params themselves. ``second_order=False`` (κ⁽¹⁾)
needs none of the κ⁽²⁾ conditions.

**Numerics.** `path_norm` carries every tensor of the |·|^p network as a mantissa and a power-of-two
exponent (an int32 scalar per tensor), renormalised after every operation, so intermediate products
neither overflow nor underflow; only the final (Σ)^(1/p) is converted, and it is ``inf`` (or 0) only
when the path norm itself is outside the dtype's range. `path_kappa` works in the params' dtype
(bfloat16/float16 are computed in float32 and cast back) without that guard: κ_i is a sum of path
products that avoid p_i, so it overflows float32 when γ²_net/p_i² does (e.g. very deep unbalanced
nets); use float64 params there.

References:
  Neyshabur, Salakhutdinov, Srebro, "Path-SGD: path-normalized optimization in deep neural networks",
  NeurIPS 2015. Neyshabur, Wu, Salakhutdinov, Srebro, "Path-normalized optimization of recurrent
  neural networks with ReLU activations", NeurIPS 2016 (seed 000): Thm 2 (invariance), Lemma 1, Thm 3.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pathspace_jax.ddp import _bind, _power, _Program, _program, _squared_op
from pathspace_jax.graph import PathSpace, compute_dtype

__all__ = ["path_norm", "path_kappa", "PathKappaUnsupportedError"]

_WHO = "path_kappa"
_MULTIPLICATIVE = {"mul", "div", "dot_general", "conv_general_dilated"}
# ops that make a squared scan body non-linear in its carry (κ⁽²⁾ needs linearity)
_NONLINEAR = {"max", "min", "reduce_max", "reduce_min", "reduce_window_max", "select_n", "argmax", "sort"}


class PathKappaUnsupportedError(ValueError):
    """Raised when a model is outside what path norms / Path-SGD's κ are computed for (see the module docstring)."""


class _V(NamedTuple):
    """A non-constant value of the |·|^p network: mantissa ``m`` times 2^``e`` (``e`` None: not tracked)."""

    m: Any
    e: Any


def _is_float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _renorm(v: _V) -> _V:
    if v.e is None or not _is_float(v.m) or jnp.size(v.m) == 0:
        return v
    _, k = jnp.frexp(jax.lax.stop_gradient(jnp.max(jnp.abs(v.m))))
    k = k.astype(jnp.int32)
    return _V(jnp.ldexp(v.m, -k), v.e + k)


def _align(vals: list) -> tuple[list, Any]:
    """Bring every tracked float operand to the largest exponent; returns mantissas and that exponent."""
    es = [v.e for v in vals if isinstance(v, _V) and v.e is not None and _is_float(v.m)]
    if not es:
        return [v.m if isinstance(v, _V) else v for v in vals], None
    top = functools.reduce(jnp.maximum, es)
    out = []
    for v in vals:
        if isinstance(v, _V):
            out.append(jnp.ldexp(v.m, v.e - top) if v.e is not None and _is_float(v.m) else v.m)
        else:
            out.append(v)
    return out, top


def _is_relu(e, ks, vals) -> int | None:
    """Index of the activation operand of ``max(x, 0)`` (identity on non-negative values), else None."""
    if e.prim.name != "max" or len(vals) != 2 or sorted(ks) != ["act", "const"]:
        return None
    c = vals[ks.index("const")]
    if isinstance(c, jax.core.Tracer) or np.any(np.asarray(c)):
        return None
    if jnp.shape(c) not in ((), jnp.shape(vals[ks.index("act")].m)):
        return None
    return ks.index("act")


class _Scan(NamedTuple):
    """What κ⁽²⁾ needs from one top-level scan (recorded during the evaluation)."""

    cin: Any  # (T, n): carry entering every step (processing order as stored by scan: index order)
    a: Any  # (n, n): carry-to-carry Jacobian of the squared body, A[out, in]


def _evaluate(
    prog: _Program,
    invals: list,
    power: float,
    hooks: dict | None = None,
    record: dict | None = None,
    perturb: dict | None = None,
):
    """Evaluate the |·|^power network; returns the values of ``prog.out_ids``.

    ``hooks`` maps the index of a top-level scan equation to a zero array (T, n) added to the carry it
    produces at every step (its gradient is the carry adjoint ν); ``record`` receives `_Scan`s;
    ``perturb`` maps a var to a value added to it where it is produced.
    """
    kinds = prog.kinds
    env: dict[int, Any] = dict(prog.consts)
    env.update(zip(prog.in_ids, invals, strict=True))

    def rd(x):
        return jnp.asarray(x[1]) if isinstance(x, tuple) else env[x]

    for idx, e in enumerate(prog.eqns):
        ks = [("const" if isinstance(x, tuple) else kinds[x]) for x in e.ins]
        vals = [rd(x) for x in e.ins]
        out_kind = kinds[e.outs[0]]
        if e.prim.name == "scan":
            outs = _eval_scan(e, vals, power, None if hooks is None else hooks.get(idx), record, idx)
        elif out_kind == "const":
            outs = _bind(e, vals)
        elif (r := _is_relu(e, ks, vals)) is not None:
            outs = [vals[r]]
        else:
            if e.prim.name in _MULTIPLICATIVE:
                es = [v.e for v in vals if isinstance(v, _V) and v.e is not None]
                top = functools.reduce(lambda a, b: a + b, es) if es else None
                ms = [v.m if isinstance(v, _V) else v for v in vals]
            else:
                ms, top = _align(vals)
            res = _squared_op(e, ks, ms, out_kind, power, _WHO, PathKappaUnsupportedError)
            outs = [_renorm(_V(m, top if _is_float(m) else None)) for m in res]
        for o, v in zip(e.outs, outs, strict=True):
            if perturb is not None and o in perturb:
                v = _V(v.m + perturb[o].astype(v.m.dtype), v.e)
            env[o] = v
    return [rd(x) for x in prog.out_ids]


def _to_v(x, power: float, stable: bool, dtype) -> _V:
    """A constant entering a non-constant slot (a scan's zero initial carry): raise it to ``power``."""
    if isinstance(x, _V):
        return x
    x = jnp.asarray(x)
    m = _power(x if _is_float(x) else x.astype(dtype), power)
    return _renorm(_V(m, jnp.zeros((), jnp.int32) if stable else None))


def _eval_scan(e, vals, power, pert, record, idx):
    bp: _Program = e.params["_body"]
    nc, ncar = e.params["num_consts"], e.params["num_carry"]
    length, reverse = e.params["length"], e.params["reverse"]
    bk = [bp.kinds[i] for i in bp.in_ids]
    stable = any(isinstance(v, _V) and v.e is not None for v in vals)
    fdt = next((v.m.dtype for v in vals if isinstance(v, _V) and _is_float(v.m)), jnp.float32)
    consts = vals[:nc]
    init = [_to_v(v, power, stable, fdt) if bk[nc + j] != "const" else v for j, v in enumerate(vals[nc : nc + ncar])]
    xs = vals[nc + ncar :]
    xs_m = [v.m if isinstance(v, _V) else v for v in xs]
    carry_out_ids = bp.out_ids[:ncar]
    act_carry = [j for j in range(ncar) if bk[nc + j] != "const"]
    shapes = [jnp.shape(init[j].m) for j in act_carry]
    sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]

    def flat(cs):
        return jnp.concatenate([jnp.ravel(c) for c in cs]) if cs else jnp.zeros((0,), fdt)

    def unflat(vec):
        out, o = [], 0
        for s, n in zip(shapes, sizes, strict=True):
            out.append(vec[o : o + n].reshape(s))
            o += n
        return out

    if pert is not None:
        _check_linear_body(bp)

    def body_out(carry_v, x_m, perturb_vec=None):
        x_v = [_V(m, v.e) if isinstance(v, _V) else m for m, v in zip(x_m, xs, strict=True)]
        perturb = None
        if perturb_vec is not None:
            perturb = dict(zip([carry_out_ids[j] for j in act_carry], unflat(perturb_vec), strict=True))
        return _eval_body(bp, list(consts) + list(carry_v) + x_v, power, perturb)

    def step(carry, x):
        x_m, p_t = x
        carry_v = [_V(*c) if isinstance(c, tuple) else c for c in carry]
        outs = body_out(carry_v, x_m, p_t)
        new = []
        for j in range(ncar):
            o = outs[j]
            if bk[nc + j] != "const":
                o = _to_v(o, power, stable, fdt)
                new.append(tuple(o))
            else:
                new.append(o)
        ys = []
        for o in outs[ncar:]:
            ys.append(tuple(o) if isinstance(o, _V) else (o, None))
        if p_t is not None:
            ys.append((jax.lax.stop_gradient(flat([carry_v[j].m for j in act_carry])), None))
        return new, ys

    init_c = [tuple(v) if isinstance(v, _V) else v for v in init]
    carry, ys = jax.lax.scan(step, init_c, (xs_m, pert), length=length, reverse=reverse)
    outs = [_V(*c) if isinstance(c, tuple) else c for c in carry]
    if pert is not None:
        cin = ys.pop()[0]
        cv = list(init)
        x0 = [jax.lax.stop_gradient(m[0]) for m in xs_m]

        def carry_map(vec, cs, xv):
            body_in = list(cv)
            for j, c in zip(act_carry, unflat(vec), strict=True):
                body_in[j] = _V(c, None)
            xv = [_V(m, None) if isinstance(v, _V) else m for m, v in zip(xv, xs, strict=True)]
            o = _evaluate(bp, list(cs) + body_in + xv, power)
            return flat([o[j].m if isinstance(o[j], _V) else jnp.asarray(o[j], fdt) for j in act_carry])

        n = sum(sizes)
        cs = [jax.lax.stop_gradient(c) for c in consts]  # A carries no gradient
        a = jax.jacfwd(carry_map)(jnp.zeros((n,), fdt), cs, x0)
        record[idx] = _Scan(cin, a)
        record[("entries", idx)] = _recurrent_entries(e, bp, consts, xs_m, act_carry, carry_map, n, fdt)
    for y_m, y_e in ys:
        if y_e is None:
            outs.append(_V(y_m, None) if _is_float(y_m) else y_m)
            continue
        top = jnp.max(y_e)
        shift = (y_e - top).reshape((-1,) + (1,) * (jnp.ndim(y_m) - 1))
        outs.append(_renorm(_V(jnp.ldexp(y_m, shift), top)))
    return outs


def _eval_body(bp: _Program, invals: list, power: float, perturb: dict | None):
    """`_evaluate` for a scan body, adding ``perturb[v]`` to the value of var v where it is produced."""
    if perturb:
        produced = {o for e in bp.eqns for o in e.outs}
        if set(perturb) - produced:
            raise PathKappaUnsupportedError(
                f"{_WHO}(second_order=True): a scan carry is passed through its body unchanged; the exact κ⁽²⁾ "
                "is implemented for bodies that compute every carry (use second_order=False)"
            )
    return _evaluate(bp, invals, power, perturb=perturb)


def _check_linear_body(bp: _Program) -> None:
    for e in bp.eqns:
        if bp.kinds[e.outs[0]] == "const":
            continue
        if e.prim.name == "scan":
            raise PathKappaUnsupportedError(
                f"{_WHO}(second_order=True): nested scan at {e.where}; the exact κ⁽²⁾ is implemented for one level "
                "of recurrence (use second_order=False for κ⁽¹⁾)"
            )
        if e.prim.name in _NONLINEAR:
            zero = any(isinstance(x, tuple) and not np.any(np.asarray(x[1])) for x in e.ins)
            if not (e.prim.name == "max" and zero):
                raise PathKappaUnsupportedError(
                    f"{_WHO}(second_order=True): {e.prim.name} at {e.where} makes the squared recurrent body "
                    "non-linear in its carry; the exact κ⁽²⁾ needs a ReLU cell (use second_order=False)"
                )


def _recurrent_entries(e, bp, consts, xs_m, act_carry, carry_map, n, fdt) -> list:
    """For each parameter const of the scan that maps carry to carry: (const position, src, dst, mask).

    Probes the squared body with concrete all-ones parameters: ∂c_out/∂p̃_e with the carry set to 1 and
    to (1, 2, …, n), minus its value at carry 0, must be one unit entry at row dst_e, equal to src_e + 1
    (an entry that adds p̃_e · c[src_e] to c_out[dst_e]); any other pattern is refused for κ⁽²⁾.
    """
    nc = e.params["num_consts"]
    bk = [bp.kinds[i] for i in bp.in_ids]
    found = []
    with jax.ensure_compile_time_eval():
        cs = [jnp.ones(jnp.shape(c.m if isinstance(c, _V) else c), fdt) for c in consts]
        x0 = [jnp.ones(jnp.shape(m)[1:], jnp.result_type(m)) for m in xs_m]
        for j in range(nc):
            if bk[j] != "param":
                continue

            def jac(carry, j=j):
                def f(pj):
                    c2 = list(cs)
                    c2[j] = pj
                    return carry_map(carry, c2, x0)

                return np.asarray(jax.jacrev(f)(cs[j])).reshape(n, -1)

            d0 = jac(jnp.zeros((n,), fdt))
            d1 = jac(jnp.ones((n,), fdt)) - d0
            d2 = jac(jnp.arange(1, n + 1, dtype=fdt)) - d0
            if not np.any(d1):
                continue
            nz = d1 != 0
            cols = nz.any(axis=0)
            dst = np.argmax(nz, axis=0)
            src = np.rint(d2[dst, np.arange(d2.shape[1])]).astype(np.int64) - 1
            ok = (nz.sum(axis=0) <= 1) & (~cols | (d1[dst, np.arange(d1.shape[1])] == 1.0))
            ok &= ~cols | ((src >= 0) & (src < n) & (np.count_nonzero(d2, axis=0) <= 1))
            if not ok.all():
                raise PathKappaUnsupportedError(
                    f"{_WHO}(second_order=True): the scan at {e.where} uses a parameter (its const #{j}) for carry-"
                    "to-carry connections other than single entries (e.g. a convolutional or two-layer recurrence); "
                    "the exact κ⁽²⁾ is implemented for dense recurrent kernels (use second_order=False)"
                )
            shape = jnp.shape(cs[j])
            found.append((j, np.where(cols, src, 0).reshape(shape), np.where(cols, dst, 0).reshape(shape),
                          cols.reshape(shape)))  # fmt: skip
    return found


def _lag_sum(cin, nu, a):
    """Q[j, i] = Σ_{k≥0} (A^k)[j, i] · Σ_s cin[s, j] ν[s+1+k, i]: O(T n³ + T² n²) time, O(T n + n²) memory."""
    t, n = cin.shape
    q0 = jnp.zeros((n, n), cin.dtype)
    if t < 2:
        return q0
    nu_pad = jnp.concatenate([nu, jnp.zeros_like(nu)], axis=0)

    def body(carry, k):
        ak, q = carry
        shifted = jax.lax.dynamic_slice(nu_pad, (k + 1, 0), (t, n))
        q = q + ak * (cin.T @ shifted)
        return (ak @ a, q), None

    (_, q), _ = jax.lax.scan(body, (jnp.eye(n, dtype=cin.dtype), q0), jnp.arange(t - 1))
    return q


# ----------------------------------------------------------------------------- public API


def _check_space(space: PathSpace, who: str) -> None:
    if not isinstance(space, PathSpace):
        raise TypeError(f"space must be a PathSpace from pathspace_jax.trace, got {type(space).__name__}")
    pinned = [g for g in space.groups if g.kind == "pinned"]
    if pinned:
        raise PathKappaUnsupportedError(
            f"{who} needs a network that is positively homogeneous everywhere (pinned groups are not boundary "
            "nodes of the path sum: the |w|^p network on an all-ones input cannot pass through them); these node "
            "groups are pinned: " + "; ".join(f"{g.name} (size {g.size}): {', '.join(g.reasons)}" for g in pinned)
        )
    for spec in jax.tree_util.tree_leaves(space.arg_specs):
        if not jnp.issubdtype(spec.dtype, jnp.floating):
            raise PathKappaUnsupportedError(
                f"{who}: the traced function takes a {spec.dtype} input (token ids / an embedding lookup?). Path "
                "sums are defined here for floating-point inputs, where an all-ones input activates every input "
                "node; an integer input would select one embedding row. Trace a function of the one-hot input."
            )


def _setup(space, leaves):
    dt = compute_dtype(leaves)
    leaves = [jnp.asarray(p).astype(dt) for p in leaves]
    specs = jax.tree_util.tree_leaves(space.arg_specs)
    input_key = tuple(((1, *tuple(x.shape)[1:]), str(jnp.dtype(dt))) for x in specs)
    param_key = tuple((tuple(p.shape), str(p.dtype)) for p in leaves)
    prog = _program(space, param_key, input_key, allow_scan=True, inline_custom=True)
    ones = [jnp.ones(s, dt) for s, _ in input_key]
    return dt, leaves, prog, ones


def _act_outputs(prog, outs):
    return [o for o, x in zip(outs, prog.out_ids, strict=True) if not isinstance(x, tuple) and prog.kinds[x] != "const"]


def _live(eqns, out_ids) -> list:
    """The equations whose outputs reach ``out_ids`` (dead code, e.g. flax's unused reshapes, dropped)."""
    live = {x for x in out_ids if not isinstance(x, tuple)}
    kept = []
    for e in reversed(eqns):
        if live & set(e.outs):
            kept.append(e)
            live |= {x for x in e.ins if not isinstance(x, tuple)}
    return kept[::-1]


def _check_second_order(prog: _Program) -> None:
    """Weight tying (one parameter used by two operations) puts it twice on some paths: refuse for κ⁽²⁾."""
    todo = [(set(prog.in_ids[: prog.n_params]), prog, "")]
    for e in prog.eqns:
        if e.prim.name == "scan":
            bp = e.params["_body"]
            todo.append(({i for i in bp.in_ids if bp.kinds[i] == "param"}, bp, f" (scan body at {e.where})"))
    for p_ids, pr, where in todo:
        uses: dict[int, int] = {}
        for e in _live(pr.eqns, pr.out_ids):
            for x in {x for x in e.ins if not isinstance(x, tuple)}:
                if x in p_ids:
                    uses[x] = uses.get(x, 0) + 1
        if any(n > 1 for n in uses.values()):
            raise PathKappaUnsupportedError(
                f"{_WHO}(second_order=True): a parameter is used by several operations{where} (weight tying), "
                "so a path can cross it twice outside a recurrence; the exact κ⁽²⁾ is not implemented for that "
                "(use second_order=False for κ⁽¹⁾)"
            )


def path_kappa(space: PathSpace, params, *, second_order: bool = True):
    """Path-SGD's scaling κ = ½ diag ∇²γ²_net, as a pytree like params (seed 000).

    γ²_net = Σ_paths Π_{e ∈ path} p_e² over the paths (bias paths included) of the traced function, an
    RNN unrolled at the traced sequence length. With G(p̃) = γ²_net as a function of p̃ = p²,

        κ = κ⁽¹⁾ + κ⁽²⁾,   κ⁽¹⁾ = ∂G/∂p̃,   κ⁽²⁾ = 2 p² ∂²G/∂p̃²,

    κ⁽¹⁾ one VJP of the squared network on an all-ones input, κ⁽²⁾ non-zero only for recurrent kernels
    (see the module docstring for the lag-sum algorithm and its O(T n³ + T² n²) cost). κ does not
    depend on the data.

    Args:
      space: the `PathSpace` of the network (``pathspace_jax.trace``).
      params: the parameters (same structure as traced).
      second_order: add the exact κ⁽²⁾ (default). ``False`` gives κ⁽¹⁾ alone, which equals κ for every
        parameter that no path crosses twice and is cheaper for RNNs.

    Returns:
      κ, a pytree like ``params`` with the params' dtypes; entries ≥ 0 (0 where no path passes, e.g. into a
      dead unit). The update g / κ is rescaling invariant either way (seed 000 Thm 2).

    Raises:
      PathKappaUnsupportedError: pinned groups, integer inputs, or (κ⁽²⁾ only) recurrences it does not cover.

    Example:
      >>> space = pj.trace(lambda p, x: model.apply({"params": p}, x), params, x)
      >>> kappa = pj.path_kappa(space, params)                    # κ⁽¹⁾ + κ⁽²⁾
      >>> kappa1 = pj.path_kappa(space, params, second_order=False)

    References:
      Neyshabur et al., "Path-normalized optimization of recurrent neural networks with ReLU activations",
      NeurIPS 2016, Lemma 1, Thm 3; Neyshabur et al., "Path-SGD", NeurIPS 2015.
    """
    _check_space(space, "path_kappa")
    leaves = [jnp.asarray(p) for p in space.leaves_of(params, "params")]
    out = _kappa_jit(space, leaves, bool(second_order))
    return space.unflatten_like(params, [k.astype(p.dtype) for k, p in zip(out, leaves, strict=True)])


@functools.partial(jax.jit, static_argnums=(0, 2))
def _kappa_jit(space, leaves, second_order):
    dt, ps, prog, ones = _setup(space, leaves)
    if second_order:
        _check_second_order(prog)
    perts = {}
    if second_order:
        for idx, e in enumerate(prog.eqns):
            if e.prim.name != "scan":
                continue
            bp = e.params["_body"]
            nc, ncar = e.params["num_consts"], e.params["num_carry"]
            if not any(bp.kinds[i] == "param" for i in bp.in_ids[:nc]):
                continue
            avals = e.params["jaxpr"].in_avals[nc : nc + ncar]
            n = sum(int(np.prod(a.shape, dtype=np.int64)) for a, i in zip(avals, bp.in_ids[nc:], strict=False)
                    if bp.kinds[i] != "const")  # fmt: skip
            perts[idx] = jnp.zeros((e.params["length"], n), dt)
    static: dict = {}

    def g_of(sq, perts):
        rec: dict = {}
        vals = [_V(s, None) for s in sq] + [_V(o, None) for o in ones]
        outs = _act_outputs(prog, _evaluate(prog, vals, 2.0, hooks=perts, record=rec))
        total = sum(jnp.sum(o.m if isinstance(o, _V) else o) for o in outs)
        static.update({k: v for k, v in rec.items() if isinstance(k, tuple)})
        return total, {k: v for k, v in rec.items() if not isinstance(k, tuple)}

    sq = [p * p for p in ps]
    (k1, nus), rec = jax.grad(g_of, argnums=(0, 1), has_aux=True)(sq, perts)
    kappa = list(k1)
    param_pos = {v: j for j, v in enumerate(prog.in_ids[: prog.n_params])}
    for idx, sc in rec.items():
        e = prog.eqns[idx]
        cin, nu = sc.cin, nus[idx]
        if e.params["reverse"]:
            cin, nu = cin[::-1], nu[::-1]
        q = _lag_sum(cin, nu, sc.a)
        for j, src, dst, mask in static[("entries", idx)]:
            x = e.ins[j]
            if isinstance(x, tuple) or x not in param_pos:
                raise PathKappaUnsupportedError(
                    f"{_WHO}(second_order=True): the recurrent weights of the scan at {e.where} are computed from "
                    "the params (not a params leaf itself); the exact κ⁽²⁾ needs the leaf (use second_order=False)"
                )
            pj = param_pos[x]
            d2 = jnp.where(mask, q[src, dst], 0.0)
            kappa[pj] = kappa[pj] + 4.0 * sq[pj] * d2
    return kappa


def path_norm(space: PathSpace, params, p: float = 2.0):
    """The ℓp path norm (Σ_paths Π_{e ∈ path} |p_e|^p)^(1/p) of the traced function, overflow-safe.

    Paths run from the inputs and the bias node to the outputs of the traced function (an RNN unrolled at
    the traced sequence length); fixed coefficients on a path (average pooling's 1/k) count with their
    |·|^p, max pooling passes the largest path sum of its window (see the module docstring). ``p = 2``
    gives √γ²_net, the square root of Path-SGD's regulariser.

    Every tensor of the |·|^p network is carried as a mantissa and a power-of-two exponent, renormalised
    after every operation, so no intermediate product overflows or underflows; the result is finite
    whenever the path norm is representable in the params' dtype, and ``inf`` (or 0) when it is not
    (bfloat16/float16 params are computed in float32 and the result cast back).

    Args:
      space: the `PathSpace` of the network (``pathspace_jax.trace``).
      params: the parameters (same structure as traced).
      p: the exponent, > 0 (a Python float).

    Returns:
      A scalar in the params' dtype.

    Example:
      >>> pj.path_norm(space, params)          # ℓ2 path norm
      >>> pj.path_norm(space, params, p=1.0)   # ℓ1 path norm

    References:
      Neyshabur, Tomioka, Srebro, "Norm-based capacity control in neural networks", COLT 2015;
      Neyshabur et al., "Path-SGD", NeurIPS 2015.
    """
    _check_space(space, "path_norm")
    p = float(p)
    if not p > 0:
        raise ValueError(f"p must be > 0, got {p}")
    leaves = [jnp.asarray(x) for x in space.leaves_of(params, "params")]
    out_dtype = jnp.result_type(*leaves) if leaves else jnp.float32
    return _norm_jit(space, leaves, p).astype(out_dtype)


@functools.partial(jax.jit, static_argnums=(0, 2))
def _norm_jit(space, leaves, p):
    dt, ps, prog, ones = _setup(space, leaves)
    zero = jnp.zeros((), jnp.int32)
    vals = [_renorm(_V(_power(w, p), zero)) for w in ps] + [_V(o, zero) for o in ones]
    outs = _act_outputs(prog, _evaluate(prog, vals, p))
    sums = [_renorm(_V(jnp.sum(o.m), o.e if o.e is not None else zero)) for o in outs if isinstance(o, _V)]
    sums += [_V(jnp.sum(jnp.abs(o)), zero) for o in outs if not isinstance(o, _V)]
    if not sums:
        return jnp.zeros((), dt)
    ms, top = _align(sums)
    total = functools.reduce(jnp.add, ms)
    a = jnp.floor(top.astype(dt) / p).astype(jnp.int32)
    b = (top - a).astype(dt) / p if p == 1.0 else (top.astype(dt) - a.astype(dt) * p) / p
    return jnp.ldexp(total ** (1.0 / p) * jnp.exp2(b), a)
