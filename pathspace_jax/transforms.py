"""optax transforms of pathspace_jax: scale_by_path_sgd, scale_by_ddp, in_path_space and their states."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pathspace_jax import gsgd
from pathspace_jax.ddp import check_ddp_space, check_examples, check_options, ddp_kappa_canonical
from pathspace_jax.ddp_inputs import check_inputs
from pathspace_jax.frames import eager_jit
from pathspace_jax.graph import check_path_space, compute_dtype, warn_if_plain
from pathspace_jax.kappa import check_kappa_space, kappa_canonical
from pathspace_jax.masking import accept_masked
from pathspace_jax.scaling import (
    PackedKappa,
    check_refresh,
    current_kappa,
    divide_by_kappa,
    is_traced,
    kappa_state,
    kept_kappa,
)


def _check_every_eps(every, eps, damping, floor) -> None:
    if not is_traced(every) and (isinstance(every, bool) or np.ndim(every) or int(every) != every or every < 1):
        raise ValueError(f"every must be a positive int, got {every!r}")
    for name, value in (("eps", eps), ("damping", damping), ("floor", floor)):
        if not is_traced(value) and not value >= 0:
            raise ValueError(f"{name} must be >= 0, got {value}")


def _check_static(where: str, **hyperparams) -> None:
    """Refuse traced hyperparameters that select the program run (not numbers in it)."""
    traced = [name for name, value in hyperparams.items() if is_traced(value)]
    if traced:
        raise TypeError(
            f"{where}: {', '.join(traced)} select the computation and must be Python values, got traced arrays; "
            f"with optax.inject_hyperparams pass static_args={tuple(hyperparams)}"
        )


# ---------------------------------------------------------------------------- DDP-SGD


class ScaleByDDPState(NamedTuple):
    """State of `scale_by_ddp`: the step count and the κ last computed (recomputed every ``every`` steps).

    As in `ScaleByPathSGDState`: ``kept`` is a `pathspace_jax.scaling.PackedKappa` whose ``unpack()`` gives the
    `pathspace_jax.scaling.KeptKappa` (κ in the canonical frame, its log-gauge, frame and leaf means;
    `pathspace_jax.frames.kappa_from_frame` gives κ of the params); None with ``every=1`` (the default): κ is
    computed at each step and not kept.
    """

    count: jax.Array
    kept: PackedKappa | None


def scale_by_ddp(
    space,
    *,
    alpha: float,
    moment: str = "second",
    estimator: str = "probes",
    num_probes: int = 1,
    probe_damping: float = 0.3,
    probe_batch_size: int | None = None,
    normalize: bool = True,
    damping: float = 0.0,
    floor: float = 1e-6,
    eps: float = 0.0,
    every: int = 1,
    batch_axes=0,
) -> optax.GradientTransformationExtraArgs:
    """Divide each gradient entry by DDP-SGD's κ = ½ ∂²γ²_net/∂w² on the current batch.

    κ from `pathspace_jax.ddp_kappa` (γ_v² = α S(z_v) + (1 − α) Σ_{u→v} γ_u² w²_{u→v}; α = 0 is
    Path-SGD, α = 1 with the second moment the diagonal natural gradient of a unit-variance Gaussian
    output model) scales like (β_u/β_v)² on an edge ``u -> v`` under a node-wise rescaling β, so
    ``g / κ`` is rescaling invariant for every α (Neyshabur et al. 2016, §6.1). As in
    `scale_by_path_sgd`, the update is ``m_ℓ g / max(κ + damping · m_ℓ (α_v / α_u)², floor · m_ℓ (α_v / α_u)²)``
    (plus ``eps``): α the balanced frame of G-SGD's chart and m_ℓ the geometric mean over the leaf of κ in it, so
    that with ``normalize=True`` (default) the learning rates of ``optax.sgd`` carry over at every α (the data's
    scale, which sets κ's at α = 1, included). ``floor`` and ``damping`` are relative to that geometric mean
    (rescaling invariant, well scaled): the default floor 1e-6 touches no entry above 1e-6 of its leaf's largest in
    the balanced frame, so the exact κ at α = 1 is the per-example Fisher there, and the default damping is 0. κ is
    computed in the canonical frame (gauge weights ±1) and the gradient divided there, so nothing overflows under
    any rescaling; ``eps`` is a plain additive constant in the params' units, off by default (it breaks the
    invariance). An entry with κ = 0 (on no path that the batch reaches: a dead unit, a tap that reads only padding)
    gets the plain step ``g`` (its gradient is then the loss's own term, e.g. weight decay's), never NaN. Leaves that
    ``trace`` marked ``"other"`` pass through.

    At α = 1 the exact estimator divides by a batch's Fisher, almost 0 where a unit sits at its kink or a feature is
    almost constant on the batch: the floor bounds such a step at 10⁶ times the leaf's typical one, and where that is
    not enough the default probe estimator or ``damping=1e-4`` is stable (docs/ddp_sgd.md, "The exact natural
    gradient and almost-constant features", has the measurements).

    Args:
      space: the `PathSpace` of the network (``pathspace_jax.trace``).
      alpha, moment, estimator, num_probes, probe_damping, probe_batch_size: as in
        `pathspace_jax.ddp_kappa`. Here the default estimator is ``"probes"`` (one damped probe on the whole
        batch: about 2× SGD's step; with ``probe_batch_size=n // 4`` 1.2–1.9× on CPU, with a noisier κ); pass
        ``estimator="exact"`` for the exact κ (one backward pass per output entry at α = 1: cheap for a few
        outputs, per node entry for 0 < α < 1).
      normalize: scale each leaf's step by m_ℓ (default), so that the learning rates of ``optax.sgd`` carry
        over; ``False``: the raw ``g / κ`` of the paper.
      damping: ≥ 0, relative to m_ℓ and added in the balanced frame (Tikhonov damping, rescaling invariant;
        default 0).
      floor: ≥ 0, relative to m_ℓ in the balanced frame: κ is at least this (rescaling invariant; default 1e-6).
      eps: added to κ in the params' frame (≥ 0; breaks the invariance, default 0).
      every: recompute κ every ``every`` steps (steps 0, k, 2k, ...), reusing the stored κ between
        (``jax.lax.cond`` on the step count: no Python branching, no recompilation, also outside ``jit``).
      batch_axes: where the examples of ``inputs`` are, as ``jax.vmap``'s ``in_axes``: a pytree prefix of the inputs
        tuple with 0 (examples on the leading axis; the default, for every leaf) or None (shared by every example:
        a PRNG key, nnx state, a scale or mask of the model); None for every input: the whole batch is one example
        (a graph batch). See `pathspace_jax.ddp_kappa`.

    Returns:
      An `optax.GradientTransformationExtraArgs`. ``update(updates, state, params, *, inputs, key=None,
      refresh_kappa=None)`` needs ``params`` and the batch ``inputs`` (the positional arguments of the traced
      function after params: one as it is, a tuple for several; any pytree, its examples where ``batch_axes``
      says); ``key`` seeds the probes (when omitted, probes are drawn from ``jax.random.key(0)`` folded with the
      step count, the same for every member of a vmapped ensemble); ``refresh_kappa``, a Python bool, recomputes
      κ (True) or reuses the kept one (False, with ``every > 1``) in place of the ``every`` schedule, with no
      conditional in the compiled step (see `scale_by_path_sgd`). Other extra keyword arguments are ignored. The
      state is `ScaleByDDPState`.

    Example:
      >>> tx = optax.chain(pj.scale_by_ddp(space, alpha=1.0), optax.scale(-0.1))
      >>> state = tx.init(params)
      >>> updates, state = tx.update(grads, state, params, inputs=x)

    References:
      Neyshabur, Salakhutdinov, Tomioka, Srebro, "Data-dependent path normalization in neural networks",
      ICLR 2016.
    """

    config = _check_ddp(space, alpha, moment, estimator, num_probes, probe_batch_size, normalize, damping, floor, eps,
                        every)  # fmt: skip

    def init_fn(params):
        return ScaleByDDPState(jnp.zeros([], jnp.int32), kappa_state(space, params, every))

    def update_fn(updates, state, params=None, *, inputs=None, key=None, refresh_kappa=None, **extra_args):
        del extra_args
        xs, axes = _check_ddp_update(space, config, params, inputs, batch_axes)
        if key is None:
            key = jax.random.fold_in(jax.random.key(0), state.count)
        refresh = check_refresh(refresh_kappa, state.kept, "scale_by_ddp")
        return _ddp_update(space, config, updates, state, params, xs, key, damping, floor, eps, every, probe_damping,
                           refresh=refresh, axes=axes)  # fmt: skip

    tx = optax.GradientTransformationExtraArgs(init_fn, update_fn)
    return accept_masked(space, "scale_by_ddp", tx, runs_network=config[0] > 0.0)  # config[0]: alpha, a float


def _check_ddp(space, alpha, moment, estimator, num_probes, probe_batch_size, normalize, damping, floor, eps, every):
    """`scale_by_ddp`'s checks of its space and options; returns its static options ``(alpha, moment, estimator,
    num_probes, probe_batch_size, normalize)`` as Python values (the ``config`` of `_ddp_update`)."""
    check_ddp_space(space)
    warn_if_plain(space, "scale_by_ddp")
    _check_every_eps(every, eps, damping, floor)
    _check_static(
        "scale_by_ddp", alpha=alpha, num_probes=num_probes, probe_batch_size=probe_batch_size, normalize=normalize
    )
    alpha, num_probes, probe_batch_size = check_options(alpha, moment, estimator, num_probes, probe_batch_size)
    return alpha, moment, estimator, num_probes, probe_batch_size, bool(normalize)


def _check_ddp_update(space, config, params, inputs, batch_axes) -> tuple[list, tuple]:
    """`scale_by_ddp`'s checks of what ``update`` got (``config``: `_check_ddp`'s); returns the leaves of the batch
    ``inputs`` and each one's batch axis (0 or None), as `pathspace_jax.ddp_inputs.check_inputs` does."""
    alpha, moment = config[:2]
    if params is None:
        raise ValueError("scale_by_ddp needs params: call tx.update(updates, state, params, inputs=batch)")
    if inputs is None:
        raise TypeError(
            "scale_by_ddp needs the batch as a keyword argument: tx.update(updates, state, params, inputs=x) "
            "(inputs = the positional arguments of the traced function after params)"
        )
    xs, axes = check_inputs(space, inputs, batch_axes, "scale_by_ddp")
    check_examples(axes, moment, alpha)
    return xs, axes


