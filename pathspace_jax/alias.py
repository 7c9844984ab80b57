"""User-facing optimizers of pathspace_jax: path_sgd, ddp_sgd, g_sgd, g_adam."""

from __future__ import annotations

import optax

from pathspace_jax import transforms

# ---------------------------------------------------------------------------- DDP-SGD


def ddp_sgd(
    space,
    learning_rate,
    *,
    alpha: float,
    moment: str = "second",
    estimator: str = "probes",
    num_probes: int = 1,
    probe_damping: float = 0.3,
    probe_batch_size: int | None = None,
    momentum: float | None = None,
    every: int = 1,
    normalize: bool = True,
    damping: float = 0.0,
    floor: float = 1e-6,
    eps: float = 0.0,
    batch_axes=0,
) -> optax.GradientTransformationExtraArgs:
    """DDP-SGD (Neyshabur et al., ICLR 2016): w ← w − η g / κ, κ = ½ ∂²γ²_net/∂w² on the current batch.

    With the default ``normalize=True`` κ is divided by its geometric mean over each leaf in the balanced frame
    (`pathspace_jax.scale_by_ddp`), so the learning rates of ``optax.sgd`` carry over at every α.

    ``optax.chain(scale_by_ddp(...), [optax.trace(momentum)], optax.scale_by_learning_rate(lr))``: the
    κ-scaled gradient, optionally with heavy-ball momentum on the scaled gradient, times −η.

    Args:
      space: the `PathSpace` of the network (``pathspace_jax.trace``).
      learning_rate: η, a float or an optax schedule.
      alpha, moment, estimator, num_probes, probe_damping, probe_batch_size: see `pathspace_jax.scale_by_ddp`.
      every, normalize, damping, floor, eps: see `pathspace_jax.scale_by_ddp`.
      batch_axes: where the examples of ``inputs`` are (0: the leading axis, the default; None: shared by every
        example, or for every input: the whole batch one example), a pytree prefix of the inputs tuple as
        ``jax.vmap``'s ``in_axes``; see `pathspace_jax.scale_by_ddp`.
      momentum: heavy-ball decay (``optax.trace``), or None.

    Returns:
      An `optax.GradientTransformationExtraArgs`; call ``update(grads, state, params, inputs=x)`` (optionally
      ``key=`` and ``refresh_kappa=``: see `pathspace_jax.scale_by_ddp`).

    Example:
      >>> tx = pj.ddp_sgd(space, 0.1, alpha=1.0)  # one damped probe per step; estimator="exact" for exact κ
      >>> state = tx.init(params)
      >>> updates, state = tx.update(grads, state, params, inputs=x, key=key)

    References:
      Neyshabur et al., "Data-dependent path normalization in neural networks", ICLR 2016.
    """
    parts = [
        transforms.scale_by_ddp(
            space,
            alpha=alpha,
            moment=moment,
            estimator=estimator,
            num_probes=num_probes,
            probe_damping=probe_damping,
            probe_batch_size=probe_batch_size,
            normalize=normalize,
            damping=damping,
            floor=floor,
            eps=eps,
            every=every,
            batch_axes=batch_axes,
        )
    ]
    if momentum is not None:
        parts.append(optax.trace(decay=momentum))
    parts.append(optax.scale_by_learning_rate(learning_rate))
    return optax.chain(*parts)


# ---------------------------------------------------------------------------- G-SGD


def g_sgd(
    space,
    learning_rate,
    momentum: float | None = None,
    nesterov: bool = False,
    *,
    normalize: bool = True,
    rebalance: bool = True,
    min_ratio: float = 0.5,
    min_share: float = 0.0,
) -> optax.GradientTransformationExtraArgs:
    """G-SGD (Meng et al., ICLR 2019): SGD on the basis-path coordinates, then weight allocation.

    ``in_path_space(optax.sgd(learning_rate, momentum, nesterov), space)``; momentum (if any) is kept in
    path coordinates. With ``normalize=True`` (default) the coordinates are the basis-path values divided
    by rescaling-invariant scales (`pathspace_jax.coord_scales`), so G-SGD trains at the learning rates of
    ``optax.sgd`` from a standard initialisation; ``normalize=False`` is SGD on the raw basis-path values
    (ibid., eq. 6), whose step on a weight is ``η g / (A_u B_v)²``: start it from
    `pathspace_jax.skeleton_init` params (A = B = ±1) or scale the learning rate down.

    Args:
      space: the `PathSpace` of the network (``pathspace_jax.trace``).
      learning_rate: η, a float or an optax schedule.
      momentum, nesterov: as in ``optax.sgd``.
      normalize, rebalance, min_ratio, min_share: see `pathspace_jax.in_path_space`.

    Returns:
      An `optax.GradientTransformationExtraArgs`; ``update(grads, state, params)`` needs params.

    Example:
      >>> tx = pj.g_sgd(space, 0.05)
      >>> updates, state = tx.update(grads, tx.init(params), params)

    References:
      Meng et al., "G-SGD: Optimizing ReLU neural networks in its positively scale-invariant space", ICLR
      2019; "Path Space for Recurrent Neural Networks with ReLU Activations", Alg. 2.
    """
    inner = optax.sgd(learning_rate, momentum, nesterov)
    return transforms.in_path_space(
        inner, space, normalize=normalize, rebalance=rebalance, min_ratio=min_ratio, min_share=min_share
    )


