"""A zoo of small real models for the tests: linen, nnx and plain JAX.

Each `Case` has the forward function ``fn(params, x)``, float64 params, a
function drawing inputs, and what a person counted by hand: the number of
hidden nodes (H) and of pinned node groups. Other test files may use it
(``from zoo import ZOO``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import pathspace_jax as pj


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    fn: Callable[..., Any]
    params: Any
    draw: Callable[[Any, int], Any]  # (key, batch) -> input
    hidden: int  # H counted by hand
    pinned: int = 0  # number of pinned groups counted by hand
    recurrent: bool = False
    # exact symmetries of the function beyond node-wise rescaling, each explained
    # where the model is defined: the Jacobian rank is then m - H - extra
    extra_symmetries: int = 0

    def inputs(self, batch: int = 4, seed: int = 1):
        return self.draw(jax.random.key(seed), batch)


def _f64(tree):
    return jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64), tree)


def _alive(params, with_jax: bool = False):
    """Make the parameters generic for the rank checks.

    Every unit's incoming weights are pushed towards mixed signs (half their mean
    over the unit's inputs is removed; removing all of it would make a fan-in of
    two degenerate) and biases small random values of both signs, so that each ReLU unit is
    on for some inputs and off for others. A unit that never fires, or one that
    always fires together with another (two linear maps in a row), has symmetries
    beyond node-wise rescaling and would spoil the rank checks.
    """
    leaves, treedef = jax.tree_util.tree_flatten(params)
    if with_jax:  # the original draws (jax.random: compiles per shape), for the cases that need them
        keys = jax.random.split(jax.random.key(99), len(leaves))
        noise = [lambda shape, k=k: np.asarray(jax.random.normal(k, shape, jnp.float64)) for k in keys]
    else:  # numpy: no XLA compilation per shape at import
        rng = np.random.default_rng(99)
        noise = [rng.standard_normal for _ in leaves]
    out = []
    for a, draw in zip(leaves, noise):
        a = np.asarray(a, np.float64)
        if a.ndim == 1:
            out.append(0.05 * draw(a.shape))
        else:
            a = a + 0.1 * draw(a.shape)
            out.append(a - 0.5 * a.mean(axis=tuple(range(a.ndim - 1)), keepdims=True))
    return _f64(jax.tree_util.tree_unflatten(treedef, out))


def _init(shapes, seed: int):
    """LeCun-normal kernels (fan-in: every axis but the last) and zero biases, drawn with numpy from the
    shapes alone (``jax.eval_shape`` of the model's init): building the zoo compiles nothing."""
    rng = np.random.default_rng(seed)

    def draw(s):
        if len(s.shape) < 2:
            return np.zeros(s.shape)
        return rng.standard_normal(s.shape) / np.sqrt(np.prod(s.shape[:-1]))

    return jax.tree_util.tree_map(draw, shapes)


def _normal(*shape):
    return lambda key, b: jax.random.normal(key, (b, *shape), jnp.float64)


def _gains(case: Case, *names: str) -> Case:
    """The case with its per-unit scales ``names`` drawn around 1 (`_alive` makes every vector a small bias: gains
    that small leave the next ReLU units nearly always off or on, extra symmetries that spoil the rank check)."""
    rng = np.random.default_rng(7)

    params = {k: (1.0 + 0.3 * rng.standard_normal(np.shape(v)) if k in names else v) for k, v in case.params.items()}
    return dataclasses.replace(case, params=_f64(params))


def _linen(name, module, draw, hidden, pinned=0, recurrent=False, extra_symmetries=0, seed=0, flax_init=False) -> Case:
    if flax_init:  # the model's own initialisers, run eagerly (compiles its init ops: a few seconds)
        params = _alive(_f64(module.init(jax.random.key(seed), draw(jax.random.key(123), 2))["params"]), with_jax=True)
    else:
        x = jax.eval_shape(lambda: draw(jax.random.key(123), 2))
        params = _alive(_init(jax.eval_shape(module.init, jax.random.key(seed), x)["params"], seed))
    return Case(
        name, lambda p, x: module.apply({"params": p}, x), params, draw, hidden, pinned, recurrent, extra_symmetries
    )


# ---------------------------------------------------------------------------- linen models


class MLP(nn.Module):
    widths: tuple[int, ...] = (7, 6)
    out: int = 3

    @nn.compact
    def __call__(self, x):
        for w in self.widths:
            x = nn.relu(nn.Dense(w)(x))
        return nn.Dense(self.out)(x)


class LeakyNoBias(nn.Module):
    """Dense without biases, leaky ReLU, identity on the output."""

    @nn.compact
    def __call__(self, x):
        x = nn.leaky_relu(nn.Dense(6, use_bias=False)(x), 0.1)
        x = jax.nn.relu(nn.Dense(5, use_bias=False)(x))
        return nn.Dense(1, use_bias=False)(x)[:, 0]  # a single output, squeezed


class CNN1D(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(4, (3,), strides=2, padding="SAME", kernel_dilation=2)(x))
        x = nn.avg_pool(x, (2,), (2,))
        x = nn.relu(nn.Conv(3, (2,), padding="VALID")(x))
        return nn.Dense(2)(x.reshape(x.shape[0], -1))


class CNN2D(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(3, (3, 3), strides=(2, 2), padding=((1, 0), (0, 1)))(x))
        x = nn.max_pool(x, (2, 2), (1, 1))
        x = nn.relu(nn.Conv(4, (2, 2), padding="SAME")(x))
        x = nn.avg_pool(x, (2, 2), (2, 2))
        return nn.Dense(3)(x.reshape(x.shape[0], -1))


class ResCNN(nn.Module):
    """A residual CNN: stem, one residual block, global average pooling, readout."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(4, (3, 3), padding="SAME")(x))
        h = nn.relu(nn.Conv(3, (3, 3), padding="SAME")(x))
        x = nn.relu(x + nn.Conv(4, (3, 3), padding="SAME")(h))
        return nn.Dense(2)(x.mean(axis=(1, 2)))


class SeparableCNN(nn.Module):
    """MobileNet's blocks: a depthwise convolution (one 3×3 filter per channel), a grouped pointwise one (two
    groups of two channels each), global average pooling."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(4, (3, 3), padding="SAME")(x))
        x = nn.relu(nn.Conv(4, (3, 3), padding="SAME", feature_group_count=4)(x))
        x = nn.relu(nn.Conv(4, (1, 1), feature_group_count=2)(x))
        return nn.Dense(2)(x.mean(axis=(1, 2)))