@functools.partial(eager_jit, static_argnums=(0, 1), static_argnames=("refresh", "axes"))
def _ddp_update(space, config, updates, state, params, xs, key, damping, floor, eps, every, probe_damping, *, refresh,
                axes):  # fmt: skip
    """One `scale_by_ddp` step (jitted, so that calls outside ``jit`` compile once); ``xs``: the batch's leaves,
    ``axes`` their batch axes (0 or None)."""

    alpha, moment, estimator, num_probes, probe_batch_size, normalize = config

    def compute():
        leaves = [jnp.asarray(p) for p in space.leaves_of(params, "params")]
        in_cond = state.kept is not None and refresh is None
        kappa, lg = ddp_kappa_canonical(space, leaves, xs, key, alpha, moment, estimator, num_probes, probe_damping,
                                        True, probe_batch_size, in_cond, axes)  # fmt: skip
        return kept_kappa(space, params, space.unflatten_like(params, kappa), lg)

    kept, stored = current_kappa(compute, state.kept, state.count, every, refresh)
    new = divide_by_kappa(space, updates, kept, normalize, damping, floor, eps)
    return new, ScaleByDDPState(optax.safe_int32_increment(state.count), stored)


# ---------------------------------------------------------------------------- G-SGD: in_path_space


def _check_in_path_space(space, normalize, rebalance, min_ratio, min_share) -> tuple[bool, bool]:
    """`in_path_space`'s checks of its space and options; returns ``(normalize, rebalance)`` as Python bools."""
    check_path_space(space, "in_path_space")
    warn_if_plain(space, "in_path_space")
    _check_static("in_path_space", normalize=normalize, rebalance=rebalance)
    if not is_traced(min_ratio) and not 0 < min_ratio < 1:
        raise ValueError(f"min_ratio must be in (0, 1), got {min_ratio}")
    if not is_traced(min_share) and not 0 <= min_share <= 1:
        raise ValueError(f"min_share must be in [0, 1], got {min_share}")
    return bool(normalize), bool(rebalance)


