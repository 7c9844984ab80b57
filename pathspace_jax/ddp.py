"""DDP-SGD's κ: data-dependent path normalisation, from the path norm to the diagonal natural gradient.

Neyshabur, Salakhutdinov, Tomioka and Srebro ("Data-dependent path normalization in neural networks",
ICLR 2016) define, for every non-input node v,

    γ_v² = α S(z_v) + (1 − α) Σ_{u→v} γ_u² w²_{u→v},      γ² = 1 on inputs and the bias node,
    γ²_net = Σ_{v ∈ outputs} γ_v²,                        κ_e = ½ ∂²γ²_net / ∂w_e²,

with S the uncentred second moment (``moment="second"``) or the variance (``moment="variance"``) of
the pre-activation z_v over the batch. DDP-SGD divides each gradient entry by κ_e.

**Nodes of a conv net.** The recursion runs on the *unrolled* network that the forward function
computes: a node is one entry of an activation tensor (a channel at one position), the batch axis
excepted, and a shared kernel entry is one parameter w whose second derivative is taken as a whole
(so at α = 1 the per-example gradient is summed over positions before it is squared, which is the
Fisher identity of Thm 2). S(z_v) is the mean over the batch at each position. At α = 0
the recursion is the "squared network" on an all-ones input: every linear coefficient squared,
ReLU, leaky ReLU and max pooling applied to the (non-negative) γ² values as they are, average
pooling with its squared 1/k, and γ²_net the sum of its outputs.

**Which values are nodes.** A pre-activation is a value produced by a parameterised linear map
(``dot_general``/``conv`` with a parameter operand), possibly plus biases, residual branches and
constant factors; it becomes a node where it is used by anything else (a ReLU, the next layer, two
consumers, or the function's output). Every output of the function is an output node.
A node at −∞ (a graph node that no message reaches in a ``jax.ops.segment_max``, whose ReLU gives 0)
has no value: it reads as 0 in the statistics, with no derivative (the |w|^p network reads that −∞ as 0).

**Computing κ.** Writing λ_v = ∂γ²_net/∂γ_v² for the backward pass of the γ² recursion (eq. 29) and
ν_v = α λ_v, the diagonal of the Hessian splits into (eq. 32, derived again here because a path uses
every feed-forward parameter at most once, so γ²_net is quadratic in each single w_e and the ReLU
network is piecewise linear in it):

    κ_{u→v} = (1 − α) λ_v γ_u²  +  Σ_nodes t ν_t · mean_i (∂z_t(x_i)/∂w_{u→v})²            (second)
    κ_{u→v} = (1 − α) λ_v γ_u²  +  Σ_nodes t ν_t · mean_i (∂z_t(x_i)/∂w − mean_j ∂z_t(x_j)/∂w)²   (variance)

The first term is one VJP of the γ² recursion with respect to the squared weights (S held fixed),
like Path-SGD's κ⁽¹⁾; ν comes out of the same VJP. The second term ("second-order terms", eq. 30) is

* ``estimator="exact"``: one batched backward pass per node entry t (at α = 1 only the outputs and
  the boundary nodes, for 0 < α < 1 every node of the unrolled network). A dense kernel or a bias used
  once per example has the per-example gradient a_i ⊗ δ_i (δ: the backward signal at its output), so
  Σ_i (a_i ⊗ δ_i)² = (a²)ᵀ (δ²) needs no per-example gradient (the identity BackPACK uses for the exact
  diagonal Gauss–Newton: Dangel, Kunstner, Hennig, "BackPACK: Packing more into backprop", ICLR 2020);
  the other leaves (convolutions, shared and recurrent weights, embeddings) take per-example gradients,
  memory O(batch · their size). Cost: about (1 + entries)× a backward pass at α = 1.
* ``estimator="probes"``: random signs r over (example, node) pairs, one ordinary batched VJP per
  probe with cotangent r_{i,t} √ν_t at node t of example i: E[(Σ r a)²] = Σ a² makes it unbiased
  (for the variance the signs are centred over the batch, E[(Σ (r_i − r̄) a_i)²] = Σ (a_i − ā)²). Cost
  of one probe: one forward and one backward pass of the network. Its variance is that of a
  squared Rademacher sum: at most 2·(exact)² per probe and entry, divided by ``num_probes``.

Scope: feed-forward ReLU networks (MLP, CNN, residual nets, linen / nnx / plain JAX). A residual
block ``h + relu(Dense(h))`` is feed-forward although its kernel is an edge from a node group to
itself: every path uses it at most once. **Pinned groups are boundaries** (as in
`pathspace_jax.path_kappa`): a pinned node (the input of a LayerNorm or a tanh, or a normalised value
that an offset enters without a scale) is a node of the recursion whose γ_v² is added to γ²_net, and downstream
the boundary values are inputs of the homogeneous part: γ² = 1 there, and their values are held
fixed (``stop_gradient``) in the node statistics of the layers after them, so γ²_net stays quadratic
in every weight. Parameters that are not edges (a PReLU's slope) get κ = 0 and pass through the
transformations. The examples are where ``batch_axes`` says (`pathspace_jax.ddp_inputs`; by default the leading
axis of every input), and the function is applied to each example as a batch of one (``jax.vmap``, the inputs
shared by every example passed whole), so functions that mix examples are not supported; with no batched input the
whole batch is one example (a graph batch).
Token ids (integer inputs) are a one-hot input times the embedding table, and an integer input cast to
floats is the input's values (uint8 pixels), as in `pathspace_jax.path_kappa`.

**Recurrences** (``scan``). The recursion runs on the unrolled network (a node is a pre-activation at
one step, with its own S over the batch; the scan is evaluated step by step). A path uses a recurrent
kernel at every step, so z is not linear in it and ½ ∂²S/∂w² gains mean_i z ∂²z/∂w², of either sign.
Here the statistics enter through their Gauss–Newton part:

    κ = ½ diag ∇²_{w'} γ²_GN(w') at w' = w,      γ²_GN: the recursion with z(w') ↦ z(w) + J_z (w' − w).

On feed-forward networks this is κ above exactly; at α = 1 it is the diagonal Fisher (of the outputs
and the boundary nodes of the unrolled network), at α = 0 Path-SGD's κ with its κ⁽²⁾, and it is
continuous in α. For 0 < α < 1 a recurrent kernel adds to the terms above K2 = ½ ∂²Γ₁/∂w² − ∂Γ₁/∂w²
(Γ₁: γ²_net with S linearised to first order), the second derivative of the squared recursion in w and
the cross term ∂ν/∂w · ∂S/∂w, from Hessian-vector products in the recurrent leaves: one per entry
(``"exact"``) or Hutchinson's E[r ⊙ H r] over random signs r (``"probes"``, one HVP per probe,
unbiased). K2 can be negative; `ddp_kappa` returns it as it is and DDP-SGD clamps κ at 0 before the
probe damping. Nested scans, ``while`` loops, weight tying and other inputs raise an error that says why.

References:
  Neyshabur, Salakhutdinov, Tomioka, Srebro, "Data-dependent path normalization in neural networks",
  ICLR 2016: eqs. (4), (5), (15), App. A.2, Thm 2, §6.1.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np

from pathspace_jax import forward as fw
from pathspace_jax import program as flat
from pathspace_jax import squared
from pathspace_jax.ddp_exact import second_order_exact
from pathspace_jax.ddp_inputs import (
    all_ones,
    batch_size,
    check_inputs,
    constant_inputs,
    dtype_of,
    example_shapes,
    is_key,
    per_example,
    take_examples,
)
from pathspace_jax.errors import DDPUnsupportedError
from pathspace_jax.exact import V
from pathspace_jax.forward import forward, scan_nodes
from pathspace_jax.frames import eager_jit, jit_when_eager, kappa_from_frame, on_params_mesh, to_canonical_frame
from pathspace_jax.graph import PathSpace, check_path_space, compute_dtype
from pathspace_jax.kappa import kappa_canonical
from pathspace_jax.refusals import refuse_exclusive_branches, refuse_tying, refuse_undefined

__all__ = ["ddp_kappa", "DDPUnsupportedError"]


# probes taken one after another (straight-line code) on the CPU, up to this many; more are vmapped
_PROBE_LOOP_MAX = 8


# ----------------------------------------------------------------------------- evaluation


def _moment(z, moment: str):
    """S(z) over the batch (axis 0): the uncentred second moment or the variance."""
    return jnp.mean(z * z, axis=0) if moment == "second" else jnp.var(z, axis=0)


def _mixer(alpha: float, stats: dict):
    """The ``post`` hook of the γ² recursion: at a node v, γ_v² = α S(z_v) + (1 − α) (the squared sum)."""

    def mix(v, val):
        return V(alpha * stats[v] + (1.0 - alpha) * val.m, None) if v in stats else val

    return mix


def _gamma_net(prog: flat.Program, sq_params: Sequence, ones: Sequence, stats: Sequence, alpha: float,
               scan_stats: dict | None = None, raw: Sequence | None = None):  # fmt: skip
    """γ²_net: the squared network with the node statistics ``stats`` mixed in at every node (eq. 4), and
    ``scan_stats[i][v]`` (stacked over the steps) at the node v of the body of scan equation i. ``raw``: the
    parameters themselves, for coefficients computed from them (`pathspace_jax.squared.evaluate`)."""
    posts = {i: (d, functools.partial(_mixer, alpha)) for i, d in (scan_stats or {}).items()}
    vals = [V(x, None) for x in list(sq_params) + list(ones)]
    sinks: list = []
    mix = _mixer(alpha, dict(zip(prog.nodes, stats, strict=True)))
    outs = squared.evaluate(prog, vals, 2.0, post=mix, sinks=sinks, scan_posts=posts, unroll=fw.unrolled(), raw=raw)
    return squared.total(prog, outs, sinks).m


# ----------------------------------------------------------------------------- public API


def check_ddp_space(space: PathSpace) -> None:
    check_path_space(space, "ddp_kappa")
    refuse_undefined(space, "ddp_kappa", DDPUnsupportedError)


def check_options(alpha, moment, estimator, num_probes, probe_batch_size=None) -> tuple[float, int, int | None]:
    """Validate DDP's options; returns ``(alpha, num_probes, probe_batch_size)`` as Python numbers."""
    alpha = float(alpha)
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if moment not in ("second", "variance"):
        raise ValueError(f"moment must be 'second' or 'variance', got {moment!r}")
    if estimator not in ("exact", "probes"):
        raise ValueError(f"estimator must be 'exact' or 'probes', got {estimator!r}")
    if int(num_probes) < 1:
        raise ValueError(f"num_probes must be >= 1, got {num_probes}")
    if probe_batch_size is not None:
        if estimator != "probes":
            raise ValueError(f"probe_batch_size applies to estimator='probes' only, got estimator={estimator!r}")
        smallest = 2 if moment == "variance" else 1
        if int(probe_batch_size) < smallest:
            raise ValueError(
                f"probe_batch_size must be >= {smallest} with moment={moment!r}, got {probe_batch_size}"
                + (" (a variance needs two examples)" if smallest == 2 else "")
            )
        probe_batch_size = int(probe_batch_size)
    return alpha, int(num_probes), probe_batch_size