class LocalCNN(nn.Module):
    """A locally connected layer (`nn.ConvLocal`: a kernel per output position, applied to the patches that
    ``lax.conv_general_dilated_patches`` extracts with a constant one-hot kernel) between a convolution and a
    Dense readout of every position. Its kernel and bias at position p reach output channel f at p alone, and
    the readout reads each (p, f) with weights of its own: its nodes are (position, channel), 2 × 2 × 2 of
    them, where a convolution's would be its 2 channels. H = 3 + 8."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(3, (3, 3), padding="VALID")(x))
        x = nn.relu(nn.ConvLocal(2, (2, 2), padding="VALID")(x))
        return nn.Dense(2)(x.reshape(x.shape[0], -1))


class LayerScaleMLP(nn.Module):
    """Learned per-unit scales on two Dense layers' outputs (CaiT's and ConvNeXt's LayerScale; a residual one is in
    `test_trace`): each is a diagonal edge from the Dense's nodes (linear: no ReLU between) into nodes of its
    own. H = (4 + 4) + 3 + (4 + 4)."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(4)(x) * self.param("gain", nn.initializers.ones, (4,)))
        h = nn.relu(nn.Dense(3)(x))
        x = nn.relu(nn.Dense(4)(h) * self.param("layer_scale", nn.initializers.ones, (4,)))
        return nn.Dense(2)(x)


class MaxoutMLP(nn.Module):
    """A maxout layer written as a reshape and a maximum (``Dense(5 * 3)`` to ``(5, 3)``, the maximum over the last
    axis) on the inputs, then a ReLU layer: each maxout unit is one node whose 3 pieces rescale together (the
    kernel's pieces axis is shared by the unit, as positions are). H = 5 + 4. Beyond rescaling, one affine function of
    the inputs added to every piece of a unit shifts its output by it: a constant shift the next layer's bias takes
    up (5), a linear one where the next kernel's rows cancel the shifts (5 × 3 − 4 × 3 = 3). (After a ReLU layer, a
    piece that wins only where some of its inputs are 0 has weights the data never reaches: a rank deficit too.)"""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(5 * 3)(x).reshape(x.shape[0], 5, 3).max(-1)
        return nn.Dense(2)(nn.relu(nn.Dense(4)(x)))


