"""DDP-Normalization: the batch-normalisation side of data-dependent path normalisation.

Neyshabur, Salakhutdinov, Tomioka and Srebro ("Data-dependent path normalization in neural networks",
ICLR 2016, §4, eqs. 8-10) train *un-normalised* weights w̃ and compute the network with

    w_{u→v} = w̃_{u→v} / γ̃_v       at every internal (hidden) node v, its bias edge included,
    γ̃_v² = w̃_{→v}ᵀ R_v w̃_{→v},   R_v = α S + (1 − α) diag(γ²_{N_in(v)}),

output nodes un-normalised. S is the second moment (``moment="second"``) or the covariance
(``moment="variance"``) of the inputs feeding v on the batch, so w̃ᵀ S w̃ is the second moment or the
variance of the un-normalised pre-activation z̃_v = ⟨w̃_{→v}, h_{N_in(v)}⟩ (bias included); after
normalisation γ_u = 1 at every internal node, and γ = 1 at the inputs and the bias node, so

    γ̃_v² = α S(z̃_v) + (1 − α) Σ_{u→v} w̃²_{u→v},       z_v = z̃_v / γ̃_v.

The layers are normalised in order: the statistics of each layer are taken on the outputs of the
already normalised layers before it. α = 0 is a unit-wise path normalisation (no data); α = 1 with the
variance is batch normalisation without its shift and scale (eq. 9 adds them: ``center=True``
subtracts the batch mean and adds the bias edge back un-normalised, as ``flax.linen.BatchNorm`` with
scale 1 and offset the bias). The normalised network has γ_v(w) = 1 at every internal node, its
gradient is orthogonal to w̃_{→v} at every internal node (their Theorem 1), and it is invariant to
scaling the incoming weights of a node, not to node-wise rebalancing (§6).

**Nodes from tracing.** The internal nodes are the hidden node groups that `pathspace_jax.trace`
finds; a node of a convolution is a channel (its statistics are taken over the batch and every
position, as batch normalisation does), and the incoming weights of a node are every entry of the
edge leaves whose destination it is (taps and input channels of a kernel, its bias; of a leaf of stacked
layers, ``nn.scan`` over layers, the entries of the layer that enters it). The node axis of
a pre-activation must be its last axis (Dense, NHWC convolutions). Recurrences, residual connections
(a node that an activation enters without a parameter edge), pinned groups feeding hidden nodes of
their own and token ids (embedding lookups) are refused with an error that says why; integer inputs cast to
floats (uint8 pixels) are inputs like the others.

References:
  Neyshabur, Salakhutdinov, Tomioka, Srebro, "Data-dependent path normalization in neural networks",
  ICLR 2016: §4, eqs. (8)-(10), Thm 1, App. A.1, §6.2.
  Ioffe, Szegedy, "Batch normalization: accelerating deep network training by reducing internal
  covariate shift", ICML 2015.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pathspace_jax import jaxpr as jx
from pathspace_jax import program as flat
from pathspace_jax.ddp_inputs import refuse_local_batch
from pathspace_jax.errors import DDPNormalizationError
from pathspace_jax.forward import run_program
from pathspace_jax.frames import node_sum, take
from pathspace_jax.graph import PathSpace, check_path_space, reduced
from pathspace_jax.refusals import refuse_undefined
from pathspace_jax.rules import Op
from pathspace_jax.skeleton import skeleton

__all__ = ["ddp_normalize", "ddp_normalized_weights", "DDPNormalizationError"]


class _Node(NamedTuple):
    """A hidden node group's pre-activation in the forward program. A leaf is ``(index, layer)``: ``layer`` the
    entry of a leaf of stacked layers (``nn.scan`` over layers, a loop over a stacked leaf) whose slice enters
    the group, None for a leaf of its own."""

    group: int  # index into space.groups
    leaves: tuple[tuple[int, int | None], ...]  # the edge leaves entering it (kernels and bias)
    bias: tuple[int, int | None] | None  # the bias leaf among them (the shift with center=True)


def _at(a, layer):
    """A leaf's entries (or node array's) for one `_Node` leaf: the layer's slice of a stacked leaf."""
    return a if layer is None else a[layer]


def _put(a, layer, value):
    """``a`` with `_at` ``(a, layer)`` replaced by ``value``."""
    return value if layer is None else a.at[layer].set(value)


