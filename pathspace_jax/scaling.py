"""The κ-scaled step that Path-SGD and DDP-SGD share: κ kept with its frames (`KeptKappa`, stored in the state as
`PackedKappa`), its typical size per leaf in the balanced frame (`geometric_mean`), and the division by it with
the floor (`divide_by_kappa`)."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import serialization

from pathspace_jax.frames import edge_factors, frame_factor_parts, frame_factors, in_canonical_frame, replicated
from pathspace_jax.graph import compute_dtype
from pathspace_jax.gsgd import balanced_frame
from pathspace_jax.kappa import RankOne, full, kappa_canonical


def is_traced(x) -> bool:
    """True for a hyperparameter that is a tracer (``optax.inject_hyperparams`` passes arrays): not checkable."""
    return isinstance(x, jax.core.Tracer)


def every_step(every) -> bool:
    """``every`` is the Python int 1: κ is computed at each step and not kept (inject_hyperparams passes arrays)."""
    return isinstance(every, int | np.integer) and every == 1


def kappa_state(space, params, every, factored=False) -> PackedKappa | None:
    """The initial kept κ, packed (`PackedKappa`): κ zeros like params (``factored``: `pathspace_jax.kappa.RankOne`
    zeros where Path-SGD keeps a dense kernel's κ as two vectors), zero node vectors and leaf means in the compute
    dtype; None when κ is computed at each step (`every_step`)."""
    if every_step(every):
        return None

    leaves = space.leaves_of(params, "params")
    kappa = [jnp.zeros(jnp.shape(p), jnp.result_type(p)) for p in leaves]
    if factored:
        shapes, _ = jax.eval_shape(lambda ls: kappa_canonical(space, ls, False, True), leaves)
        kappa = [
            RankOne(*(jnp.zeros(x.shape, jnp.result_type(p)) for x in k)) if isinstance(k, RankOne) else z
            for k, z, p in zip(shapes, kappa, leaves, strict=True)
        ]
    ct = compute_dtype(leaves)
    nodes, per_leaf = jnp.zeros((space.num_nodes,), ct), jnp.zeros((sum(mean_slots(space)),), ct)
    return PackedKappa.pack(KeptKappa(space.unflatten_like(params, kappa), nodes, nodes, per_leaf))


def mean_slots(space) -> list[int]:
    """Per leaf, how many geometric means of κ it has (`KeptKappa.kappa_mean`): one per layer for a leaf stacked
    over layers (``nn.scan``: each layer's slice is normalised as the same layer written in a loop), else one."""
    return [leaf.shape[0] if leaf.stacked is not None else 1 for leaf in space.leaves]


class KeptKappa(NamedTuple):
    """κ and its frames, as `scale_by_path_sgd` and `scale_by_ddp` compute them (and keep them with ``every > 1``).

    ``kappa``: κ in the canonical frame (the params rescaled by powers of two so that their gauge weights are ±1
    within √2; `pathspace_jax.frames.to_canonical_frame`), a tree like params. ``log2_gauge``: that frame's
    per-node log2|B_v| (`pathspace_jax.frames.kappa_from_frame` gives κ of the params). ``frame``: per node, the
    balanced frame of the canonical-frame params (`pathspace_jax.gsgd.balanced_frame`), in which a standard
    initialisation is its own frame. ``kappa_mean``: per leaf, the geometric mean of κ in that frame over its
    positive entries (`geometric_mean`; 0 for leaves of kind "other"; one per layer for a leaf stacked over
    layers, `mean_slots`). All four are the same for every power-of-two rescaling of the params, bit for bit.
    """

    kappa: Any
    log2_gauge: jax.Array
    frame: jax.Array
    kappa_mean: jax.Array


def _is_rank_one(k) -> bool:
    return isinstance(k, RankOne)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["arrays", "vectors"], meta_fields=["layout"])
@dataclasses.dataclass(frozen=True)
class PackedKappa:
    """A `KeptKappa` as the states of `scale_by_path_sgd` and `scale_by_ddp` keep it with ``every > 1``;
    `unpack` gives the `KeptKappa`.

    ``arrays``: κ of each leaf that `pathspace_jax.kappa.RankOne` does not factor, shaped (and sharded) like the
    leaf, in the order of the params' leaves. ``vectors``: everything of node size (the rank-one vectors,
    ``log2_gauge``, ``frame``, ``kappa_mean``) concatenated, one vector per dtype. ``layout`` (static): where each
    array of the `KeptKappa` is. A compiled step takes and returns each array of its state, and on a GPU each one
    costs the host microseconds per call, a step of 0.1 ms a few per cent: packed, the MLP 784-512-512-10's state
    holds 5 arrays instead of 13 (the figures are in benchmarks/README.md).
    """

    arrays: tuple
    vectors: tuple
    layout: tuple  # (the KeptKappa's treedef, per array of it: (node-sized?, shape, dtype))

    @classmethod
    def pack(cls, kept: KeptKappa, like: PackedKappa | None = None) -> PackedKappa:
        """``kept`` packed; with ``like``, in its layout and dtypes (κ as computed, to be kept)."""
        leaves, treedef = jax.tree_util.tree_flatten(kept)
        marks = jax.tree_util.tree_map(
            lambda k: RankOne(1, 1) if _is_rank_one(k) else 0, kept.kappa, is_leaf=_is_rank_one
        )
        small = [bool(m) for m in jax.tree_util.tree_leaves(KeptKappa(marks, 1, 1, 1))]  # node-sized arrays
        if like is not None:
            leaves = [jnp.asarray(a, d) for a, (_, _, d) in zip(leaves, like.layout[1], strict=True)]
        entries = tuple((m, tuple(jnp.shape(a)), jnp.dtype(a.dtype)) for m, a in zip(small, leaves, strict=True))
        vectors = tuple(
            replicated(
                jnp.concatenate([jnp.ravel(a) for m, a in zip(small, leaves, strict=True) if m and a.dtype == d])
            )
            for d in dict.fromkeys(d for m, _, d in entries if m)
        )
        return cls(tuple(a for m, a in zip(small, leaves, strict=True) if not m), vectors, (treedef, entries))

    def unpack(self) -> KeptKappa:
        """The `KeptKappa` (κ in the canonical frame with `pathspace_jax.kappa.RankOne` vectors where a dense
        kernel's κ is factored, the log-gauge, the balanced frame and the leaf means)."""
        treedef, entries = self.layout
        # whole on every device of the params' mesh, and so are their slices (`pathspace_jax.frames.replicated`):
        # else XLA splits them at boundaries of its own and exchanges halos at every slice
        vectors = dict(zip(dict.fromkeys(d for m, _, d in entries if m), map(replicated, self.vectors), strict=True))
        arrays, at, out = iter(self.arrays), dict.fromkeys(vectors, 0), []
        for node_sized, shape, dtype in entries:
            if not node_sized:
                out.append(next(arrays))
                continue
            n = math.prod(shape)
            out.append(replicated(jax.lax.slice(vectors[dtype], (at[dtype],), (at[dtype] + n,)).reshape(shape)))
            at[dtype] += n
        return jax.tree_util.tree_unflatten(treedef, out)


def _packed_state_dict(packed: PackedKappa) -> dict:
    return {
        "arrays": serialization.to_state_dict(packed.arrays),
        "vectors": serialization.to_state_dict(packed.vectors),
    }


def _packed_from_state_dict(target: PackedKappa, state: dict) -> PackedKappa:
    arrays = serialization.from_state_dict(target.arrays, state["arrays"], name="arrays")
    return PackedKappa(arrays, serialization.from_state_dict(target.vectors, state["vectors"], name="vectors"),
                       target.layout)  # fmt: skip


# `flax.serialization.to_bytes` / `from_bytes` (and so flax's msgpack checkpoints) save and restore it like the
# NamedTuples of the other states; orbax reads it as the pytree it is
serialization.register_serialization_state(PackedKappa, _packed_state_dict, _packed_from_state_dict)


def kept_kappa(space, params, kappa, lg) -> KeptKappa:
    """`KeptKappa` from κ in the canonical frame and its log-gauge ``lg`` (that of ``params``, from the κ pass:
    the canonical frame is not searched for again)."""
    leaves = space.leaves_of(params, "params")
    ct = compute_dtype(leaves)
    frame = balanced_frame(space, in_canonical_frame(space, leaves, lg.astype(ct), ct), ct)
    ks = jax.tree_util.tree_leaves(kappa, is_leaf=lambda k: isinstance(k, RankOne))
    parts = frame_factor_parts(space, frame)
    means = [leaf_mean(k, p, ct, n > 1) for k, p, n in zip(ks, parts, mean_slots(space), strict=True)]
    return KeptKappa(kappa, lg, frame, jnp.concatenate([jnp.ravel(m) for m in means]))


def leaf_mean(k, parts, ct, layers=False):
    """The geometric mean of one leaf's κ in the frame whose factor is ``d · s`` (`frame_factor_parts`): of
    ``κ / (d s)²``. A `RankOne` κ ``a bᵀ`` with a column ``s`` and a row ``d`` is not expanded: the mean of
    ``log(a_i / s_i²) + log(b_j / d_j²)`` over the positive pairs is the sum of the two vectors' mean logs
    (Path-SGD's κ on the MLP 784-512-512-10: a fifth of the step's time when expanded). With ``layers``, one
    mean per index of the first axis (a leaf stacked over layers)."""
    if parts is None:
        return jnp.zeros([k.shape[0]] if layers else [], ct)
    d, s = parts
    if isinstance(k, RankOne) and _is_column(s, k.a.size) and _is_column(d.T, k.b.size):
        return geometric_mean(jnp.asarray(k.a, ct) / jnp.ravel(s * s), jnp.asarray(k.b, ct) / jnp.ravel(d * d))
    x = jnp.asarray(full(k), ct) / (d * s) ** 2
    return jax.vmap(geometric_mean)(x) if layers else geometric_mean(x)


def _is_column(x, n) -> bool:
    return jnp.ndim(x) == 2 and jnp.shape(x)[1] == 1 and jnp.shape(x)[0] in (1, n)


def geometric_mean(x, y=None):
    """``exp(mean log x)`` over the positive finite entries of ``x`` (0 if there are none).

    The typical size of κ in a leaf: a few huge entries do not move it, where they would dominate the arithmetic
    mean. They are common: DDP-SGD's κ at α = 1 (a diagonal Fisher) is heavy-tailed, its arithmetic mean 5-28
    times its geometric mean on the digits CNN, and a probe estimate of the recurrent term at 0 < α < 1 has
    outliers 10⁶ times its median; dividing by the arithmetic mean gave typical entries steps that many times
    SGD's, and training diverged at SGD's learning rates. Path-SGD's κ in the balanced frame is nearly constant
    across a leaf (arithmetic mean within 10 % of the geometric one on the digits MLP, CNN and RNN), so there the
    two agree.

    With ``y``, that of the outer product ``x yᵀ`` of two non-negative vectors, from the vectors: the sum of their
    mean logs over their positive finite entries.
    """
    if y is not None:
        (mx, nx), (my, ny) = _mean_log(x), _mean_log(y)
        return jnp.where((nx > 0) & (ny > 0), jnp.exp(mx + my), 0).astype(x.dtype)
    m, n = _mean_log(x)
    return jnp.where(n > 0, jnp.exp(m), 0).astype(x.dtype)


def _mean_log(x):
    """``(mean log x, count)`` over the positive finite entries of ``x`` (mean 0 where there are none)."""
    ok = (x > 0) & jnp.isfinite(x)
    n = jnp.sum(ok)
    return jnp.sum(jnp.where(ok, jnp.log(jnp.where(ok, x, 1)), 0)) / jnp.maximum(n, 1), n


def check_refresh(refresh, stored: PackedKappa | None, who: str) -> bool | None:
    """``refresh_kappa`` as ``update`` got it: None (the ``every`` schedule), or a Python bool."""
    if refresh is None:
        return None
    if not isinstance(refresh, bool | np.bool_):
        raise TypeError(
            f"{who}: refresh_kappa must be None or a Python bool, got {type(refresh).__name__}. It decides when "
            "the step is traced whether κ is computed, so that the compiled step holds no conditional: make it a "
            "static argument of your jitted step (jax.jit(train_step, static_argnames='refresh')), or leave it "
            "None and schedule κ on the step count with every=k."
        )
    if not refresh and stored is None:
        raise ValueError(
            f"{who}: refresh_kappa=False reuses the κ kept in the state, but with every=1 the state keeps none: "
            "build the transformation with every=k > 1 (its state then keeps κ between refreshes)."
        )
    return bool(refresh)


def current_kappa(compute, stored: PackedKappa | None, count, every, refresh: bool | None = None):
    """(κ for this step, the state's `PackedKappa` after it): ``compute()`` at steps 0, every, 2·every, …, the
    ``stored`` κ in between (one ``lax.cond``); ``compute()`` alone when nothing is kept (``stored`` None, with
    `every_step`: nothing stored, so XLA fuses κ into the division). ``refresh`` (`check_refresh`), when not None,
    decides instead, with no conditional: ``compute()`` or ``stored``.

    κ travels as raveled arrays: on XLA:CPU a 2-D κ (an outer product for a dense kernel) otherwise gets a
    column-major layout and is transposed into the state on every step (benchmarks/README.md). The stored κ
    enters the ``cond`` as an operand, raveled outside it: raveled inside the branch, XLA:CPU copied every
    stored leaf into the ``cond`` at every step.
    """
    if stored is None:
        return compute(), None

    def fresh():
        return PackedKappa.pack(compute(), like=stored)

    if refresh is not None:
        new = fresh() if refresh else stored
        return new.unpack(), new

    def flat(packed):
        return [jnp.ravel(a) for a in (*packed.arrays, *packed.vectors)]

    ks = jax.lax.cond(count % every == 0, lambda _: flat(fresh()), lambda ks: ks, flat(stored))
    arrays = tuple(k.reshape(jnp.shape(a)) for k, a in zip(ks, stored.arrays, strict=False))
    new = PackedKappa(arrays, tuple(ks[len(arrays) :]), stored.layout)
    return new.unpack(), new


def divide_by_kappa(space, updates, kept: KeptKappa, normalize, damping, floor, eps):
    """``g m / (max(κ + damping · m (α_v / α_u)², floor · m (α_v / α_u)²) + eps)`` per entry ``u -> v`` (``m = 1``
    in the numerator unless ``normalize``).

    α is the balanced frame and m the leaf's geometric mean of κ in it (`KeptKappa`). With s = 2^(k_u − k_v)
    (`pathspace_jax.frames.edge_factors`), κ = κ_c / s², so the update is ``g m s² / (max(κ_c + damping · m f²,
    floor · m f²) + eps s²)`` (f: `pathspace_jax.frames.frame_factors` of α): the gradient taken to the canonical
    frame, divided there, and brought back, so nothing overflows where the update itself is representable. Where κ
    is exactly 0 (the entry lies on no path, or on none that the batch reaches: it does not change the function)
    the update is ``g`` itself, the plain step of the same learning rate, never one divided by the floor (so never
    NaN from finite params); a non-finite κ or gradient gives a non-finite step, as SGD's, which
    ``optax.apply_if_finite`` sees; leaves of kind "other" pass through.
    """

    out = []
    kappa = jax.tree_util.tree_leaves(kept.kappa, is_leaf=lambda k: isinstance(k, RankOne))
    leaves = zip(space.leaves, space.leaves_of(updates, "updates"), map(full, kappa))
    factors = zip(edge_factors(space, kept.log2_gauge, -1.0), frame_factors(space, kept.frame))
    starts = np.cumsum([0, *mean_slots(space)])
    for i, ((leaf, g, k), (s, f)) in enumerate(zip(leaves, factors)):
        if leaf.kind == "other":
            out.append(g)
            continue
        leaf_dtype = jnp.result_type(g)
        ct = compute_dtype([g, k])
        m = kept.kappa_mean[starts[i] : starts[i + 1]].astype(ct)  # one per layer of a stacked leaf, else one
        m = m.reshape([-1] + [1] * (jnp.ndim(g) - 1)) if leaf.stacked is not None else m[0]
        mf = m * (f * f)  # m_ℓ in the canonical frame
        den = jnp.maximum(jnp.asarray(k, ct) + damping * mf, floor * mf)
        if is_traced(eps) or eps > 0:
            den = den + eps * s * s
        num = jnp.asarray(g, ct) * (s * s * m if normalize else s * s)  # (g s): to the canonical frame; (g s) s: back
        scaled = num / jnp.where(den == 0, 1, den)  # den is 0 only where κ is
        # κ exactly 0: the entry lies on no path (a tap that reads only padding, a weight out of a dead unit) and
        # does not change the function; its gradient is the loss's own term (weight decay): the plain step
        out.append(jnp.where(jnp.asarray(k) == 0, g, scaled.astype(leaf_dtype)))
    return space.unflatten_like(updates, out)