class WeightNormNet(nn.Module):
    """``nn.WeightNorm`` on a convolution and on a Dense layer, each followed by a plain layer: the kernel g·v/‖v‖ is
    the fixed coefficients v/‖v‖ (new nodes, pinned: rescaling a unit that v reads changes its column norms), then
    g a per-unit scale, an edge into units of their own that g, the bias and the next layer's kernel rescale. H =
    3 + 5; pinned: v/‖v‖'s two outputs and the plain convolution's channels, which the weight-normalised Dense reads.
    Beyond rescaling, v/‖v‖ is invariant to scaling each of v's columns (3 + 5), and a channel that v reads can be
    rescaled with v's rows where g takes up the change in v's column norms (4): a symmetry, but no node-wise
    rescaling (g's factor depends on v), 12 in all."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.WeightNorm(nn.Conv(3, (2, 2)))(x))
        x = nn.relu(nn.Conv(4, (2, 2), padding="VALID")(x))
        x = nn.relu(nn.WeightNorm(nn.Dense(5))(x.reshape(x.shape[0], -1)))
        return nn.Dense(2)(x)


def _weight_norm(torch: bool = False) -> Case:
    """`WeightNormNet` (or `TorchWeightNormNet`) with its gains g drawn around 1 (as `_gains` draws per-unit
    scales)."""
    name, net = (
        ("weight_norm_conv_dense", WeightNormNet()) if not torch else ("weight_norm_torch_order", TorchWeightNormNet())
    )
    case = _linen(name, net, _normal(4, 4, 1), hidden=8, pinned=3, extra_symmetries=12, seed=int(torch))
    rng = np.random.default_rng(7)
    gain = (lambda n: n == "weight_g") if torch else (lambda n: True)
    params = {k: {n: 1.0 + 0.3 * rng.standard_normal(np.shape(g)) if gain(n) else g for n, g in v.items()}
              if k.startswith("Weight") or k.startswith("TorchWeight") else v
              for k, v in case.params.items()}  # fmt: skip
    return dataclasses.replace(case, params=_f64(params))


class TorchWeightNormed(nn.Module):
    """A layer as a port of PyTorch's ``torch.nn.utils.weight_norm`` writes it: parameters ``weight_v`` and
    ``weight_g`` (one per output unit), the kernel ``v * (g / ‖v‖)``, ‖v‖ over every axis but the output's."""

    features: int
    window: tuple[int, ...] | None = None  # a convolution's (SAME, stride 1), else a Dense layer

    @nn.compact
    def __call__(self, x):
        shape = (*(self.window or ()), x.shape[-1], self.features)
        v = self.param("weight_v", nn.initializers.lecun_normal(), shape)
        g = self.param("weight_g", nn.initializers.ones, (self.features,))
        kernel = v * (g / jnp.sqrt(jnp.sum(v * v, axis=tuple(range(v.ndim - 1)))))
        if self.window is None:
            y = x @ kernel
        else:
            y = jax.lax.conv_general_dilated(x, kernel, (1,) * len(self.window), "SAME",
                                             dimension_numbers=("NHWC", "HWIO", "NHWC"))  # fmt: skip
        return y + self.param("bias", nn.initializers.zeros, (self.features,))


class TorchWeightNormNet(nn.Module):
    """`WeightNormNet` as a port of a PyTorch model writes it (`TorchWeightNormed`): the same structure (H = 3 + 5,
    3 pinned groups, 12 symmetries beyond rescaling), where g was "other" and its units pinned (H 0)."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(TorchWeightNormed(3, (2, 2))(x))
        x = nn.relu(nn.Conv(4, (2, 2), padding="VALID")(x))
        x = nn.relu(TorchWeightNormed(5)(x.reshape(x.shape[0], -1)))
        return nn.Dense(2)(x)


class SharedReadout(nn.Module):
    """A first layer whose kernel writes two axes, read by a second layer along one of them with weights shared
    along the other: ``nn.DenseGeneral((2, 4))`` then ``nn.Dense`` on the last axis (``members=False``), or three
    ``nn.vmap``'d members (one kernel and bias each, the input shared) then one head for all (``members=True``).
    The nodes are shared along the first axis, as the second layer's weights are: a position, H = 4 (it pinned all
    8 or 12 units: the second layer read their group only in part)."""

    members: bool = False

    @nn.compact
    def __call__(self, x):
        if self.members:
            vmapped = nn.vmap(nn.Dense, variable_axes={"params": 0}, split_rngs={"params": True}, in_axes=None,
                              axis_size=3)  # fmt: skip
            h = nn.relu(vmapped(4)(x))  # [members, batch, 4]
            return nn.Dense(2)(h).sum(0)
        h = nn.relu(nn.DenseGeneral((2, 4))(x))  # [batch, 2, 4]
        return nn.Dense(2)(h).sum(1)


class PositionwiseHead(nn.Module):
    """``nn.Dense`` applied at every position of a ``(batch, 4, 3)`` input (its kernel shared along the positions),
    then a head over positions and units: the flattened ``4 × 6`` (``joint=False``) or ``nn.DenseGeneral`` over both
    axes. The input's position axis is a position, as an image's rows are for a convolution: the 6 units rescale
    alike at every position and the head has an edge per position and unit, H = 6 (it pinned them all: the head
    read the units' group together with an input axis)."""

    joint: bool = False

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(6)(x))  # [batch, 4, 6]
        if self.joint:
            return nn.DenseGeneral(2, axis=(-2, -1))(h)
        return nn.Dense(2)(h.reshape(h.shape[0], -1))


class PReLUMLP(nn.Module):
    """Learned scalar coefficients: PReLU's negative slope (``where(z >= 0, z, slope * z)``) and a gain after a
    ReLU. Each multiplies every unit alike, so the units stay hidden and the scalars are not edges (kind
    "other"). H = 5 + 4; the gain and the next kernel trade a common factor: one symmetry beyond rescaling."""

    @nn.compact
    def __call__(self, x):
        x = nn.PReLU(param_dtype=jnp.float64)(nn.Dense(5)(x))
        x = nn.relu(nn.Dense(4)(x)) * self.param("gain", nn.initializers.ones, ())
        return nn.Dense(2)(x)