def _check(space: PathSpace, alpha, moment, eps) -> float:
    check_path_space(space, "ddp_normalize")
    refuse_undefined(space, "ddp_normalize", DDPNormalizationError)  # dropout traced; time-major inputs
    alpha = float(alpha)
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if moment not in ("second", "variance"):
        raise ValueError(f"moment must be 'second' or 'variance', got {moment!r}")
    if not float(eps) >= 0.0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    for spec in jax.tree_util.tree_leaves(space.arg_specs):
        if not flat.supported_input(spec.dtype):
            raise DDPNormalizationError(
                f"ddp_normalize: the traced function takes an input of dtype {spec.dtype}; DDP-Normalization is "
                "defined here for floating-point inputs, integers cast to floats and boolean masks"
            )
    return alpha


def _param_leaf(space: PathSpace, prog: flat.Program) -> dict[int, tuple[int, int | None]]:
    """For every var of kind param that is a view of one params leaf (a reshape of a bias), that leaf and, for a
    view of one layer's slice of a stacked leaf, the layer (`_Node`)."""
    leaf = {v: (j, None) for j, v in enumerate(prog.in_ids[: prog.n_params])}
    for e in prog.eqns:
        srcs = {leaf[x] for x in e.ins if not isinstance(x, tuple) and x in leaf}
        if len(srcs) == 1 and all(prog.kinds[o] == "param" for o in e.outs):
            ((j, layer),) = srcs
            layers = [layer] * len(e.outs)
            if layer is None and space.leaves[j].stacked is not None:  # layer i's slice, as the trace read it
                layers = jx.first_axis_entries(e.prim.name, e.params, len(e.outs))
            leaf.update((o, (j, i)) for o, i in zip(e.outs, layers, strict=True))
    return leaf


def _dst_groups(space: PathSpace, j: int, layer: int | None):
    """The node groups that leaf ``j`` (its layer's slice, for a stacked leaf) enters."""
    if layer is None:
        return set(space.leaves[j].dst_groups)
    offsets = np.array([g.offset for g in space.groups])
    return set(np.searchsorted(offsets, np.unique(reduced(space.leaves[j].dst)[0][layer]), side="right") - 1)


def _nodes(space: PathSpace, prog: flat.Program) -> dict[int, _Node]:
    """The pre-activation var of every hidden node group, with the edge leaves that enter it."""
    leaf_of = _param_leaf(space, prog)
    kinds = prog.kinds
    chain: dict[int, set[int]] = {}  # var -> edge leaves accumulated into it (a linear map, then biases)
    for e in prog.eqns:
        if e.body is not None or kinds[e.outs[0]] != "act":
            continue
        params = {leaf_of[x] for x in e.ins if not isinstance(x, tuple) and kinds[x] == "param" and x in leaf_of}
        acts = [x for x in e.ins if not isinstance(x, tuple) and kinds[x] == "act"]
        if (e.rule.linear_map or e.edge) and params:
            chain[e.outs[0]] = params
        elif any(x in chain for x in acts) and e.rule.continues_node:
            if e.rule.elementwise_sum and any(x not in chain for x in acts):
                where = e.where
                raise DDPNormalizationError(
                    f"ddp_normalize: the sum at {where} adds an activation to a pre-activation without a parameter "
                    "edge (a residual connection); DDP-Normalization (eq. 10) rescales every incoming edge of a "
                    "node, which a fixed skip connection is not: it is implemented for networks without them"
                )
            chain[e.outs[0]] = set().union(*(chain[x] for x in acts if x in chain)) | params
        elif e.rule.op is Op.SPLIT and acts and acts[0] in chain:  # a layer cut into groups (`pathspace_jax.cut_nodes`)
            chain.update(dict.fromkeys(e.outs, chain[acts[0]]))
    out: dict[int, _Node] = {}
    for v in prog.nodes:
        if v not in chain:
            continue
        leaves = sorted(chain[v], key=lambda jl: (jl[0], -1 if jl[1] is None else jl[1]))
        groups = set().union(*(_dst_groups(space, j, layer) for j, layer in leaves))
        if len(groups) != 1:
            raise DDPNormalizationError(
                f"ddp_normalize: a pre-activation is computed from edges into several node groups "
                f"({[space.leaves[j].path for j, _ in leaves]}: a kernel whose output is cut into pieces, as a "
                "fused q, k, v projection or a gated unit's two halves); DDP-Normalization is implemented here for "
                "one kernel and bias per node group: write one per piece"
            )
        g = groups.pop()
        if space.groups[g].kind != "hidden":
            continue  # output (and pinned) nodes are not normalised
        bias = [(j, layer) for j, layer in leaves if space.leaves[j].kind == "bias"]
        out[v] = _Node(g, tuple(leaves), bias[0] if len(bias) == 1 else None)
    return out


