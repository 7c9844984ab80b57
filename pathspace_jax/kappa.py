"""Path-SGD's κ and path norms: the |w|^p network on an all-ones input, feed-forward and recurrent.

For a ReLU network with parameters p (biases included: a bias is an edge from the bias node, whose
output is 1), the ℓp path norm and Path-SGD's scaling are (Neyshabur et al. 2015, 2016)

    ‖p‖_path,p = (Σ_paths Π_{e ∈ path} |p_e|^p)^(1/p),      γ²_net = ‖p‖²_path,2,
    κ_i = ½ ∂²γ²_net / ∂p_i².

**The |·|^p network.** Σ_paths Π |p_e|^p is the sum of the outputs of the network evaluated on an
all-ones input (every input node active) with every linear coefficient replaced by its |·|^p: the
parameters, and the fixed coefficients that lie on paths too (average pooling's 1/k becomes 1/k^p, a
constant scale c becomes |c|^p, a residual skip's 1 stays 1). All values are then ≥ 0, so ReLU (and
leaky ReLU, ``abs``) act as the identity. It is evaluated from the forward function's jaxpr by the
evaluator of `pathspace_jax.squared` (shared with DDP-SGD), so no parameter or module names are read;
``lax.scan`` (``nn.RNN``, ``nnx.RNN``) is evaluated as a scan over the |·|^p body, which is the
unrolled graph at the traced sequence length.

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
  κ = κ⁽¹⁾ exactly. A params leaf that a scan body multiplies (an RNN cell's kernels) has its gradient
  stopped inside the scan and taken after it, as Σ_t (∂(x_t·p̃)/∂p̃)ᵀ ȳ_t from the recorded operands x_t
  and result cotangents ȳ_t: one batched product, where the VJP through ``lax.scan`` would add T outer
  products into the kernel's gradient, one read-modify-write pass over it per step (`squared_scan.Tap`; on
  the language model of the benchmarks, κ⁽¹⁾ took 49 ms with those passes and 37 ms without).
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
  γ²_net in float64 (tests/test_kappa.py); the paper's printed closed form was not used.

**Pinned groups are boundaries.** Where `trace` pins a node group (a LayerNorm, a tanh, a gating
product), or an output group meets such an operation (a tanh head), the path sum is taken over the
positively homogeneous part with those nodes as its boundary, as G-SGD treats them: paths start at
the inputs, the bias node and the boundary nodes, and end at the outputs and the boundary nodes. In
the |·|^p network a boundary node's incoming path sum is added to γ²_net there, and downstream its
value is 1, like an input's (a LayerNorm's scale is an edge leaving it); a parameter that is not an edge
(a PReLU's slope) lies on no path (κ = 0; the transformations pass such leaves through), and a bias added
to a boundary value (a LayerNorm's offset without a scale) is a path of one edge. A pinned recurrent group
cuts the recurrence at every step: each step's recurrent edge is a path from h_{t−1} to the next
pre-activation.

**Token ids.** An integer input is a sequence of token ids and ``table[ids]`` an embedding lookup:
the one-hot input (one input node per row of the table) times the table. On the all-ones input of
the |·|^p network every looked-up vector is then Σ_rows |table[row, :]|^p, so path norms and κ are
those of the same network fed one-hot vectors (tested against that formulation). An integer input that the
function casts to floats (uint8 pixels, ``x.astype(jnp.float32) / 255``) is read as numbers instead: the cast
is the input, 1 on the all-ones input, its fixed coefficients (1/255) on every path.

**Masks.** A boolean input (a padding mask, read by ``jnp.where``) is a constant of the network, all
True on the all-ones input: every position counts, as on a batch without padding.

**Scope.** For κ⁽²⁾: recurrent bodies that are not linear in the carry after squaring, weight tying
(a parameter used by two operations of which one is downstream of the other on some path, or used twice
in a recurrence), and recurrent parameters that are not leaves of params themselves are refused. A tied
embedding (the table looked up and read again as the decoder) is no such tying: the embedding dimension is
then a pinned group, where the paths into it end and those out of it start. ``second_order=False`` (κ⁽¹⁾)
needs none of these conditions.

**Numerics.** `path_norm` carries every tensor of the |·|^p network as a mantissa and a power-of-two
exponent (an int32 scalar per tensor), renormalised after every operation that can change magnitudes, so
intermediate products neither overflow nor underflow; only the final (Σ)^(1/p) is converted, and it is
``inf`` (or 0) only when the path norm itself is outside the dtype's range. Both are computed in the *canonical frame*
(`pathspace_jax.frames.to_canonical_frame`: the params rescaled by powers of two so that their gauge
weights are ±1), so no node-wise rescaling of the params can push them out of range; `path_kappa`
maps κ back exactly and returns ``inf`` (never 0) where the value is beyond the params' dtype
(bfloat16/float16 are computed in float32 and cast back). Without such a rescaling, κ_i overflows
float32 only when γ²_net/p_i² itself does (e.g. very deep nets); use float64 params there.

References:
  Neyshabur, Salakhutdinov, Srebro, "Path-SGD: path-normalized optimization in deep neural networks",
  NeurIPS 2015. Neyshabur, Wu, Salakhutdinov, Srebro, "Path-normalized optimization of recurrent
  neural networks with ReLU activations", NeurIPS 2016: Thm 2 (invariance), Lemma 1, Thm 3.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pathspace_jax import jaxpr as jx
from pathspace_jax import program as flat
from pathspace_jax import squared
from pathspace_jax.errors import PathKappaUnsupportedError
from pathspace_jax.exact import V, ldexp, power_v
from pathspace_jax.frames import (
    eager_jit,
    jit_when_eager,
    kappa_from_frame,
    on_params_mesh,
    replicated,
    to_canonical_frame,
)
from pathspace_jax.graph import PathSpace, check_path_space, compute_dtype
from pathspace_jax.ir import Role
from pathspace_jax.refusals import refuse_exclusive_branches, refuse_tying, refuse_undefined
from pathspace_jax.rules import Op
from pathspace_jax.squared import evaluate
from pathspace_jax.squared_scan import Tap

__all__ = ["path_norm", "path_kappa", "PathKappaUnsupportedError"]


_WHO = "path_kappa"


def _lag_sum(cin, nu, a):
    """Q[j, i] = Σ_{k≥0} (A^k)[j, i] · Σ_s cin[s, j] ν[s+1+k, i]: O(T n³ + T² n²) time, O(T n + n²) memory."""
    t, n = cin.shape
    q0 = jnp.zeros((n, n), cin.dtype)
    if t < 2:
        return q0
    nu_pad = jnp.concatenate([nu, jnp.zeros_like(nu)], axis=0)
    cin, nu_pad, a = replicated(cin), replicated(nu_pad), replicated(a)  # on a mesh: gathered once, not per step

    def body(carry, k):
        ak, q = carry
        shifted = jax.lax.dynamic_slice(nu_pad, (k + 1, 0), (t, n))
        q = q + ak * (cin.T @ shifted)
        return (ak @ a, q), None

    (_, q), _ = jax.lax.scan(
        body,
        (jnp.eye(n, dtype=cin.dtype), q0),
        jnp.arange(t - 1),
        unroll=flat.scan_unroll(t - 1, 2 * flat.nbytes(q0)),
    )
    return q


# ----------------------------------------------------------------------------- public API


def check_kappa_space(space: PathSpace, who: str) -> None:
    check_path_space(space, who)
    refuse_undefined(space, who, PathKappaUnsupportedError)
    for spec in jax.tree_util.tree_leaves(space.arg_specs):
        if not flat.supported_input(spec.dtype):
            raise PathKappaUnsupportedError(
                f"{who}: the traced function takes a {spec.dtype} input; path sums are defined for floating-point "
                "inputs, integer token ids (embedding lookups), boolean masks and PRNG keys."
            )


def _setup(space, leaves):
    """(dtype, leaves in the canonical frame, their node log-gauge l, the program, all-ones inputs)."""
    dt = compute_dtype(leaves)
    leaves, lg = to_canonical_frame(space, [jnp.asarray(p).astype(dt) for p in leaves], dt)
    specs = jax.tree_util.tree_leaves(space.arg_specs)
    # one example of each input (as traced: one without axes, random state read per layer, a key for the batch)
    shapes = [
        (1, *tuple(x.shape)[1:]) if x.shape and i not in space.random_per_layer else tuple(x.shape)
        for i, x in enumerate(specs)
    ]
    dtypes = [flat.all_ones_dtype(x.dtype, jnp.dtype(dt)) for x in specs]
    input_key = tuple((s, str(d)) for s, d in zip(shapes, dtypes, strict=True))
    param_key = tuple((tuple(p.shape), str(p.dtype)) for p in leaves)
    prog = flat.program(space, param_key, input_key, dtype=dt, who=_WHO, err=PathKappaUnsupportedError,
                        allow_scan=True, inline_custom=True)  # fmt: skip
    # token ids: 1 (any id; the |·|^p lookup sums the rows); masks: True; PRNG keys: any (what they draw is 1)
    ones = [jnp.ones(s, d) for s, d in zip(shapes, dtypes, strict=True)]
    return dt, leaves, lg, prog, ones


@on_params_mesh
@jit_when_eager("second_order")
def path_kappa(space: PathSpace, params, *, second_order: bool = True):
    """Path-SGD's scaling κ = ½ diag ∇²γ²_net, as a pytree like params.

    γ²_net = Σ_paths Π_{e ∈ path} p_e² over the paths (bias paths included) of the traced function, an
    RNN unrolled at the traced sequence length. With G(p̃) = γ²_net as a function of p̃ = p²,

        κ = κ⁽¹⁾ + κ⁽²⁾,   κ⁽¹⁾ = ∂G/∂p̃,   κ⁽²⁾ = 2 p² ∂²G/∂p̃²,

    κ⁽¹⁾ one VJP of the squared network on an all-ones input, κ⁽²⁾ non-zero only for recurrent kernels
    (see the module docstring for the lag-sum algorithm and its O(T n³ + T² n²) cost). κ does not
    depend on the data, nor on random draws in the traced function (dropout, a VAE's noise, a sampled token): a draw,
    and what is computed from draws and the inputs alone, is a gate of value 1 (for dropout, the network with every
    unit kept: 1/keep² on a path per dropout layer it crosses).

    Args:
      space: the `PathSpace` of the network (``pathspace_jax.trace``).
      params: the parameters (same structure as traced).
      second_order: add the exact κ⁽²⁾ (default). ``False`` gives κ⁽¹⁾ alone, which equals κ for every
        parameter that no path crosses twice and is cheaper for RNNs.

    Returns:
      κ, a pytree like ``params`` with the params' dtypes; entries ≥ 0 (0 where no path passes, e.g. into a
      dead unit). The update g / κ is rescaling invariant either way (Neyshabur et al. 2016, Thm 2).

    Raises:
      PathKappaUnsupportedError: inputs that are neither floats, token ids nor masks, or (κ⁽²⁾ only) recurrences it
        does not cover.

    Example:
      >>> space = pj.trace(lambda p, x: model.apply({"params": p}, x), params, x)
      >>> kappa = pj.path_kappa(space, params)                    # κ⁽¹⁾ + κ⁽²⁾
      >>> kappa1 = pj.path_kappa(space, params, second_order=False)

    References:
      Neyshabur et al., "Path-normalized optimization of recurrent neural networks with ReLU activations",
      NeurIPS 2016, Lemma 1, Thm 3; Neyshabur et al., "Path-SGD", NeurIPS 2015.
    """
    check_kappa_space(space, "path_kappa")
    leaves = [jnp.asarray(p) for p in space.leaves_of(params, "params")]
    out = kappa_from_frame(space, *kappa_canonical(space, leaves, bool(second_order)))
    return space.unflatten_like(params, [k.astype(p.dtype) for k, p in zip(out, leaves, strict=True)])


def _param_product(prog: flat.Program, e) -> tuple[int, int] | None:
    """``(param operand, activation operand)`` of ``e`` when it is a product of an activation and a parameter
    that the |·|^p network evaluates as a product (not a boundary value or a lookup), else None."""
    if not e.rule.linear_map or len(e.ins) != 2 or e.role is not Role.ACT:  # (not a boundary value)
        return None
    kinds = ["const" if isinstance(x, tuple) else prog.kinds[x] for x in e.ins]
    if sorted(kinds) != ["act", "param"]:
        return None
    jp = kinds.index("param")
    return jp, 1 - jp


def _tap_sites(prog: flat.Program, param_pos: dict) -> dict:
    """``{top-level scan index: ({body equation index: (param operand, activation operand, param position)},
    shapes)}``: the products of an activation and a params leaf inside a scan body (`pathspace_jax.squared_scan.Tap`),
    e.g. an RNN cell's input and recurrent kernels. ``shapes`` is filled by the first (abstract) evaluation."""
    sites = {}
    for idx, e in enumerate(prog.eqns):
        if e.role is not Role.SCAN:
            continue
        bp, nc = e.body, e.scan.num_consts
        outer = dict(zip(bp.in_ids[:nc], e.ins[:nc], strict=True))  # body const var -> the scan's operand
        ks = {}
        for k, be in enumerate(bp.eqns):
            ops = _param_product(bp, be)
            src = None if ops is None else outer.get(be.ins[ops[0]])
            if src is None or isinstance(src, tuple) or src not in param_pos:
                continue  # not a params leaf itself: its gradient goes through the scan as before
            ks[k] = (*ops, param_pos[src])
        if ks:
            sites[idx] = (ks, {})
    return sites