def check_examples(axes, moment: str, alpha: float) -> None:
    """The variance is over two examples at least: refused where no input is batched (the batch one example)."""
    if moment == "variance" and alpha > 0.0 and not any(a == 0 for a in axes):
        raise ValueError(
            "moment='variance' is a variance over the examples, and with batch_axes None for every input the batch "
            "is one example: use moment='second', or put the examples on a leading axis (batch_axes=0)"
        )


@on_params_mesh
@jit_when_eager("alpha", "moment", "estimator", "num_probes", "probe_damping", "probe_batch_size", "batch_axes")
def ddp_kappa(
    space: PathSpace,
    params,
    inputs,
    *,
    alpha: float,
    moment: str = "second",
    estimator: str = "exact",
    num_probes: int = 1,
    probe_damping: float = 0.3,
    probe_batch_size: int | None = None,
    key=None,
    batch_axes=0,
):
    """DDP-SGD's scaling κ = ½ diag ∇²γ²_net on a batch (Neyshabur et al., ICLR 2016, eq. 15), as a pytree like params.

    γ_v² = α S(z_v) + (1 − α) Σ_{u→v} γ_u² w²_{u→v} (γ² = 1 on inputs and the bias node), γ²_net =
    Σ_out γ_v², S the second moment or the variance of z_v over the batch; see the module docstring
    for the conv/residual conventions and the formula used. α = 0 is Path-SGD's κ; α = 1 with the
    second moment is the diagonal of the Fisher matrix of a unit-variance Gaussian output model,
    mean_i Σ_out (∂f_out(x_i)/∂w)² (ibid., Thm 2); with the variance, its centred version.

    Random draws in the traced function (dropout, a VAE's noise) are the ones it makes, run on each example alone
    (a batch of one, under a vmap): from a key per example (an input, batch axis first) each example's own; from a
    key closed over (or one ``make_rng`` stream) the draw for a batch of one, the same for every example and step.
    The |w|^p part (α < 1) takes every draw as 1, as `pathspace_jax.path_kappa` does.

    Args:
      space: the `PathSpace` of the network (``pathspace_jax.trace``).
      params: the parameters (same structure as traced).
      inputs: the batch: the positional arguments of the traced function after ``params`` (one argument as it
        is, a tuple for several), any pytree the function takes (arrays, a dict, a ``jraph.GraphsTuple``, nnx
        state, a PRNG key).
      alpha: α in [0, 1] (a Python float: it selects which terms are computed).
      moment: ``"second"`` (uncentred) or ``"variance"``.
      estimator: ``"exact"`` (one batched backward pass per output entry at α = 1, per unrolled node
        entry for 0 < α < 1: see the module docstring; plus one Hessian-vector product per recurrent-kernel entry on a
        recurrence) or ``"probes"`` (``num_probes`` random-sign VJPs, and as many HVPs on a recurrence;
        unbiased).
      num_probes: number of probes for ``estimator="probes"`` (each costs one more backward pass of the
        batch). One probe's estimate is heavy-tailed (exactly 0 at an output bias whenever the batch's random
        signs sum to 0), which ``probe_damping`` bounds; on the digits MLP one damped probe trains as well as
        four (docs/ddp_sgd.md).
      probe_damping: δ ≥ 0, with ``estimator="probes"`` only: δ · κ_path is added to the estimate, κ_path
        Path-SGD's exact κ (α = 0: one VJP of the squared network). It scales like κ under rescaling, so
        the step stays invariant, and bounds the step where a draw is near 0: κ̂ + δ κ_path ≥ δ κ_path. The
        default 0.3 trained every seed at SGD's best rate where 0.1 let one of three diverge (docs/ddp_sgd.md).
      probe_batch_size: with ``estimator="probes"`` only: run the probes' forward and backward passes on
        this many examples drawn at random (without replacement, from ``key``) instead of the whole batch
        (None, the default, or a size ≥ the batch: the whole batch). The mean over a random subset is an
        unbiased estimate of the batch mean (for ``moment="variance"`` with the finite-population factor
        (n − 1)/(n (b − 1))), so κ stays unbiased; its variance grows about as n/b, and a probe costs
        b/n of a forward and backward pass of the batch. The node statistics S(z) of 0 < α < 1 still
        use the whole batch (one forward pass). Not with a recurrence at 0 < α < 1.
      key: PRNG key for the probes (required for ``estimator="probes"`` when 0 < α).
      batch_axes: where the examples are, as ``jax.vmap``'s ``in_axes``: a pytree prefix of the inputs tuple with 0
        (the examples along the leading axis, the default) or None (shared by every example: a key, a scale, a
        mask, nnx state: a constant of the network) at each leaf. ``None`` for every leaf: the whole batch is one
        example (a graph batch; at α = 1 the Fisher of all its outputs at once). See `pathspace_jax.ddp_inputs`
        and docs/ddp_sgd.md, "What DDP-SGD needs of the inputs".

    Returns:
      κ, a pytree like ``params`` with the params' dtypes; entries are ≥ 0 (exactly 0 for a weight
      that no output depends on, e.g. into a dead unit at α = 1), except at a recurrent kernel for
      0 < α < 1, where the cross term (module docstring) or a probe's draw can make one negative.

    Example:
      >>> space = pj.trace(fn, params, x)
      >>> kappa = pj.ddp_kappa(space, params, x, alpha=0.5)
      >>> kappa = pj.ddp_kappa(space, params, x, alpha=1.0, estimator="probes", key=jax.random.key(0))

    References:
      Neyshabur et al., "Data-dependent path normalization in neural networks", ICLR 2016, eq. (4),
      (15), App. A.2, Thm 2.
    """
    check_ddp_space(space)
    alpha, num_probes, probe_batch_size = check_options(alpha, moment, estimator, num_probes, probe_batch_size)
    if not isinstance(probe_damping, jax.core.Tracer) and not probe_damping >= 0:
        raise ValueError(f"probe_damping must be >= 0, got {probe_damping}")
    if estimator == "probes" and alpha > 0 and key is None:
        raise ValueError("ddp_kappa(estimator='probes') needs a PRNG key: pass key=jax.random.key(...)")
    leaves = space.leaves_of(params, "params")
    xs, axes = check_inputs(space, inputs, batch_axes)
    check_examples(axes, moment, alpha)
    leaves = [jnp.asarray(p) for p in leaves]
    kappa, lg = ddp_kappa_canonical(space, leaves, xs, key, alpha, moment, estimator, num_probes, probe_damping,
                                    probe_batch_size=probe_batch_size, axes=axes)  # fmt: skip
    return space.unflatten_like(params, kappa_from_frame(space, kappa, lg))