def _prelu_mlp() -> Case:
    case = _linen("prelu_mlp_scalar_gain", PReLUMLP(), _normal(3), hidden=9, extra_symmetries=1)
    params = {**case.params, "PReLU_0": {"negative_slope": 0.25}, "gain": 1.3}
    return dataclasses.replace(case, params=_f64(params))


class Mixer(nn.Module):
    """An MLP-Mixer block with ReLUs: token mixing (a Dense over the transposed tokens), a residual stream that
    begins with the input itself (so the token MLP's output nodes are the input's: edges into an input group),
    then channel mixing. One symmetry beyond rescaling: a constant added to the stream by the token MLP's output
    bias is taken back by the channel MLP's biases."""

    @nn.compact
    def __call__(self, x):  # x: [B, tokens 4, channels 3]
        y = nn.Dense(4)(nn.relu(nn.Dense(5)(jnp.swapaxes(x, 1, 2))))
        x = x + jnp.swapaxes(y, 1, 2)
        x = nn.relu(x + nn.Dense(3)(nn.relu(nn.Dense(6)(x))))
        return nn.Dense(2)(x.mean(1))


class RNNLast(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.RNN(nn.SimpleCell(5, activation_fn=nn.relu, param_dtype=jnp.float64))(x)
        return nn.Dense(2)(h[:, -1])


class StackedRNNEvery(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.RNN(nn.SimpleCell(4, activation_fn=nn.relu, param_dtype=jnp.float64))(x)
        h = nn.RNN(nn.SimpleCell(3, activation_fn=nn.relu, param_dtype=jnp.float64))(h)
        return nn.Dense(2)(h)  # a readout at every step


class UNetSkip(nn.Module):
    """A U-Net-style skip: a strided convolution's channels upsampled (nearest) and concatenated with the
    full-resolution ones before the next convolution, whose kernel then leaves two groups (3 + 4 channels)."""

    @nn.compact
    def __call__(self, x):
        h1 = nn.relu(nn.Conv(3, (3, 3))(x))
        h2 = nn.relu(nn.Conv(4, (3, 3), strides=2)(h1))
        up = jnp.repeat(jnp.repeat(h2, 2, axis=1), 2, axis=2)
        h3 = nn.relu(nn.Conv(3, (3, 3))(jnp.concatenate([h1, up], -1)))
        return nn.Dense(2)(h3.mean((1, 2)))


class _ScanLayer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return nn.relu(nn.Dense(5, param_dtype=x.dtype)(x)), None


class ScanStackedMLP(nn.Module):
    """ReLU layers stacked with ``nn.scan`` (their kernels one leaf, sliced along the scanned axis), with or
    without ``nn.remat``: a stack of distinct layers, 5 hidden units each, not a recurrence."""

    remat: bool = False
    length: int = 3

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(5)(x))
        layer = nn.remat(_ScanLayer) if self.remat else _ScanLayer
        stack = nn.scan(layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=self.length)
        x, _ = stack()(x, None)
        return nn.Dense(2)(x)


class TiedEmbedRNN(nn.Module):
    """Token ids -> embedding -> ReLU RNN -> ReLU dense -> the same embedding as the decoder (``attend``).

    The table is used with both axis roles (rows in, rows out), so it is no edge tensor and the embedding
    dimension is a pinned group (3 nodes). Its node-wise rescalings are still exact symmetries (E -> E D,
    the RNN's input kernel D⁻¹ W, the dense layer's kernel and bias times D⁻¹): 3 beyond H.
    """

    @nn.compact
    def __call__(self, ids):
        embed = nn.Embed(16, 3, param_dtype=jnp.float64)
        h = nn.RNN(nn.SimpleCell(4, activation_fn=nn.relu, param_dtype=jnp.float64))(embed(ids))
        return embed.attend(nn.relu(nn.Dense(3, param_dtype=jnp.float64)(h[:, -1])))


class EmbedRNN(nn.Module):
    """Token ids -> embedding -> ReLU RNN -> last step.

    Two linear maps in a row, the embedding rows E and the RNN's input kernel W
    (plus its bias b), have more symmetries than node-wise rescaling: E -> E A,
    W -> A⁻¹ W for any invertible A (d² - d beyond the diagonal rescalings), and
    E -> E + 1 cᵀ, b -> b - cᵀ W, since every input selects exactly one row (d
    more): d² = 9 in all for d = 3. The vocabulary (16) is large enough that the
    token vectors do not bottleneck the rank further.
    """

    @nn.compact
    def __call__(self, ids):
        e = nn.Embed(16, 3, param_dtype=jnp.float64)(ids)
        h = nn.RNN(nn.SimpleCell(4, activation_fn=nn.relu, param_dtype=jnp.float64))(e)
        return nn.Dense(2)(h[:, -1])


class TanhMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = jnp.tanh(nn.Dense(5)(x))  # pinned: tanh is not positively homogeneous
        x = nn.relu(nn.Dense(4)(x))
        return nn.Dense(2)(x)


class FusedLSTMHead(nn.Module):
    """Flax's fast LSTM (its gate kernels concatenated from parameters: fixed coefficients, not edges) read by a
    ReLU layer. The LSTM's state is a pinned group (sigmoid and tanh gates); the ReLU layer is 5 hidden nodes fed
    from it, not a bias (the last step's state is a slice of a concatenation)."""

    @nn.compact
    def __call__(self, x):
        h = nn.RNN(nn.OptimizedLSTMCell(4, param_dtype=x.dtype))(x)[:, -1]
        return nn.Dense(2)(nn.relu(nn.Dense(5)(h)))


class LayerNormMLP(nn.Module):
    """Dense -> LayerNorm -> ReLU -> Dense -> ReLU -> Dense.

    LayerNorm pins the 5 units it normalises. It subtracts their mean, so adding
    one vector v to every column of the kernel before it (z_j += vᵀx for all j)
    and one constant to every bias leaves the function unchanged exactly: 3 + 1
    symmetries beyond rescaling, which path space does not quotient out (the
    common scale of the group is a symmetry too, but eps breaks it). No scale or
    bias in the LayerNorm: those would add symmetries of their own.
    """

    @nn.compact
    def __call__(self, x):
        x = nn.LayerNorm(use_scale=False, use_bias=False)(nn.Dense(5)(x))
        x = nn.relu(nn.Dense(4)(nn.relu(x)))
        return nn.Dense(2)(x)


class NormScaleMLP(nn.Module):
    """Dense -> LayerNorm, or BatchNorm on the batch's statistics (``batch``), with its learned scale and offset ->
    ReLU -> Dense -> ReLU -> Dense. The normalisation pins the 5 units it normalises; its scale is an edge from
    each into a unit of its own (flax multiplies the scale into rsqrt(var + eps) first), which the scale, the
    offset and the next kernel's rows rescale: H = 5 + 4. Beyond rescaling, the LayerNorm has `LayerNormMLP`'s
    3 + 1 symmetries."""

    batch: bool = False
    running: bool = False  # BatchNorm with its running statistics

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(5)(x)
        h = nn.BatchNorm(use_running_average=self.running)(h) if self.batch else nn.LayerNorm()(h)
        return nn.Dense(2)(nn.relu(nn.Dense(4)(nn.relu(h))))


def norm_scale(batch: bool) -> Case:
    """`NormScaleMLP` with its scale drawn around 1, as `_gains` draws them; with ``batch``, a function of the batch
    (BatchNorm's statistics), not in the zoo: the rank check counts symmetries that hold per example."""
    module = NormScaleMLP(batch)
    case = _linen("layernorm_scale_offset_mlp", module, _normal(3), hidden=9, pinned=1, extra_symmetries=4)
    norm = "BatchNorm_0" if batch else "LayerNorm_0"
    scale = 1.0 + 0.3 * np.random.default_rng(7).standard_normal(5)
    params = _f64({**case.params, norm: {**case.params[norm], "scale": scale}})
    if not batch:
        return dataclasses.replace(case, params=params)
    stats = {norm: {"mean": np.zeros(5), "var": np.ones(5)}}  # not read: the batch's statistics are used

    def fn(p, x):
        return module.apply({"params": p, "batch_stats": stats}, x, mutable=["batch_stats"])[0]

    return dataclasses.replace(case, name="batchnorm_batch_statistics_mlp", fn=fn, params=params, extra_symmetries=0)


class GatedMLP(nn.Module):
    """A sigmoid gate on a linear branch (SwiGLU's form): the gate's 4 units are pinned, and the branch's are
    hidden (the gate a coefficient no rescaling changes): H = 5 + 4, and no other symmetry."""

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(5)(x))
        return nn.Dense(2)(nn.sigmoid(nn.Dense(4)(h)) * nn.Dense(4)(h))