def _tapped_grad(e, jp: int, ja: int, p, x, ybar, over_steps: bool):
    """``(∂(x·p)/∂p)ᵀ ȳ`` of the tapped product ``e`` (summed over the leading step axis of x and ȳ when
    ``over_steps``: one batched product for a scan's T steps)."""

    def product(p):
        def one(x):
            operands = [None, None]
            operands[jp], operands[ja] = p, x
            return flat.bind(e, operands)[0]

        return jax.vmap(one)(x) if over_steps else one(x)

    return jax.vjp(product, p)[1](ybar)[0]


class RankOne(NamedTuple):
    """κ of a dense kernel as two vectors, ``κ[i, j] = a[i] · b[j]``: the κ that `scale_by_path_sgd` keeps between
    recomputations for a 2-D params leaf that one product ``x · W`` of a single-row activation uses (a dense
    layer of the |·|^p network on its one all-ones example). ``a`` is that activation, ``b`` the product's
    cotangent, so κ⁽¹⁾ = a bᵀ exactly; keeping them instead of κ saves a pass over the weights at every step."""

    a: jax.Array
    b: jax.Array


def full(k):
    """κ of one leaf as an array (a `RankOne` expanded)."""
    return k.a[:, None] * k.b[None, :] if isinstance(k, RankOne) else k