@functools.partial(eager_jit, static_argnums=(0, 4, 5, 6, 7, 9, 10, 11, 12))
def ddp_kappa_canonical(
    space,
    leaves,
    xs,
    key,
    alpha,
    moment,
    estimator,
    num_probes,
    probe_damping=0.0,
    clamp=False,
    probe_batch_size=None,
    in_cond=False,
    axes=None,
):
    """κ in the canonical frame (`pathspace_jax.frames.to_canonical_frame`) and the frame's log-gauge l.
    ``clamp``: κ at the recurrent kernels (0 < α < 1) is clamped at 0 before the probe damping is added.
    ``probe_batch_size``: the probes run on that many examples drawn at random (`ddp_kappa`). ``in_cond``:
    computed inside a ``lax.cond`` (DDP-SGD at ``every > 1``; `conv`). ``axes``: each input's batch axis, 0 or None
    (`pathspace_jax.ddp_inputs.check_inputs`); None: every input batched."""
    axes = (0,) * len(xs) if axes is None else axes
    dt, out_dtypes = compute_dtype(leaves), [p.dtype for p in leaves]
    prog = _ddp_program(space, leaves, xs, axes, alpha, dt)
    scans = any(e.body is not None for e in prog.eqns)
    if scans and alpha == 0.0:  # Path-SGD's κ, with the κ⁽²⁾ of the recurrent kernels
        return kappa_canonical(space, leaves, True)
    stepwise = scans and alpha < 1.0  # node statistics inside scan bodies, stacked over the steps or layers
    recurrent = stepwise and any(leaf.recurrent for leaf in space.leaves)  # the recurrent term below
    if recurrent and estimator == "probes":
        key, rec_key = jax.random.split(key)
    frame, lg = to_canonical_frame(space, leaves, dt)
    leaves = [c.astype(jnp.promote_types(p.dtype, dt)) for c, p in zip(frame, leaves, strict=True)]
    xs = [
        x if is_key(x) else flat.at_least([x], dt)[0] for x in xs
    ]  # as the program computes (`flat.widen`: bfloat16 compute, float32 params)
    n = batch_size(xs, axes)
    b = n if probe_batch_size is None or alpha == 0.0 else min(probe_batch_size, n)  # checked: estimator="probes"
    key, probe_xs = _probe_examples(xs, axes, key, b, n, recurrent)
    dtype = jnp.result_type(*leaves)
    ones = all_ones(xs, axes)

    # -- the real forward pass, per example, keeping every node's pre-activation
    # (the nodes inside a scan body: stacked over the steps)
    inner = scan_nodes(prog, "nodes") if stepwise else []
    want = prog.nodes + inner if alpha < 1.0 else prog.outputs + prog.sinks + scan_nodes(prog)

    conv_vjp = in_cond and jax.default_backend() == "cpu"  # XLA:CPU's slow gradients inside the cond: `conv`
    zs_vjp = conv_vjp and not recurrent  # the recurrent term takes forward mode, which a custom VJP does not have

    def zs_of(ps, xs=xs):
        return per_example(lambda x: forward(prog, ps, x, want, batch_size(xs, axes), zs_vjp), xs, axes)

    def gamma_net(sq, stats):  # stats: one per entry of want
        scan_stats: dict = {}
        for (i, v), st in zip(inner, stats[len(prog.nodes) :], strict=True):
            scan_stats.setdefault(i, {})[v] = st
        return _gamma_net(prog, sq, ones, stats[: len(prog.nodes)], alpha, scan_stats, raw=leaves)

    kappa = [jnp.zeros_like(p) for p in leaves]
    zs, vjp, lin = [], None, None
    if recurrent:  # the linearised forward pass serves the recurrent term too
        zs, lin = jax.linearize(zs_of, leaves)
        vjp = jax.linear_transpose(lin, leaves)
    elif alpha > 0.0:
        zs, vjp = jax.vjp(functools.partial(zs_of, xs=probe_xs), leaves)
    probe_zs = zs
    if b < n and alpha < 1.0:  # the node statistics: the whole batch, forward only
        zs = zs_of(leaves)

    # -- the γ² recursion: term (1 − α) λ_v γ_u² and ν = ∂γ²_net/∂S
    if alpha < 1.0:
        stats = [jax.lax.stop_gradient(_moment(z, moment)) for z in zs] if alpha > 0.0 else [0.0] * len(want)
        kappa_a, nus = jax.grad(gamma_net, argnums=(0, 1))([p * p for p in leaves], stats)
        kappa = [k + a for k, a in zip(kappa, kappa_a, strict=False)]
    else:
        nus = [jnp.ones(jnp.shape(z)[1:], dtype) for z in zs]

    # -- the second-order term Σ_t ν_t mean_i (∂z_t(x_i)/∂w)²
    if alpha > 0.0:
        if estimator == "probes":
            sqs = _second_order_probes(vjp, probe_zs, nus, key, num_probes, moment, b, n)
            kappa = [k + a for k, a in zip(kappa, sqs, strict=False)]
        else:
            second = second_order_exact(prog, leaves, xs, axes, want, zs, nus, moment, conv_vjp)
            kappa = [k + a for k, a in zip(kappa, second, strict=True)]
    if recurrent:  # the terms of the recurrent kernels that a feed-forward weight does not have
        rec = [j for j, leaf in enumerate(space.leaves) if leaf.recurrent]
        kappa = _recurrent_term(leaves, kappa, kappa_a, rec, zs, lin, stats, gamma_net, moment, estimator,
                                num_probes, rec_key if estimator == "probes" else None)  # fmt: skip
        if clamp:
            kappa = [jnp.maximum(k, 0.0) for k in kappa]
    if estimator == "probes" and alpha > 0.0:
        # δ · κ_path (the exact α = 0 κ⁽¹⁾, one VJP of the squared network): see `ddp_kappa`'s probe_damping
        zero = [0.0] * len(prog.nodes)
        k_path = jax.grad(lambda w: _gamma_net(prog, w, ones, zero, 0.0, raw=leaves))([p * p for p in leaves])
        kappa = [k + probe_damping * kp for k, kp in zip(kappa, k_path, strict=True)]
    kappa = [k.astype(d) for k, d in zip(kappa, out_dtypes, strict=False)]
    return kappa, lg