class FusedGatedMLP(nn.Module):
    """`GatedMLP` with the gate and the branch computed by one Dense and cut by ``jnp.split`` (SwiGLU as written with
    one kernel): the same path space, the kernel's columns edges into the gate's pinned group and the branch's."""

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(5)(x))
        g, a = jnp.split(nn.Dense(8)(h), 2, axis=-1)
        return nn.Dense(2)(nn.sigmoid(g) * a)


class ConcatMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        a = nn.relu(nn.Dense(3)(x))
        b = nn.relu(nn.Dense(4)(x))
        return nn.Dense(2)(jnp.concatenate([a, b], axis=-1))


class Ensemble(nn.Module):
    """Three two-layer MLPs made by ``nn.vmap`` (one weight matrix per member, the input shared), averaged.

    Each member's hidden units are nodes of their own (3 × 4): the second layer's ``dot_general`` has the members
    as a batch axis. Only the sum of the members' output biases reaches the output: 2 × (3 - 1) symmetries
    beyond rescaling."""

    @nn.compact
    def __call__(self, x):
        members = nn.vmap(MLP, variable_axes={"params": 0}, split_rngs={"params": True}, in_axes=None, axis_size=3)
        return members(widths=(4,), out=2)(x).mean(0)


class SoftMoE(nn.Module):
    """A soft mixture of three experts (``nn.vmap``'d Dense layers on the shared hidden units) weighted by a softmax
    gate: the gate's 3 logits are pinned; the mixture sums the experts' units with the gate's weights, so unit d
    is one node shared by the experts (their axis a position, as for attention's keys), 6 + 4 hidden. Adding one
    vector to every column of the gate's kernel, or one number to every entry of its bias, shifts all logits alike
    and leaves the softmax unchanged: 6 + 1 symmetries beyond rescaling."""

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(6)(x))
        gate = jax.nn.softmax(nn.Dense(3)(h))
        experts = nn.vmap(nn.Dense, variable_axes={"params": 0}, split_rngs={"params": True}, in_axes=None,
                          out_axes=1, axis_size=3)  # fmt: skip
        e = nn.relu(experts(4)(h))  # (batch, expert, unit)
        return nn.Dense(2)(jnp.einsum("be,bed->bd", gate, e))