class InPathSpaceState(NamedTuple):
    """State of `in_path_space`: the state of the inner transformation, which acts on path coordinates."""

    inner_state: Any


def in_path_space(
    inner: optax.GradientTransformation,
    space,
    *,
    normalize: bool = True,
    rebalance: bool = True,
    min_ratio: float = 0.5,
    min_share: float = 0.0,
) -> optax.GradientTransformationExtraArgs:
    """Run any optax transformation on path coordinates instead of the weights (G-SGD, G-Adam).

    The coordinates are the values of the basis paths, ``c_e = A_u w_e B_v`` for a non-gauge entry
    ``e = u -> v`` (`pathspace_jax.to_coords`; A_u, B_v: products of the weights along u's incoming and
    v's outgoing skeleton chains), divided by rescaling-invariant scales: ``φ = c / σ`` with σ from
    `pathspace_jax.coord_scales` at the current params (``normalize=True``, the default), or ``σ = 1``
    (``normalize=False``: the raw basis-path values of Meng et al.). The H gauge entries (outgoing
    skeleton weights) are held fixed. One step:

      1. ∂L/∂c from ∂L/∂w by the inverse chain rule, i.e. the VJP of `pathspace_jax.from_coords` with the
         gauge fixed — closed form, O(m): ``g_e / (A_u B_v)`` at a non-gauge entry, plus a per-node
         correction at the incoming skeleton entries (eqs. 15–16 of the G-SGD-for-RNNs paper); 0 at the
         gauge; then ``∂L/∂φ = σ ∂L/∂c``;
      2. ``dφ, s = inner.update(∂L/∂φ, s, φ, **extra_args)`` (``inner`` sees φ as its params);
      3. weight allocation: the weights whose coordinates are ``c + σ dφ`` with the same gauge (ibid.,
         eqs. 10–11); the update is their difference from ``params``.

    So every step is exact in the chart it uses: with ``inner = optax.sgd(η)``, φ moves by exactly
    ``−η ∂L/∂φ`` (c by ``−η σ² ∂L/∂c``; with ``normalize=False`` c by ``−η ∂L/∂c``, the G-SGD step of
    ibid., eq. 6), and with any ``inner`` by ``inner``'s update of ∂L/∂φ. The skeleton is the space's
    (from the graph alone by default), and σ is computed from the params inside the update, so one space
    serves any params of its structure — every member of an ensemble, a restored checkpoint — and the
    state is ``inner``'s alone. φ, ∂L/∂φ and σ are rescaling invariant and the gauge does not move, so a
    step from T_α(w) gives the same function as a step from w, for every ``inner``.

    With σ, a coordinate entry moves as SGD (or ``inner``) would move its weight in the *balanced frame* of the current
    params (`pathspace_jax.gsgd.frame_level`), and a node's incoming skeleton coordinate moves multiplicatively, so the
    learning rates of ``optax.sgd`` / ``optax.adam`` carry over; on the raw coordinates a weight moves by
    ``η g_e / (A_u B_v)²``, 10²–10⁴ times SGD's step from a standard initialisation, unless the skeleton weights are ±1
    (`pathspace_jax.skeleton_init`). With ``rebalance=True`` the new weights are also rescaled node-wise by the powers
    of two nearest to the current params' balanced frame (`pathspace_jax.gsgd.balancing_factors`), so that they do not
    drift along their rescaling orbit: the function and every coordinate are bit for bit those of the exact step. The
    allocation divides by ``A_x = c_x / B_x`` (c_x: the coordinate of x's incoming skeleton edge): a step never takes
    c_x below ``min_ratio · c_x`` nor across zero (nor, with ``min_share > 0``, below that share of the norm of the
    coordinates entering x), the only departure from the exact step. A zero skeleton weight gives a zero update at the
    entries it divides, never NaN, and ``init`` refuses concrete params with one (`pathspace_jax.gsgd.check_chart`).
    docs/g_sgd.md ("Options") explains the normalisation, the rebalancing and the safeguard in full.

    Args:
      inner: any optax transformation (``optax.sgd``, ``optax.adam``, a chain with clipping or a
        schedule, ``...ExtraArgs`` variants).
      space: the `PathSpace` of the network (``pathspace_jax.trace``).
      normalize: run ``inner`` on ``φ = c / σ`` (default) or on the raw basis-path values c.
      rebalance: rescale the new weights by powers of two towards the balanced frame (default).
      min_ratio: the largest shrink factor of an in-skeleton coordinate per step, in (0, 1).
      min_share: opt-in floor on ``|c_x| / ‖c_{→x}‖``, in [0, 1] (default 0: off).

    Returns:
      An `optax.GradientTransformationExtraArgs`; ``update(grads, state, params, **extra_args)`` needs
      ``params`` and passes ``extra_args`` to ``inner``. The state is `InPathSpaceState` (only
      ``inner``'s state). The update has the gradient's dtype (computed in float32 at least).

    Example:
      >>> tx = pj.in_path_space(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)), space)
      >>> state = tx.init(params)
      >>> updates, state = tx.update(grads, state, params)

    References:
      Meng et al., "G-SGD: Optimizing ReLU neural networks in its positively scale-invariant space",
      ICLR 2019; "Path Space for Recurrent Neural Networks with ReLU Activations" (Alg. 2, App. E
      G-Adam).
    """

    normalize, rebalance = _check_in_path_space(space, normalize, rebalance, min_ratio, min_share)
    inner = optax.with_extra_args_support(inner)

    def init_fn(params):
        gsgd.check_chart(space, params, "in_path_space")
        return InPathSpaceState(inner_state=inner.init(_chart_coords(space, normalize, rebalance, params)))

    def update_fn(updates, state, params=None, **extra_args):
        if params is None:
            raise ValueError("in_path_space needs params: call tx.update(grads, state, params)")
        gphi, phi, nodes, alpha = _chart_step(space, normalize, rebalance, params, updates)
        dphi, inner_state = inner.update(gphi, state.inner_state, phi, **extra_args)
        new = _weight_update(space, normalize, min_ratio, min_share, params, updates, dphi, nodes,
                             alpha if rebalance else None)  # fmt: skip
        return new, InPathSpaceState(inner_state=inner_state)

    return accept_masked(space, "in_path_space", optax.GradientTransformationExtraArgs(init_fn, update_fn))