def _ddp_program(space, leaves, xs, axes, alpha, dt):
    """The flat program DDP's κ runs (the inputs shared by the batch constants of the network, as closed over),
    after the refusals that are DDP's own."""
    param_key = tuple((tuple(p.shape), str(p.dtype)) for p in leaves)
    # a key's dtype as it is (its name does not parse back into one)
    input_key = tuple((s, dtype_of(x) if is_key(x) else str(dtype_of(x))) for s, x in zip(example_shapes(xs, axes), xs))
    const = constant_inputs(xs, axes)
    prog = flat.program(space, param_key, input_key, dtype=dt, who="ddp_kappa", err=DDPUnsupportedError,
                        allow_scan=True, const_inputs=const if any(const) else None)  # fmt: skip
    refuse_tying(prog, space, "ddp_kappa", "DDP-SGD's κ is not implemented for that (path_sgd with "
                      "second_order=False needs no such condition)")  # fmt: skip
    if alpha == 0.0:
        refuse_exclusive_branches(prog, space, "Take alpha > 0, or G-SGD")
    return prog


def _probe_examples(xs, axes, key, b, n, recurrent):
    """``(key, the probes' inputs)``: the whole batch, or ``b < n`` of its examples drawn uniformly at random."""
    if b == n:
        return key, xs
    if recurrent:
        raise ValueError(
            "ddp_kappa: probe_batch_size is not supported through a recurrence at 0 < alpha < 1 (its recurrent "
            "term uses the linearised pass of the whole batch); leave it None, or use alpha=1"
        )
    key, sub_key = jax.random.split(key)
    return key, take_examples(xs, axes, jax.random.choice(sub_key, n, (b,), replace=False))