def g_adam(
    space,
    learning_rate,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    *,
    nesterov: bool = False,
    normalize: bool = True,
    rebalance: bool = True,
    min_ratio: float = 0.5,
    min_share: float = 0.0,
) -> optax.GradientTransformationExtraArgs:
    """G-Adam (the G-SGD-for-RNNs paper, App. E): Adam on the basis-path coordinates, then weight allocation.

    ``in_path_space(optax.adam(learning_rate, b1, b2, eps, eps_root, nesterov=nesterov), space)``: the
    moments are those of the coordinate gradient, so the step is rescaling invariant. With the default
    normalised coordinates the learning rates of ``optax.adam`` carry over.

    Args:
      space: the `PathSpace` of the network (``pathspace_jax.trace``).
      learning_rate, b1, b2, eps, eps_root, nesterov: as in ``optax.adam``.
      normalize, rebalance, min_ratio, min_share: see `pathspace_jax.in_path_space`.

    Returns:
      An `optax.GradientTransformationExtraArgs`; ``update(grads, state, params)`` needs params.

    Example:
      >>> tx = pj.g_adam(space, 1e-3)

    References:
      Kingma & Ba, "Adam", ICLR 2015; "Path Space for Recurrent Neural Networks with ReLU
      Activations", App. E.
    """
    inner = optax.adam(learning_rate, b1, b2, eps, eps_root=eps_root, nesterov=nesterov)
    return transforms.in_path_space(
        inner, space, normalize=normalize, rebalance=rebalance, min_ratio=min_ratio, min_share=min_share
    )


# ---------------------------------------------------------------------------- Path-SGD


def path_sgd(
    space,
    learning_rate,
    *,
    momentum: float | None = None,
    nesterov: bool = False,
    second_order: bool = True,
    every: int = 1,
    normalize: bool = True,
    damping: float = 0.0,
    floor: float = 1e-6,
    eps: float = 0.0,
) -> optax.GradientTransformationExtraArgs:
    """Path-SGD: p ← p − η g / κ, κ = ½ ∂²γ²_net/∂p² (κ⁽¹⁾ + κ⁽²⁾ for recurrent kernels).

    With the default ``normalize=True`` κ is divided by its geometric mean over each leaf in the balanced frame
    (`pathspace_jax.scale_by_path_sgd`), so the learning rates of ``optax.sgd`` carry over.

    ``optax.chain(scale_by_path_sgd(...), [optax.trace(momentum, nesterov)], optax.scale_by_learning_rate(lr))``:
    the κ-scaled gradient, optionally with (Nesterov) momentum on the scaled gradient, times −η.

    Args:
      space: the `PathSpace` of the network (``pathspace_jax.trace``).
      learning_rate: η, a float or an optax schedule.
      momentum: momentum decay (``optax.trace``), or None.
      nesterov: Nesterov momentum (with ``momentum``).
      second_order, every, normalize, damping, floor, eps: see `pathspace_jax.scale_by_path_sgd` (``floor`` and
        ``damping`` keep the step rescaling invariant; ``eps`` does not).

    Returns:
      An `optax.GradientTransformationExtraArgs`; call ``update(grads, state, params)`` (optionally
      ``refresh_kappa=``: see `pathspace_jax.scale_by_path_sgd`).

    Example:
      >>> tx = pj.path_sgd(space, 0.1, momentum=0.9)  # SGD's learning rates
      >>> state = tx.init(params)
      >>> updates, state = tx.update(grads, state, params)

    References:
      Neyshabur et al., "Path-normalized optimization of recurrent neural networks with ReLU activations",
      NeurIPS 2016; Neyshabur, Salakhutdinov, Srebro, "Path-SGD", NeurIPS 2015.
    """
    parts = [
        transforms.scale_by_path_sgd(
            space, second_order=second_order, normalize=normalize, damping=damping, floor=floor, eps=eps, every=every
        )
    ]
    if momentum is not None:
        parts.append(optax.trace(decay=momentum, nesterov=nesterov))
    parts.append(optax.scale_by_learning_rate(learning_rate))
    return optax.chain(*parts)