def _weight_update(space, normalize, min_ratio, min_share, params, updates, dphi, nodes, alpha):
    """The weight allocation of an `in_path_space` step: the update of ``params`` (a tree like ``updates``, in its
    dtypes) that moves the coordinates by the inner optimizer's ``dphi``, at the chart `_chart_step` gave (``alpha``:
    its balanced frame, or None not to rebalance)."""
    w, g = space.leaves_of(params, "params"), space.leaves_of(updates, "updates")
    dphi, ct = space.leaves_of(dphi, "inner updates"), compute_dtype(list(w) + list(g))
    static = all(isinstance(x, (int, float)) for x in (min_ratio, min_share))  # (else injected: arrays)
    allocate = _allocate if static else _allocate_at
    u = allocate(space, normalize, ct, min_ratio, min_share, w, dphi, nodes, alpha)
    return space.unflatten_like(updates, [x.astype(jnp.result_type(y)) for x, y in zip(u, g)])


@functools.partial(eager_jit, static_argnums=(0, 1, 2))
def _chart_step(space, normalize, rebalance, params, grads):
    """G-SGD's chart at ``params`` for ``grads`` (`gsgd.chart_at`): ``(∂L/∂φ as a tree like grads, φ as a tree like
    params, the chart's node vectors, the balanced frame α)``. Jitted (compiled once per space and options), as
    `_allocate` is, so that a step called outside ``jit`` runs two programs and the inner optimizer's operations
    rather than dispatching each of the chart's many small operations alone (and compiling it the first time)."""
    _, g, _, gphi, phi, nodes, alpha = gsgd.chart_at(space, params, grads, normalize, rebalance)
    gphi = space.unflatten_like(grads, [x.astype(jnp.result_type(y)) for x, y in zip(gphi, g)])
    return gphi, phi, nodes._replace(guard=None), alpha  # (guard: a Python bool, `not normalize`)