def _incoming(space: PathSpace, node: _Node, leaves) -> jax.Array:
    """Σ_{u→v} w̃²_{u→v} for every node of the group (kernel taps, input channels, bias)."""
    g, idx = space.groups[node.group], skeleton(space).leaves
    js = sorted({j for j, _ in node.leaves})  # a stacked leaf whole: its other layers' entries enter other groups
    parts = [(idx[j].dst_r, jnp.sum(leaves[j] ** 2, axis=idx[j].dst_sum_axes, keepdims=True)) for j in js]
    dtype = jnp.result_type(*[leaves[j] for j in js])
    return take(node_sum(space.num_nodes, parts, dtype), np.arange(g.offset, g.offset + g.size))


def _stat(z, moment):
    axes = tuple(range(z.ndim - 1))
    return jnp.mean(z * z, axis=axes) if moment == "second" else jnp.var(z, axis=axes)


def _run(space, prog, nodes, leaves, xs, alpha, moment, eps, center, record=None):
    """The forward program (`pathspace_jax.ddp`'s real forward pass) with every hidden pre-activation
    normalised where it is produced, so each layer's statistics see the normalised layers before it."""

    def normalize(o, z, e):
        if o not in nodes:
            return z
        node, group, dtype = nodes[o], space.groups[nodes[o].group], jnp.result_type(z)
        if jnp.shape(z)[-1:] != (group.size,):
            raise DDPNormalizationError(
                f"ddp_normalize: the pre-activation at {e.where} has shape {jnp.shape(z)}; its nodes (group "
                f"{group.name}, size {group.size}) must be its last axis (Dense, NHWC convolutions)"
            )
        z = z.astype(jnp.promote_types(dtype, jnp.float32))  # squares and sums of float16 values overflow
        gamma = jnp.sqrt(alpha * _stat(z, moment) + (1.0 - alpha) * _incoming(space, node, leaves) + eps)
        mean = jnp.mean(z, axis=tuple(range(z.ndim - 1)))
        if record is not None:
            record[o] = (gamma, mean)
        if center:
            z = (z - mean) / gamma + (0.0 if node.bias is None else _at(leaves[node.bias[0]], node.bias[1]))
        else:
            z = z / gamma
        return z.astype(dtype)  # the network's own type there (bfloat16 compute with float32 weights)

    return run_program(prog, list(leaves) + list(xs), [], post=normalize)[0]


def _program(space: PathSpace, param_key: tuple, input_key: tuple):
    return _checked_program(space, param_key, input_key, jax.sharding.get_abstract_mesh())


@functools.lru_cache(maxsize=32)
def _checked_program(space: PathSpace, param_key: tuple, input_key: tuple, mesh):
    """`_program` for the abstract mesh in context (part of the key, as in `pathspace_jax.program.program`)."""
    prog = flat.program(space, param_key, input_key, who="ddp_normalize", err=DDPNormalizationError)
    if prog.lookups:  # integer inputs cast to floats (uint8 pixels) are values, and normalised as any input
        raise DDPNormalizationError(
            "ddp_normalize: the traced function looks up embeddings by token ids; DDP-Normalization is defined here "
            "for floating-point inputs, integers cast to floats and boolean masks (trace a function of the one-hot "
            "input for token ids)"
        )
    if prog.sinks or prog.bnd - prog.gates:  # (a gate computed from the inputs alone commutes with the rescaling)
        raise DDPNormalizationError(
            "ddp_normalize: the network has pinned node groups (see pj.describe); DDP-Normalization is "
            "implemented here for networks that are positively homogeneous everywhere"
        )
    return prog, _nodes(space, prog)