# ---------------------------------------------------------------------------- nnx models


class NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(4, 6, rngs=rngs)
        self.l2 = nnx.Linear(6, 5, rngs=rngs)
        self.l3 = nnx.Linear(5, 2, rngs=rngs)

    def __call__(self, x):
        return self.l3(nnx.relu(self.l2(nnx.relu(self.l1(x)))))


class NnxRNN(nnx.Module):
    def __init__(self, rngs):
        cell = nnx.SimpleCell(3, 4, rngs=rngs, activation_fn=nnx.relu, param_dtype=jnp.float64, dtype=jnp.float64)
        self.rnn = nnx.RNN(cell)
        self.out = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        h = self.rnn(x, initial_carry=jnp.zeros((x.shape[0], 4), x.dtype))
        return self.out(h[:, -1])


def _nnx(name, module, draw, hidden, recurrent=False) -> Case:
    graphdef, state, rest = nnx.split(module, nnx.Param, ...)
    state = _alive(state)
    return Case(name, lambda s, x: nnx.merge(graphdef, s, rest)(x), state, draw, hidden, 0, recurrent)


def _scan_stacked(name: str, module: ScanStackedMLP) -> Case:
    """`ScanStackedMLP` on 8 inputs with each layer's slice drawn as its own generic Dense (`_alive` per layer: over
    a stacked leaf it would centre the layers together and leave dead units), stacked along the scanned axis. The
    seeds give a Jacobian of full rank m - H: a deep narrow ReLU network can have a smaller functional dimension
    (Grigsby, Lindsey, Meyerhoff, Wu, "Functional dimension of feedforward ReLU neural networks", 2022), as this
    one has on 3 inputs or with other draws."""
    x = jax.eval_shape(lambda: _normal(8)(jax.random.key(0), 2))
    shapes = jax.eval_shape(module.init, jax.random.key(0), x)["params"]
    stack = next(k for k in shapes if k.startswith("Scan"))
    one = jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype), shapes[stack])
    layers = [_alive(_init(one, seed)) for seed in (130, 131, 132)]
    params = _alive(_init({k: v for k, v in shapes.items() if k != stack}, 7))
    params[stack] = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *layers)
    return Case(name, lambda p, x: module.apply({"params": p}, x), params, _normal(8), hidden=20)