def _allocate_at(space, normalize, ct, min_ratio, min_share, w, dphi, nodes, alpha):
    """`gsgd.allocate` at the chart `_chart_step` gives; `_allocate` is it jitted (see there), for hyperparameters
    that are Python numbers."""
    return gsgd.allocate(space, w, dphi, nodes._replace(guard=not normalize), ct, min_ratio, min_share, alpha)


_allocate = eager_jit(_allocate_at, static_argnums=(0, 1, 2, 3, 4))


@functools.partial(eager_jit, static_argnums=(0, 1, 2))
def _chart_coords(space, normalize, rebalance, params):
    """The coordinates of ``params`` in G-SGD's chart, for the inner optimizer's init: compiled once per space and
    options (run eagerly, the chart dispatches and first compiles each of its many small operations alone, seconds
    for a small RNN; jitted per transformation, each new one compiled again: 0.3-0.5 s on the test zoo's)."""
    return gsgd.chart_at(space, params, params, normalize, rebalance)[4]  # the gradient slot is unused here


# ---------------------------------------------------------------------------- Path-SGD


class ScaleByPathSGDState(NamedTuple):
    """State of `scale_by_path_sgd`: the step count and the κ last computed (recomputed every ``every`` steps).

    ``kept`` is None with ``every=1`` (the default, a Python int): κ is computed at each step and the state keeps
    nothing of the params' size. With ``every > 1`` it is a `pathspace_jax.scaling.PackedKappa`: κ of the leaves
    shaped like them, everything of node size in one vector per dtype (a GPU step pays per array of its state).
    ``state.kept.unpack()`` gives the `pathspace_jax.scaling.KeptKappa`: ``kappa``, κ in the canonical frame (the
    params rescaled so that their gauge weights are ±1), and ``log2_gauge``, the frame's per-node log2|B_v|
    (`pathspace_jax.frames.gauge_log2`) at that step: `pathspace_jax.frames.kappa_from_frame` gives κ of the params
    (``kappa · 2^(2(k_v − k_u))`` on each edge ``u -> v``, k the rounded log-gauge); ``frame`` (per node) and
    ``kappa_mean`` (per leaf), the balanced frame and κ's geometric leaf means in it, for the normalisation and
    the floor. All stay in range whatever node-wise rescaling the params carry. A dense kernel's κ (a 2-D leaf
    that one product with a single-row activation of the |·|^p network uses) is kept as
    `pathspace_jax.kappa.RankOne` vectors ``(a, b)`` with κ = a bᵀ (`pathspace_jax.kappa.full` expands it): the
    state then holds nothing of that kernel's size, and the step reads two vectors instead of a matrix.
    """

    count: jax.Array
    kept: PackedKappa | None