def _setup(space, w_tilde, inputs, moment):
    leaves = [jnp.asarray(p) for p in space.leaves_of(w_tilde, "w_tilde")]
    xs = [jnp.asarray(x) for x in jax.tree_util.tree_leaves(inputs)]
    specs = jax.tree_util.tree_leaves(space.arg_specs)
    if len(xs) != len(specs):
        raise ValueError(f"expected {len(specs)} input array(s) (the traced function's arguments), got {len(xs)}")
    refuse_local_batch(xs, "DDP-Normalization's γ")
    for i, (x, spec) in enumerate(zip(xs, specs, strict=True)):
        if x.ndim == 0 or tuple(x.shape[1:]) != tuple(spec.shape[1:]):
            raise ValueError(
                f"input #{i} has shape {tuple(x.shape)}; the space was traced with examples of shape "
                f"{tuple(spec.shape[1:])} (batch axis first)"
            )
    if moment == "variance" and xs and xs[0].shape[0] < 2:
        raise DDPNormalizationError(
            "ddp_normalize(moment='variance') needs a batch of at least 2 examples: the variance of one example is 0"
        )
    param_key = tuple((tuple(p.shape), str(p.dtype)) for p in leaves)
    input_key = tuple((tuple(x.shape), str(x.dtype)) for x in xs)
    prog, nodes = _program(space, param_key, input_key)
    return leaves, xs, prog, nodes


def _check_zero(space, nodes, leaves, alpha, eps):
    """An internal node with no incoming weight has γ̃ = 0 (0/0): say where, for concrete weights."""
    if eps > 0 or any(isinstance(p, jax.core.Tracer) for p in leaves):
        return
    for node in nodes.values():
        inc = np.asarray(_incoming(space, node, leaves))
        if np.any(inc == 0):
            g = space.groups[node.group]
            raise DDPNormalizationError(
                f"ddp_normalize: node(s) {np.flatnonzero(inc == 0).tolist()} of group {g.name} have all-zero "
                f"incoming weights ({[space.leaves[j].path for j, _ in node.leaves]}): γ̃ = 0 and w̃ / γ̃ is undefined. "
                "Initialise them to non-zero values or pass eps > 0."
            )


def ddp_normalize(space: PathSpace, *, alpha: float, moment: str = "second", eps: float = 1e-5, center: bool = False):
    """The DDP-normalised version of the traced network: ``fn_tilde(w_tilde, *inputs)``.

    ``fn_tilde`` computes the network with w_{u→v} = w̃_{u→v} / γ̃_v at every hidden node v (bias edge
    included, outputs un-normalised), γ̃_v² = α S(z̃_v) + (1 − α) Σ_{u→v} w̃²_{u→v} + eps, S the second
    moment or the variance over the batch (and the positions of a convolution) of the un-normalised
    pre-activation z̃_v, taken layer by layer on the already normalised layers before it (Neyshabur
    et al., ICLR 2016, eqs. 8-10; see the module docstring). Train ``w_tilde`` (a pytree like the
    traced params) with any optax optimizer; the statistics come from the batch ``fn_tilde`` is given,
    as in batch normalisation, so use `ddp_normalized_weights` for inference on single examples.

    Args:
      space: the `PathSpace` of the network (``pathspace_jax.trace``).
      alpha: α in [0, 1]: 0 is a unit-wise path normalisation (no data), 1 with ``moment="variance"``
        batch normalisation without shift and scale.
      moment: ``"second"`` (uncentred, R_v = M) or ``"variance"`` (R_v = Cov).
      eps: added to γ̃_v² (as ``flax.linen.BatchNorm``'s epsilon): it keeps a node whose statistics
        vanish on a batch finite; 0 gives the exact definition (then an internal node with all-zero
        incoming weights raises, when the weights are concrete).
      center: eq. (9) with c_v = 1: z_v = (z̃_v − mean z̃_v) / γ̃_v + w̃_{bias→v}, the bias edge acting as
        the shift (``flax.linen.BatchNorm`` with scale 1 at α = 1 with the variance).

    Returns:
      ``fn_tilde(w_tilde, *inputs)``, a pure function (jit, vmap and grad as usual) returning what the
      traced function returns, in the dtype of ``w_tilde``.

    Raises:
      DDPNormalizationError: token ids (boolean masks and integers cast to floats are inputs), pinned groups,
        recurrences, residual connections, a node axis that is not the last, a batch of one with the variance.

    Example:
      >>> fn_tilde = pj.ddp_normalize(space, alpha=0.5)
      >>> loss = lambda w, x, y: ((fn_tilde(w, x) - y) ** 2).mean()
      >>> tx = optax.sgd(0.1)
      >>> updates, state = tx.update(jax.grad(loss)(w_tilde, x, y), tx.init(w_tilde), w_tilde)
      >>> w_tilde = optax.apply_updates(w_tilde, updates)

    References:
      Neyshabur, Salakhutdinov, Tomioka, Srebro, "Data-dependent path normalization in neural networks",
      ICLR 2016, §4, eqs. (8)-(10).
    """
    alpha = _check(space, alpha, moment, eps)
    eps = float(eps)

    def fn_tilde(w_tilde, *inputs):
        leaves, xs, prog, nodes = _setup(space, w_tilde, inputs, moment)
        _check_zero(space, nodes, leaves, alpha, eps)
        outs = _run(space, prog, nodes, leaves, xs, alpha, moment, eps, center)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(_out_shape(space, inputs)), outs)

    return fn_tilde