def _stacked_loop() -> Case:
    """`ScanStackedMLP`'s params applied by plain JAX code in a Python loop over the stacked leaves (``for w, b in
    zip(ws, bs)``: a static slice of each layer): each layer its own edge bundle, as under ``nn.scan``."""
    case = _scan_stacked("plain_stacked_loop_mlp", ScanStackedMLP())
    stack = next(k for k in case.params if k.startswith("Scan"))

    def fn(p, x):
        x = jax.nn.relu(x @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"])
        for w, b in zip(p[stack]["Dense_0"]["kernel"], p[stack]["Dense_0"]["bias"], strict=True):
            x = jax.nn.relu(x @ w + b)
        return x @ p["Dense_1"]["kernel"] + p["Dense_1"]["bias"]

    return dataclasses.replace(case, fn=fn)


# ---------------------------------------------------------------------------- plain JAX


def _plain_transpose_slice() -> Case:
    """Per-time-step Dense written with einsum, a transpose, and the last step sliced."""
    rng = np.random.default_rng(5)
    params = {"w1": rng.standard_normal((3, 4)), "b1": rng.standard_normal(4), "w2": rng.standard_normal((4, 2))}
    params = _alive(params)

    def fn(p, x):  # x: [B, T, 3]
        h = jnp.maximum(jnp.einsum("btf,fh->bth", x, p["w1"]) + p["b1"], 0.0)
        h = jnp.transpose(h, (0, 2, 1))  # [B, H, T]
        return h[:, :, -1] @ p["w2"]

    return Case("plain_transpose_slice", fn, params, _normal(5, 3), hidden=4)


def _plain_multihead_einsum() -> Case:
    """A multi-head layer written as one einsum (heads 3 × width 5 = 15 hidden nodes over two array axes), reshaped
    to one axis before the next layer, with a learned per-position bias (one per step and node) on a second
    ReLU layer: both are plain positively homogeneous layers."""
    rng = np.random.default_rng(6)
    params = {"w": rng.standard_normal((3, 4, 5)), "b": rng.standard_normal((3, 5)), "w2": rng.standard_normal((15, 6)),
              "pos": rng.standard_normal((4, 6)), "w3": rng.standard_normal((6, 2))}  # fmt: skip
    params = _alive(params)

    def fn(p, x):  # x: [B, T, 4]
        h = jax.nn.relu(jnp.einsum("bti,hio->btho", x, p["w"]) + p["b"])
        h = jax.nn.relu(h.reshape(*h.shape[:2], 15) @ p["w2"] + p["pos"][None])
        return h.sum(1) @ p["w3"]  # every step (and so every row of pos) reaches the output

    return Case("plain_multihead_einsum_position_bias", fn, params, _normal(4, 4), hidden=21)


def _plain_experts() -> Case:
    """Experts written with einsum: an expert axis that the first layer creates, the second keeps (one matrix per
    expert: its nodes are (expert, unit), 2 × 3 + 2 × 3) and the last contracts with the units (a learned mix)."""
    rng = np.random.default_rng(14)  # a seed whose units are each on for 34-68 % of the inputs
    params = _alive({"w1": rng.standard_normal((2, 4, 3)), "w2": rng.standard_normal((2, 3, 3)),
                     "w3": rng.standard_normal((2, 3, 2))})  # fmt: skip
    params |= _f64({"b1": 0.05 * rng.standard_normal((2, 3)), "b2": 0.05 * rng.standard_normal((2, 3))})  # as _alive's

    def fn(p, x):  # x: [B, 4]
        h = jax.nn.relu(jnp.einsum("bi,eij->ebj", x, p["w1"]) + p["b1"][:, None])
        h = jax.nn.relu(jnp.einsum("ebj,ejk->ebk", h, p["w2"]) + p["b2"][:, None])
        return jnp.einsum("ebk,ekm->bm", h, p["w3"])

    return Case("plain_experts_einsum", fn, params, _normal(4), hidden=12)


def _plain_graph(aggregate: str = "sum") -> Case:
    """A graph network on a fixed five-node graph: each layer gathers the senders' features, aggregates the messages
    into their receivers, summed (a scatter-add, as ``jax.ops.segment_sum``) or their largest (``jax.ops.segment_max``,
    a scatter-max into −∞: positively homogeneous, as max pooling is; every graph node receives a message), and adds
    the node's own term; the graph's nodes are positions, the features nodes (6 + 4)."""
    senders, receivers = np.array([0, 1, 2, 3, 4, 0, 2]), np.array([1, 2, 3, 4, 0, 3, 4])
    rng = np.random.default_rng(0 if aggregate == "sum" else 1)

    def layer(n_in, n_out):
        w_msg, w_self = rng.standard_normal((n_in, n_out)), rng.standard_normal((n_in, n_out))
        return {"w_msg": w_msg, "b_msg": 0.3 * rng.standard_normal(n_out), "w_self": w_self}

    params = _f64([layer(3, 6), layer(6, 4), {"w": rng.standard_normal((4, 2)), "b": 0.3 * rng.standard_normal(2)}])

    def aggregated(msg, x):
        if aggregate == "sum":
            return jnp.zeros((*x.shape[:2], msg.shape[-1])).at[:, receivers].add(msg)
        return jax.vmap(lambda m: jax.ops.segment_max(m, receivers, num_segments=5))(msg)

    def fn(p, x):  # x: [B, graph nodes 5, features 3]
        for layer in p[:-1]:
            msg = x[:, senders] @ layer["w_msg"] + layer["b_msg"]
            x = jax.nn.relu(aggregated(msg, x) + x @ layer["w_self"])
        return x.sum(1) @ p[-1]["w"] + p[-1]["b"]

    name = "plain_graph_scatter_add" if aggregate == "sum" else "plain_graph_segment_max"
    return Case(name, fn, params, _normal(5, 3), hidden=10)


@jax.custom_vjp
def _my_relu(x):
    return jnp.maximum(x, 0.0)


_my_relu.defvjp(lambda x: (_my_relu(x), x), lambda x, g: (g * (x > 0),))


def _plain_nested() -> Case:
    """jit, checkpoint (remat) and custom_vjp around parts of the network."""
    rng = np.random.default_rng(6)
    params = [
        {"w": rng.standard_normal((4, 5)), "b": rng.standard_normal(5)},
        {"w": rng.standard_normal((5, 3)), "b": rng.standard_normal(3)},
        {"w": rng.standard_normal((3, 2))},
    ]
    params = _alive(params)

    @jax.jit
    def layer(p, x):
        return x @ p["w"] + p["b"]

    @jax.checkpoint
    def block(p, x):
        return _my_relu(layer(p, x))

    def fn(ps, x):
        x = jax.nn.relu(layer(ps[0], x))
        x = block(ps[1], x)
        return x @ ps[2]["w"]

    return Case("plain_nested_jit_remat_custom_vjp", fn, params, _normal(4), hidden=8)


def _build() -> dict[str, Case]:
    cases = [
        _linen("mlp", MLP(), _normal(4), hidden=13, seed=1),
        _linen("leaky_nobias_single_output", LeakyNoBias(), _normal(4), hidden=11),
        _linen("cnn1d_stride_dilation_avgpool", CNN1D(), _normal(12, 2), hidden=7),
        _linen("cnn2d_stride_padding_maxpool", CNN2D(), _normal(8, 8, 1), hidden=7),
        _linen("residual_cnn", ResCNN(), _normal(5, 5, 2), hidden=7),
        _linen("separable_cnn_depthwise_grouped", SeparableCNN(), _normal(5, 5, 2), hidden=12),
        _linen("local_cnn_convlocal", LocalCNN(), _normal(5, 5, 1), hidden=11),
        _gains(_linen("layer_scale_mlp", LayerScaleMLP(), _normal(3), hidden=19, seed=1), "gain", "layer_scale"),
        _prelu_mlp(),
        _weight_norm(),
        _weight_norm(torch=True),
        _linen("maxout_reshape_mlp", MaxoutMLP(), _normal(3), hidden=9, extra_symmetries=8),
        _linen("dense_general_shared_readout", SharedReadout(), _normal(3), hidden=4),
        _linen("vmap_members_shared_head", SharedReadout(members=True), _normal(3), hidden=4),
        _linen("positionwise_dense_flatten_head", PositionwiseHead(), _normal(4, 3), hidden=6),
        _linen("positionwise_dense_joint_head", PositionwiseHead(joint=True), _normal(4, 3), hidden=6),
        _linen("mixer_input_residual_stream", Mixer(), _normal(4, 3), hidden=11, extra_symmetries=1),
        _linen("rnn_last_step", RNNLast(), _normal(6, 3), hidden=5, recurrent=True),
        _linen("stacked_rnn_every_step", StackedRNNEvery(), _normal(5, 2), hidden=7, recurrent=True),
        _linen(
            "embedding_rnn",
            EmbedRNN(),
            lambda key, b: jax.random.randint(key, (b, 5), 0, 16),
            hidden=7,
            recurrent=True,
            extra_symmetries=9,
            flax_init=True,  # its rank check needs the original values (numpy draws leave a degenerate unit)
        ),
        _linen(
            "tied_embedding_rnn",
            TiedEmbedRNN(),
            lambda key, b: jax.random.randint(key, (b, 5), 0, 16),
            hidden=4,
            pinned=1,
            recurrent=True,
            extra_symmetries=3,
        ),
        _linen("tanh_mlp_partly_pinned", TanhMLP(), _normal(3), hidden=4, pinned=1),
        _linen("layernorm_mlp_partly_pinned", LayerNormMLP(), _normal(3), hidden=4, pinned=1, extra_symmetries=4),
        norm_scale(batch=False),
        _linen("sigmoid_gated_mlp", GatedMLP(), _normal(3), hidden=9, pinned=1),
        _linen("fused_gated_mlp_split", FusedGatedMLP(), _normal(3), hidden=9, pinned=1),
        _linen("concat_mlp", ConcatMLP(), _normal(3), hidden=7),
        _linen("fused_lstm_relu_head", FusedLSTMHead(), _normal(3, 2), hidden=5, pinned=1),
        _linen("unet_concat_skip", UNetSkip(), _normal(6, 6, 1), hidden=10),
        _scan_stacked("scan_stacked_mlp", ScanStackedMLP()),
        _scan_stacked("scan_stacked_mlp_remat", ScanStackedMLP(remat=True)),
        _stacked_loop(),
        _nnx("nnx_mlp", NnxMLP(nnx.Rngs(0)), _normal(4), hidden=11),
        _nnx("nnx_rnn", NnxRNN(nnx.Rngs(1)), _normal(4, 3), hidden=4, recurrent=True),
        _plain_transpose_slice(),
        _plain_multihead_einsum(),
        _plain_nested(),
        _linen("vmap_ensemble_mean", Ensemble(), _normal(4), hidden=12, extra_symmetries=4),
        _linen(
            "soft_mixture_of_experts", SoftMoE(), _normal(3), hidden=10, pinned=1, extra_symmetries=7, flax_init=True
        ),
        _plain_experts(),
        _plain_graph(),
        _plain_graph("max"),
    ]
    return {c.name: c for c in cases}


ZOO: dict[str, Case] = _build()


class Spaces(dict):
    """The zoo's spaces, traced on first use (a test run that needs three cases traces three)."""

    def __missing__(self, name: str):
        case = ZOO[name]
        space = self[name] = pj.trace(case.fn, case.params, case.inputs(2))
        return space