def _dense_sites(prog: flat.Program, param_pos: dict) -> dict:
    """``{top-level equation index: (param operand, activation operand, param position)}``: the ``dot_general``
    products of an activation and a params leaf, outside any scan, whose leaf the program uses nowhere else.
    Their κ⁽¹⁾ is ``(∂(x·W)/∂W)ᵀ ȳ``; for a dense layer (W 2-D, contracted on its first axis with x's last)
    whose x has one row, the outer product xᵀȳ (`RankOne`)."""
    sites = {}
    for idx, e in enumerate(prog.eqns):
        ops = _param_product(prog, e) if e.rule.op is Op.DOT else None
        if ops is not None and e.ins[ops[0]] in param_pos and len(prog.uses[e.ins[ops[0]]]) == 1:
            sites[idx] = (*ops, param_pos[e.ins[ops[0]]])
    return sites


@functools.partial(eager_jit, static_argnums=(0, 2, 3))
def kappa_canonical(space, leaves, second_order, factored=False):
    """κ in the canonical frame (`pathspace_jax.frames.to_canonical_frame`) and the frame's log-gauge l.

    ``factored``: the κ of a dense kernel that `_dense_sites` finds, with a single-row activation, as `RankOne`
    (the others as arrays); otherwise every κ as an array."""
    dt, ps, lg, prog, ones = _setup(space, leaves)
    refuse_exclusive_branches(prog, space, "Train this model with G-SGD, or DDP-SGD at alpha > 0")
    if second_order:
        refuse_tying(prog, space, f"{_WHO}(second_order=True)", "the exact κ⁽²⁾ is not implemented for that (use "
                          "second_order=False for κ⁽¹⁾)")  # fmt: skip
    perts = {}
    if second_order:
        for idx, e in enumerate(prog.eqns):
            if e.role is not Role.SCAN:
                continue
            bp = e.body
            nc, ncar = e.scan.num_consts, e.scan.num_carry
            if not any(bp.kinds[i] == "param" for i in bp.in_ids[:nc]):
                continue
            avals = jx.in_avals(e.scan.body)[nc : nc + ncar]
            n = sum(int(np.prod(a.shape, dtype=np.int64)) for a, i in zip(avals, bp.in_ids[nc:], strict=False)
                    if bp.kinds[i] != "const")  # fmt: skip
            perts[idx] = jnp.zeros((e.scan.length, n), dt)
    static: dict = {}
    param_pos = {v: j for j, v in enumerate(prog.in_ids[: prog.n_params])}
    sites = _tap_sites(prog, param_pos)
    dense = _dense_sites(prog, param_pos) if factored else {}
    dense_shapes: dict = {}

    def g_of(sq, perts, tap_perts, dense_perts):
        rec: dict = {}
        vals = [V(s, None) for s in sq] + [V(o, None) for o in ones]
        sinks: list = []
        taps = {
            idx: {k: Tap(jp, ja, None if tap_perts is None else tap_perts[idx][k], [], shapes)
                  for k, (jp, ja, _) in ks.items()}
            for idx, (ks, shapes) in sites.items()
        }  # fmt: skip
        top = {idx: Tap(jp, ja, None if dense_perts is None else dense_perts[idx], [], dense_shapes)
               for idx, (jp, ja, _) in dense.items()}  # fmt: skip
        outs = evaluate(prog, vals, 2.0, hooks=perts, record=rec, sinks=sinks, taps={**taps, **top}, ones=True,
                        raw=ps)  # fmt: skip
        total = squared.total(prog, outs, sinks).m
        static.update({k: v for k, v in rec.items() if isinstance(k, tuple)})
        scans = {k: v for k, v in rec.items() if not isinstance(k, tuple)}
        seen = {idx: {k: t.seen[0] for k, t in ks.items()} for idx, ks in taps.items()}
        return total, (scans, seen, {idx: t.seen[0] for idx, t in top.items()})

    sq = [p * p for p in ps]
    tap_perts = dense_perts = None
    if sites or dense:  # the shapes of the tapped products' results, from an abstract evaluation
        jax.eval_shape(lambda sq: g_of(sq, {}, None, None)[0], sq)
        tap_perts = {
            idx: {k: jnp.zeros((prog.eqns[idx].scan.length, *shapes[k].shape), shapes[k].dtype) for k in ks}
            for idx, (ks, shapes) in sites.items()
        }
        dense_perts = {idx: jnp.zeros(dense_shapes[idx].shape, dense_shapes[idx].dtype) for idx in dense}
    grads, (rec, tapped, xs_dense) = jax.grad(g_of, argnums=(0, 1, 2, 3), has_aux=True)(
        sq, perts, tap_perts, dense_perts
    )
    k1, nus, ybar, ybar_dense = grads
    kappa = list(k1)
    for idx, (jp, ja, pj) in dense.items():  # the leaf's only use had its gradient stopped: κ⁽¹⁾ from x and ȳ
        e, x, yb = prog.eqns[idx], xs_dense[idx], ybar_dense[idx]
        dense_layer = jp == 1 and jnp.ndim(sq[pj]) == 2 and jx.contracts_last_with_first(e.params, x.ndim)
        if dense_layer and jnp.size(x) == jnp.shape(x)[-1]:
            kappa[pj] = RankOne(x.reshape(-1), yb.reshape(-1))
        else:
            kappa[pj] = _tapped_grad(e, jp, ja, sq[pj], x, yb, over_steps=False)
    for idx, (ks, _) in sites.items():  # Σ_t (∂(x_t·P)/∂P)ᵀ ȳ_t: one batched product per tapped parameter use
        body = prog.eqns[idx].body
        for k, (jp, ja, pj) in ks.items():
            kappa[pj] = kappa[pj] + _tapped_grad(body.eqns[k], jp, ja, sq[pj], tapped[idx][k], ybar[idx][k], True)
    for idx, sc in rec.items():
        e = prog.eqns[idx]
        cin, nu = sc.cin, nus[idx]
        if e.scan.reverse:
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
    return kappa, lg