def _out_shape(space: PathSpace, inputs):
    params = jax.tree_util.tree_unflatten(
        space.treedef, [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in space.leaves]
    )
    return jax.eval_shape(space.fn, params, *inputs)


def ddp_normalized_weights(
    space: PathSpace,
    w_tilde,
    *inputs,
    alpha: float,
    moment: str = "second",
    eps: float = 1e-5,
    center: bool = False,
):
    """The plain weights w of DDP-Normalization on a calibration batch (eq. 10): the traced network with
    these params computes exactly ``ddp_normalize(space, ...)(w_tilde, *inputs)`` on that batch's
    statistics, without batch statistics (for export and inference on single examples).

    w_{→v} = w̃_{→v} / γ̃_v at every hidden node (γ̃_v measured on ``inputs``, layer by layer); with
    ``center=True`` the bias edge also absorbs the shift: w_{bias→v} = w̃_{bias→v} − mean z̃'_v / γ̃_v,
    z̃'_v the pre-activation without its bias (eq. 9 with c_v = 1). Leaves of other nodes (outputs) and of
    kind ``"other"`` are returned unchanged.

    Args:
      space, alpha, moment, eps, center: as in `ddp_normalize`.
      w_tilde: the un-normalised weights (a pytree like the traced params).
      *inputs: the calibration batch (the traced function's arguments after params).

    Returns:
      A pytree like ``w_tilde``: ordinary weights of the same architecture.

    Example:
      >>> w = pj.ddp_normalized_weights(space, w_tilde, x_calib, alpha=0.5)
      >>> plain = space.fn(w, x_calib)  # an ordinary network: no batch statistics
      >>> bool(jnp.allclose(plain, pj.ddp_normalize(space, alpha=0.5)(w_tilde, x_calib), atol=1e-5))
      True
    """
    alpha = _check(space, alpha, moment, eps)
    eps = float(eps)
    leaves, xs, prog, nodes = _setup(space, w_tilde, inputs, moment)
    _check_zero(space, nodes, leaves, alpha, eps)
    record: dict = {}
    _run(space, prog, nodes, leaves, xs, alpha, moment, eps, center, record)
    out, idx = list(leaves), skeleton(space).leaves
    for v, node in nodes.items():
        gamma, mean = record[v]
        g = space.groups[node.group]
        for j, layer in node.leaves:
            scaled = _at(out[j], layer) / take(gamma, _at(idx[j].dst_r, layer) - g.offset)
            out[j] = _put(out[j], layer, scaled.astype(leaves[j].dtype))
        if center:
            if node.bias is None:
                raise DDPNormalizationError(
                    f"ddp_normalized_weights(center=True): group {g.name} has no bias edge to hold the shift"
                )
            j, layer = node.bias
            b = _at(leaves[j], layer)
            shift = (mean - b) / gamma  # mean of the pre-activation without its bias, normalised
            out[j] = _put(out[j], layer, (b - take(shift, _at(idx[j].dst_r, layer) - g.offset)).astype(b.dtype))
    return space.unflatten_like(w_tilde, out)
