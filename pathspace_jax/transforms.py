"""optax transforms of pathspace_jax: scale_by_path_sgd, scale_by_ddp, in_path_space and their states."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pathspace_jax.graph import compute_dtype

# ---------------------------------------------------------------------------- κ scaling (Path-SGD, DDP-SGD)


def _traced(x) -> bool:
    """True for a hyperparameter that is a tracer (``optax.inject_hyperparams`` passes arrays): not checkable."""
    return isinstance(x, jax.core.Tracer)


def _check_every_eps(every, eps) -> None:
    if not _traced(every) and (isinstance(every, bool) or np.ndim(every) or int(every) != every or every < 1):
        raise ValueError(f"every must be a positive int, got {every!r}")
    if not _traced(eps) and not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")


def _check_static(where: str, **hyperparams) -> None:
    """Refuse traced hyperparameters that select the program run (not numbers in it)."""
    traced = [name for name, value in hyperparams.items() if _traced(value)]
    if traced:
        raise TypeError(
            f"{where}: {', '.join(traced)} select the computation and must be Python values, got traced arrays; "
            f"with optax.inject_hyperparams pass static_args={tuple(hyperparams)}"
        )


def _zeros_like_params(space, params):
    leaves = space.leaves_of(params, "params")
    return space.unflatten_like(params, [jnp.zeros(jnp.shape(p), jnp.result_type(p)) for p in leaves])


def _current_kappa(compute, kappa, count, every: int):
    """κ = ``compute()`` at steps 0, every, 2·every, …, the stored ``kappa`` in between (one ``lax.cond``).

    κ travels as raveled leaves: on XLA:CPU a 2-D κ (an outer product for a dense kernel) otherwise gets a
    column-major layout and is transposed into the state on every step (benchmarks/README.md).
    """

    def flat(tree):
        return [jnp.ravel(a) for a in jax.tree_util.tree_leaves(tree)]

    def fresh():
        return flat(jax.tree_util.tree_map(lambda a, b: a.astype(b.dtype), compute(), kappa))

    if not _traced(every) and every == 1:
        ks = jax.lax.optimization_barrier(fresh())
    else:
        ks = jax.lax.cond(count % every == 0, fresh, lambda: flat(kappa))
    leaves, treedef = jax.tree_util.tree_flatten(kappa)
    return jax.tree_util.tree_unflatten(treedef, [k.reshape(jnp.shape(a)) for k, a in zip(ks, leaves, strict=True)])


def _divide_by_kappa(space, updates, kappa, eps: float):
    """``g / (κ + eps)`` per entry, 0 where κ + eps = 0 (never NaN); leaves of kind "other" pass through."""
    out = []
    for leaf, g, k in zip(space.leaves, space.leaves_of(updates, "updates"), jax.tree_util.tree_leaves(kappa)):
        if leaf.kind == "other":
            out.append(g)
            continue
        den = (k + eps).astype(g.dtype)
        out.append(jnp.where(den > 0, g / jnp.where(den > 0, den, jnp.ones_like(den)), jnp.zeros_like(g)))
    return space.unflatten_like(updates, out)


# ---------------------------------------------------------------------------- DDP-SGD


class ScaleByDDPState(NamedTuple):
    """State of `scale_by_ddp`: the step count and the κ last computed (recomputed every ``every`` steps)."""

    count: jax.Array
    kappa: Any


def scale_by_ddp(
    space,
    *,
    alpha: float,
    moment: str = "second",
    estimator: str = "exact",
    num_probes: int = 1,
    eps: float = 1e-8,
    every: int = 1,
) -> optax.GradientTransformationExtraArgs:
    """Divide each gradient entry by DDP-SGD's κ = ½ ∂²γ²_net/∂w² on the current batch (seed 002 eq. 15).

    u_e = g_e / (κ_e + eps), with κ from `pathspace_jax.ddp_kappa` (γ_v² = α S(z_v) + (1 − α) Σ_{u→v}
    γ_u² w²_{u→v}; α = 0 is Path-SGD, α = 1 with the second moment the diagonal natural gradient of a
    unit-variance Gaussian output model). κ scales like w² under node-wise rescaling, so with
    ``eps = 0`` the resulting step is exactly rescaling invariant (seed 002 §6.1); ``eps`` only
    damps entries whose κ is tiny (a dead unit has κ = 0 and gradient 0: its update is 0, never NaN;
    an entry with κ + eps = 0 gets update 0). Leaves that ``trace`` marked ``"other"`` (not edges of
    the homogeneous part) pass through unscaled.

    Args:
      space: the `PathSpace` of the network (``pathspace_jax.trace``).
      alpha, moment, estimator, num_probes: as in `pathspace_jax.ddp_kappa`.
      eps: added to κ before dividing (≥ 0).
      every: recompute κ every ``every`` steps (steps 0, k, 2k, ...), reusing the stored κ between
        (``jax.lax.cond`` on the step count: no Python branching, no recompilation).

    Returns:
      An `optax.GradientTransformationExtraArgs`. ``update(updates, state, params, *, inputs, key=None)``
      needs ``params`` and the batch ``inputs`` (the positional arguments of the traced function after
      params); ``key`` seeds the probes (when omitted, probes are drawn from ``jax.random.key(0)``
      folded with the step count, the same for every member of a vmapped ensemble). Other extra
      keyword arguments are ignored.

    Example:
      >>> tx = optax.chain(pj.scale_by_ddp(space, alpha=1.0, estimator="probes"), optax.scale(-0.1))
      >>> updates, state = tx.update(grads, state, params, inputs=x)

    References:
      Neyshabur et al., "Data-dependent path normalization in neural networks", ICLR 2016.
    """
    from pathspace_jax.ddp import ddp_kappa

    _check_every_eps(every, eps)
    _check_static("scale_by_ddp", alpha=alpha, num_probes=num_probes)
    if estimator not in ("exact", "probes"):
        raise ValueError(f"estimator must be 'exact' or 'probes', got {estimator!r}")

    def init_fn(params):
        return ScaleByDDPState(count=jnp.zeros([], jnp.int32), kappa=_zeros_like_params(space, params))

    def update_fn(updates, state, params=None, *, inputs=None, key=None, **extra_args):
        del extra_args
        if params is None:
            raise ValueError("scale_by_ddp needs params: call tx.update(updates, state, params, inputs=batch)")
        if inputs is None:
            raise TypeError(
                "scale_by_ddp needs the batch as a keyword argument: tx.update(updates, state, params, inputs=x) "
                "(inputs = the positional arguments of the traced function after params)"
            )
        if key is None:
            key = jax.random.fold_in(jax.random.key(0), state.count)

        def compute():
            return ddp_kappa(
                space, params, inputs, alpha=alpha, moment=moment, estimator=estimator, num_probes=num_probes, key=key
            )

        kappa = _current_kappa(compute, state.kappa, state.count, every)
        new = _divide_by_kappa(space, updates, kappa, eps)
        return new, ScaleByDDPState(count=optax.safe_int32_increment(state.count), kappa=kappa)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# ---------------------------------------------------------------------------- G-SGD: in_path_space


class InPathSpaceState(NamedTuple):
    """State of `in_path_space`: the state of the inner transformation, which acts on path coordinates."""

    inner_state: Any


def in_path_space(
    inner: optax.GradientTransformation, space, *, min_ratio: float = 0.5, min_share: float = 0.5
) -> optax.GradientTransformationExtraArgs:
    """Run any optax transformation on the path coordinates instead of the weights (G-SGD, G-Adam).

    With the coordinates c = `pathspace_jax.to_coords` (basis-path values; the H gauge entries, the
    outgoing skeleton weights, are held fixed), one step is

      1. ∂L/∂c from ∂L/∂w by the inverse chain rule ∂L/∂w = (∂c/∂w)ᵀ ∂L/∂c, i.e. the VJP of
         `pathspace_jax.from_coords` with the gauge fixed — closed form, O(m): ``g_e / (A_u B_v)`` at a
         non-gauge entry ``e = u -> v``, plus a per-node correction at the incoming skeleton entries
         (seed 001 eqs. 15–16); 0 at the gauge entries;
      2. ``dc, s = inner.update(∂L/∂c, s, c, **extra_args)`` (``inner`` sees coordinates as params);
      3. weight allocation: the weights whose coordinates are ``c + dc`` with the same gauge
         (seed 001 eqs. 10–11); the update is their difference from ``params``.

    So with ``inner = optax.sgd(η)`` the coordinates move by exactly −η ∂L/∂c (seed 001 eq. 6), except
    where the in-skeleton rule below holds back one of the H in-skeleton coordinates. Since
    the coordinates and ∂L/∂c are rescaling invariant and the gauge does not move, a step from
    T_α(w) gives the same function as a step from w, for every ``inner``.

    **In-skeleton rule.** The allocation divides by ``A_x = c_x / B_x``, c_x the coordinate of x's
    incoming skeleton edge, so c_x must never reach zero or change sign; and a c_x that is small
    next to the other coordinates entering x makes the chart ill-conditioned (paths through x have
    values ∝ 1/c_x; under cross-entropy the G-SGD flow is drawn to that singularity and diverges).
    Each in-skeleton coordinate therefore moves by the ratio ``ρ_x = max(1 + dc_x / c_x, lo_x)``,
    ``lo_x = max(min_ratio, min(1, min_share / share_x))``, where ``share_x = |c_x| / s_x`` and s_x is
    the norm of the coordinates of all edges into x: it never changes sign, shrinks by at most a
    factor ``min_ratio`` per step, and never shrinks below a share ``min_share`` of x's incoming
    coordinate norm (if its share is already smaller, it may only grow). Growth is not limited.
    Coordinates are rescaling invariant, so the rule is; it only acts on the H in-skeleton
    coordinates, every other coordinate moves exactly by ``dc``. ``min_share = 0`` gives plain
    G-SGD up to sign protection. Gauge weights never move, so B never changes. Biases are never
    divisors (Flax initialises them to zero); a zero divisor (a zero skeleton weight at the start)
    gives a zero update, not NaN.

    Args:
      inner: any optax transformation (``optax.sgd``, ``optax.adam``, a chain with clipping or a
        schedule, ``...ExtraArgs`` variants).
      space: the `PathSpace` of the network (``pathspace_jax.trace``).
      min_ratio: the in-skeleton rule's largest shrink factor per step, in (0, 1).
      min_share: the in-skeleton rule's floor on ``|c_x| / s_x``, in [0, 1].

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
      ICLR 2019; seed 001 (path space for RNNs, Alg. 2, App. E G-Adam).
    """
    from pathspace_jax import coords as _coords

    if not _traced(min_ratio) and not 0 < min_ratio < 1:
        raise ValueError(f"min_ratio must be in (0, 1), got {min_ratio}")
    if not _traced(min_share) and not 0 <= min_share <= 1:
        raise ValueError(f"min_share must be in [0, 1], got {min_share}")
    inner = optax.with_extra_args_support(inner)

    def init_fn(params):
        return InPathSpaceState(inner_state=inner.init(_coords.to_coords(space, params)))

    def update_fn(updates, state, params=None, **extra_args):
        if params is None:
            raise ValueError("in_path_space needs params: call tx.update(grads, state, params)")
        w = space.leaves_of(params, "params")
        g = space.leaves_of(updates, "updates")
        ct = compute_dtype(list(w) + list(g))
        gc, c, factors = _coords._coord_grads(space, w, g, ct)
        gc_tree = space.unflatten_like(updates, [x.astype(jnp.result_type(y)) for x, y in zip(gc, g)])
        c_tree = space.unflatten_like(params, [x.astype(jnp.result_type(y)) for x, y in zip(c, w)])
        dc, inner_state = inner.update(gc_tree, state.inner_state, c_tree, **extra_args)
        u = _coords._allocate(space, w, space.leaves_of(dc, "inner updates"), factors, ct, min_ratio, min_share)
        out = [x.astype(jnp.result_type(y)) for x, y in zip(u, g)]
        return space.unflatten_like(updates, out), InPathSpaceState(inner_state=inner_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# ---------------------------------------------------------------------------- Path-SGD


class ScaleByPathSGDState(NamedTuple):
    """State of `scale_by_path_sgd`: the step count and the κ last computed (recomputed every ``every`` steps)."""

    count: jax.Array
    kappa: Any


def scale_by_path_sgd(
    space, *, second_order: bool = True, eps: float = 1e-8, every: int = 1
) -> optax.GradientTransformation:
    """Divide each gradient entry by Path-SGD's κ = ½ ∂²γ²_net/∂p² (seed 000).

    u_i = g_i / (κ_i + eps), with κ = κ⁽¹⁾ + κ⁽²⁾ from `pathspace_jax.path_kappa` (γ²_net = Σ_paths Π p²;
    κ⁽¹⁾ alone with ``second_order=False``). κ depends only on the params, never on the data. It scales
    like p² under node-wise rescaling, so with ``eps = 0`` the step is exactly rescaling invariant for
    both settings of ``second_order`` (seed 000 Thm 2); ``eps`` only damps entries whose κ is tiny, in
    the params' units squared. An entry with κ + eps = 0 (a dead unit, with ``eps = 0``) gets update
    0, never NaN. Leaves that ``trace`` marked ``"other"`` pass through unscaled.

    Args:
      space: the `PathSpace` of the network (``pathspace_jax.trace``).
      second_order: use the exact κ⁽¹⁾ + κ⁽²⁾ (default) or κ⁽¹⁾ alone (they differ on recurrent kernels only).
      eps: added to κ before dividing (≥ 0).
      every: recompute κ every ``every`` steps (steps 0, k, 2k, …) and keep it in the state in between
        (``jax.lax.cond`` on the step count: no Python branching, no recompilation).

    Returns:
      An `optax.GradientTransformation`; ``update(updates, state, params)`` needs ``params``. Extra
      keyword arguments are ignored.

    Example:
      >>> tx = optax.chain(pj.scale_by_path_sgd(space), optax.scale(-0.01))
      >>> updates, state = tx.update(grads, state, params)

    References:
      Neyshabur et al., "Path-normalized optimization of recurrent neural networks with ReLU activations",
      NeurIPS 2016; Neyshabur, Salakhutdinov, Srebro, "Path-SGD", NeurIPS 2015.
    """
    from pathspace_jax.kappa import _check_space, path_kappa

    _check_space(space, "scale_by_path_sgd")
    _check_every_eps(every, eps)

    def init_fn(params):
        return ScaleByPathSGDState(count=jnp.zeros([], jnp.int32), kappa=_zeros_like_params(space, params))

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        if params is None:
            raise ValueError("scale_by_path_sgd needs params: call tx.update(updates, state, params)")
        kappa = _current_kappa(
            lambda: path_kappa(space, params, second_order=second_order), state.kappa, state.count, every
        )
        new = _divide_by_kappa(space, updates, kappa, eps)
        return new, ScaleByPathSGDState(count=optax.safe_int32_increment(state.count), kappa=kappa)

    return optax.GradientTransformation(init_fn, update_fn)