def _sharded_like(z) -> dict:
    """``out_sharding`` for an array made to be ``z``'s cotangent: under explicit sharding (``AxisType.Explicit``)
    a VJP's cotangent must carry its primal's sharding; nothing to say otherwise."""
    sharding = jax.typeof(z).sharding
    explicit = any(t == jax.sharding.AxisType.Explicit for t in sharding.mesh.axis_types)
    return {"out_sharding": sharding} if explicit else {}


_ONE_DRAW_MAX = 1 << 14  # probe nodes with at most this many entries take their random signs from one draw


def _second_order_probes(vjp, probe_zs, nus, key, num_probes, moment, b, n) -> list:
    """Σ_t ν_t mean_i (∂z_t(x_i)/∂w)² by ``num_probes`` random-sign probes, each one VJP of the forward pass
    (``vjp``) from the nodes ``probe_zs`` of ``b`` of the batch's ``n`` examples."""
    scale = [jnp.sqrt(jnp.maximum(nu, 0.0)).astype(z.dtype) for nu, z in zip(nus, probe_zs, strict=False)]

    small = [i for i, z in enumerate(probe_zs) if np.prod(jnp.shape(z)) <= _ONE_DRAW_MAX]
    sizes = np.array([int(np.prod(jnp.shape(probe_zs[i]))) for i in small], dtype=np.int64)
    ends = np.cumsum(sizes)  # node i's signs are flat[end - size:end]; none when every node is large
    drawn_together = set(small)

    def signs(k):
        # one random sign per entry of every probe node: the small nodes' from one draw, split (a draw per node is
        # a threefry loop each in the compiled program: on a two-block Transformer, 5.2 -> 2.5-3.2 s to compile
        # DDP's κ), the large ones' drawn apart (split from one draw, a few per cent slower steps on the CPU)
        ks = jax.random.split(k, len(probe_zs) + 1)
        out = [None if i in drawn_together else jax.random.rademacher(ks[i], z.shape, z.dtype, **_sharded_like(z))
               for i, z in enumerate(probe_zs)]  # fmt: skip
        flat = jax.random.rademacher(ks[-1], (int(ends[-1]),), jnp.float32) if small else None
        for i, a, b in zip(small, ends - sizes, ends, strict=True):
            z = probe_zs[i]
            r = flat[a:b].reshape(z.shape).astype(z.dtype)
            sharding = _sharded_like(z).get("out_sharding")  # a VJP's cotangent carries its primal's sharding
            out[i] = r if sharding is None else jax.sharding.reshard(r, sharding)
        return out

    def one(k):
        cots = []
        for r, s in zip(signs(k), scale, strict=True):
            if moment == "variance":
                r = r - jnp.mean(r, axis=0, keepdims=True)
            cots.append(r * s)
        (g,) = vjp(cots)
        return [gi * gi for gi in g]

    keys = jax.random.split(key, int(num_probes))
    if num_probes == 1:
        sqs = one(key)
    elif jax.default_backend() == "cpu" and num_probes <= _PROBE_LOOP_MAX:
        # straight-line VJPs, summed: XLA:CPU runs a vmapped or looped convolution's backward pass
        # several times slower than a plain one
        sqs = functools.reduce(lambda a, b: [x + y for x, y in zip(a, b, strict=True)], map(one, keys))
        sqs = [s / num_probes for s in sqs]
    else:  # one batched VJP: on a GPU faster than a loop of them
        sqs = [jnp.mean(s, axis=0) for s in jax.vmap(one)(keys)]
    # the probes' sum over their b examples, as a mean over the batch (Σ_S (a − ā_S)² estimates
    # (b − 1)/(n − 1) Σ (a − ā)² for a random subset S: the finite-population factor)
    per = 1.0 / b if moment == "second" or b == n else (n - 1) / (n * (b - 1))
    return [s * per for s in sqs]