def scale_by_path_sgd(
    space,
    *,
    second_order: bool = True,
    normalize: bool = True,
    damping: float = 0.0,
    floor: float = 1e-6,
    eps: float = 0.0,
    every: int = 1,
) -> optax.GradientTransformation:
    """Divide each gradient entry by Path-SGD's κ = ½ ∂²γ²_net/∂p², normalised so that SGD's learning rates carry over.

    κ = κ⁽¹⁾ + κ⁽²⁾ from `pathspace_jax.path_kappa` (γ²_net = Σ_paths Π p²; κ⁽¹⁾ alone with
    ``second_order=False``) depends only on the params, never on the data. On an edge ``u -> v`` it
    scales like (β_u/β_v)² under a node-wise rescaling β, so ``g / κ`` is rescaling invariant (Neyshabur
    et al. 2016, Thm 2). The update is

        u_{u->v} = m_ℓ · g / (max(κ + damping · m_ℓ (α_v / α_u)², floor · m_ℓ (α_v / α_u)²) + eps),

    with α the *balanced frame* of G-SGD's normalised chart (`pathspace_jax.gsgd.balanced_frame`: every
    hidden node rescaled so that its outgoing and incoming path norms are in the same ratio across its layer,
    at the level where a standard initialisation is its own frame) and m_ℓ the geometric mean over leaf ℓ of κ in
    that frame, ``exp mean_e log(κ_e (α_u / α_v)²)`` over the entries with κ_e > 0 (``m_ℓ = 1`` in the numerator
    with ``normalize=False``).

    κ's size depends on the network (widths, depth, a convolution's positions, a sequence's length); divided by m_ℓ it
    has geometric mean 1 over each leaf in the balanced frame, so from a standard initialisation the step has SGD's
    size and the learning rates of ``optax.sgd`` carry over. Within a leaf the step is Path-SGD's direction; each leaf
    gets one positive factor, as with per-layer learning rates. m_ℓ depends on the params' rescaling orbit only (the
    balanced frame does), so every step stays exactly rescaling invariant, and the geometric mean is κ's typical size
    in the leaf, which a few huge entries do not move (`pathspace_jax.scaling.geometric_mean`). In the balanced frame
    the divisor is ``max(κ / m_ℓ + damping, floor)``: both scale exactly like κ, and since m_ℓ is at most the leaf's
    largest κ there, the floor touches no entry above ``floor`` times its leaf's largest, on any network, while it
    bounds the step where κ is almost 0 (the natural gradient's Fisher, `scale_by_ddp`). κ is computed in the
    canonical frame (gauge weights ±1 within √2, `pathspace_jax.frames.to_canonical_frame`) and the gradient divided
    there and brought back, so neither κ nor the update overflows or underflows under any rescaling as long as the
    update itself is representable. ``eps`` is a plain additive constant in the params' own units, off by default: it
    breaks the invariance. An entry whose κ is exactly 0 lies on no path (a tap that reads only padding, a weight out
    of a dead unit): its update is the gradient itself (the plain step of the same learning rate, e.g. weight
    decay's), never a step divided by the floor; `pathspace_jax.describe` counts such entries. Leaves that ``trace``
    marked ``"other"`` pass through unscaled. docs/path_sgd.md ("Learning rates" and "Options") has the measurements
    behind these choices.

    Args:
      space: the `PathSpace` of the network (``pathspace_jax.trace``).
      second_order: use the exact κ⁽¹⁾ + κ⁽²⁾ (default) or κ⁽¹⁾ alone (they differ on recurrent kernels only).
      normalize: scale each leaf's step by m_ℓ, κ's geometric mean over the leaf in the balanced frame (default),
        so that the learning rates of ``optax.sgd`` carry over; ``False``: the raw ``g / κ`` of the papers.
      damping: ≥ 0, relative to m_ℓ and added in the balanced frame (Tikhonov damping, rescaling invariant;
        default 0).
      floor: ≥ 0, relative to m_ℓ in the balanced frame: κ is at least this (rescaling invariant; default 1e-6).
      eps: added to κ in the params' frame (≥ 0; breaks the invariance, default 0).
      every: recompute κ every ``every`` steps (steps 0, k, 2k, …) and keep it in the state in between
        (``jax.lax.cond`` on the step count: no Python branching, no recompilation, also outside ``jit``).

    Returns:
      An `optax.GradientTransformationExtraArgs`; ``update(updates, state, params, *, refresh_kappa=None)``
      needs ``params``. ``refresh_kappa``, a Python bool (a static argument of the jitted step), takes the
      place of the ``every`` schedule: True recomputes κ (and keeps it), False reuses the kept κ (which needs
      ``every > 1``, so that the state keeps one), and neither compiles a conditional into the step. On a GPU
      the ``lax.cond`` of ``every`` can cost more than κ on small models; two compiled steps, one refreshing,
      called from Python on any schedule, do not pay it. Other extra keyword arguments are ignored. The
      state is `ScaleByPathSGDState`.

    Example:
      >>> tx = optax.chain(pj.scale_by_path_sgd(space), optax.scale(-0.1))  # SGD's learning rate
      >>> state = tx.init(params)
      >>> updates, state = tx.update(grads, state, params)

    References:
      Neyshabur, Wu, Salakhutdinov, Srebro, "Path-normalized optimization of recurrent neural networks with
      ReLU activations", NeurIPS 2016; Neyshabur, Salakhutdinov, Srebro, "Path-SGD: path-normalized
      optimization in deep neural networks", NeurIPS 2015.
    """

    second_order, normalize = _check_path_sgd(space, second_order, normalize, damping, floor, eps, every)

    def init_fn(params):
        return ScaleByPathSGDState(jnp.zeros([], jnp.int32), kappa_state(space, params, every, factored=True))

    def update_fn(updates, state, params=None, *, refresh_kappa=None, **extra_args):
        del extra_args
        if params is None:
            raise ValueError("scale_by_path_sgd needs params: call tx.update(updates, state, params)")
        refresh = check_refresh(refresh_kappa, state.kept, "scale_by_path_sgd")
        return _path_sgd_update(
            space, second_order, normalize, updates, state, params, damping, floor, eps, every, refresh=refresh
        )

    return accept_masked(space, "scale_by_path_sgd", optax.GradientTransformationExtraArgs(init_fn, update_fn))