@on_params_mesh
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
      >>> l2 = pj.path_norm(space, params)          # ℓ2 path norm
      >>> l1 = pj.path_norm(space, params, p=1.0)   # ℓ1 path norm
      >>> bool(jnp.isclose(pj.path_norm(space, pj.random_rescale(space, params, key)), l2, rtol=1e-5))
      True

    References:
      Neyshabur, Tomioka, Srebro, "Norm-based capacity control in neural networks", COLT 2015;
      Neyshabur et al., "Path-SGD", NeurIPS 2015.
    """
    check_kappa_space(space, "path_norm")
    p = float(p)
    if not p > 0:
        raise ValueError(f"p must be > 0, got {p}")
    leaves = [jnp.asarray(x) for x in space.leaves_of(params, "params")]
    out_dtype = jnp.result_type(*leaves) if leaves else jnp.float32
    return _norm_jit(space, leaves, p).astype(out_dtype)


@functools.partial(eager_jit, static_argnums=(0, 2))
def _norm_jit(space, leaves, p):
    dt, ps, _, prog, ones = _setup(space, leaves)
    zero = jnp.zeros((), jnp.int32)
    vals = [power_v(w, p) for w in ps] + [V(o, zero) for o in ones]
    sinks: list = []
    outs = evaluate(prog, vals, p, sinks=sinks, ones=True, raw=ps)
    total, top = squared.total(prog, outs, sinks)
    total = total.astype(dt)
    top = zero if top is None else top
    a = jnp.floor(top.astype(dt) / p).astype(jnp.int32)
    b = (top - a).astype(dt) / p if p == 1.0 else (top.astype(dt) - a.astype(dt) * p) / p
    return ldexp(total ** (1.0 / p) * jnp.exp2(b), a)