def _recurrent_term(leaves, kappa, kappa_a, rec, zs, lin, stats, gamma_net, moment, estimator, num_probes, key):
    """Add K2 = ½ diag ∇²Γ₁ − ∂Γ₁/∂w² at the recurrent kernels ``rec`` (module docstring).

    Γ₁(w') is γ²_net with the node statistics linearised to first order, S + ∂S/∂w·(w' − w): its Hessian
    holds the second derivative of the squared recursion in the weights and the cross term ∂ν/∂w · ∂S/∂w;
    ∂Γ₁/∂w² is the first term of κ (``kappa_a``). The diagonal is taken by Hessian-vector products in the
    recurrent leaves: one per entry (``"exact"``), or Hutchinson's E[r ⊙ H r] over random signs r.
    """

    def gamma_1(u):
        w = list(leaves)
        for j, a in zip(rec, unravel(u), strict=True):
            w[j] = a
        dz = lin([a - b for a, b in zip(w, leaves, strict=True)])
        ds = [jax.jvp(lambda z: _moment(z, moment), (z,), (d,))[1] for z, d in zip(zs, dz, strict=True)]
        return gamma_net([a * a for a in w], [s + d for s, d in zip(stats, ds, strict=True)])

    flat, unravel = jax.flatten_util.ravel_pytree([leaves[j] for j in rec])
    grad = jax.grad(gamma_1)

    def hvp(r):
        return jax.jvp(grad, (flat,), (r,))[1]

    if estimator == "exact":
        diag = jax.lax.map(lambda k: hvp(jax.nn.one_hot(k, flat.size, dtype=flat.dtype))[k], jnp.arange(flat.size))
    else:

        def one(k):
            r = jax.random.rademacher(k, flat.shape, flat.dtype)
            return r * hvp(r)

        diag = jnp.mean(jax.lax.map(one, jax.random.split(key, num_probes)), axis=0)
    kappa = list(kappa)
    for j, d in zip(rec, unravel(0.5 * diag), strict=True):
        kappa[j] = kappa[j] + d - kappa_a[j]
    return kappa