def _check_path_sgd(space, second_order, normalize, damping, floor, eps, every) -> tuple[bool, bool]:
    """`scale_by_path_sgd`'s checks of its space and options; returns ``(second_order, normalize)`` as Python bools."""
    check_kappa_space(space, "scale_by_path_sgd")
    warn_if_plain(space, "scale_by_path_sgd")
    _check_every_eps(every, eps, damping, floor)
    _check_static("scale_by_path_sgd", second_order=second_order, normalize=normalize)
    return bool(second_order), bool(normalize)


@functools.partial(eager_jit, static_argnums=(0, 1, 2), static_argnames="refresh")
def _path_sgd_update(space, second_order, normalize, updates, state, params, damping, floor, eps, every, *, refresh):
    """One `scale_by_path_sgd` step (jitted, so that calls outside ``jit`` compile once)."""

    def compute():  # dense kernels' κ as `RankOne` where it is kept between steps (read at every step)
        kappa, lg = kappa_canonical(space, space.leaves_of(params, "params"), second_order, True)
        return kept_kappa(space, params, space.unflatten_like(params, kappa), lg)

    kept, stored = current_kappa(compute, state.kept, state.count, every, refresh)
    new = divide_by_kappa(space, updates, kept, normalize, damping, floor, eps)
    return new, ScaleByPathSGDState(optax.safe_int32_increment(state.count), stored)
