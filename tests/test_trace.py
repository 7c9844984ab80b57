"""trace, PathSpace, rescale, describe and the testing helpers, on the model zoo."""

import functools
import pickle
import subprocess
import sys
import textwrap
import warnings

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.extend.core import Primitive
from jax.flatten_util import ravel_pytree
from jax.interpreters import ad, mlir
from zoo import ZOO, NormScaleMLP, Spaces, norm_scale

import pathspace_jax as pj
from pathspace_jax import rules
from pathspace_jax.graph import reduced
from pathspace_jax.rescale import node_vector

CASES = list(ZOO.values())
IDS = [c.name for c in CASES]


@pytest.fixture(scope="module")
def spaces():
    return Spaces()


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_counts_by_hand(case, spaces):
    space = spaces[case.name]
    assert space.num_params == sum(a.size for a in jax.tree_util.tree_leaves(case.params))
    assert space.num_hidden == case.hidden
    assert sum(g.kind == "pinned" for g in space.groups) == case.pinned
    assert space.num_coords == space.num_params - space.num_hidden
    assert any(leaf.recurrent for leaf in space.leaves) == case.recurrent


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_batch_of_one_traces_like_a_batch(case, spaces):
    """The examples' axis of size 1 shares its atom with every size-1 axis (a bias reshaped to broadcast): traced on
    one example, the model has the same groups and edges as on several (a rule that made the examples' axis a
    position at batch 1 once made every RNN example refused as "time-major")."""
    one = pj.trace(case.fn, case.params, case.inputs(1))
    many = spaces[case.name]
    assert [(g.size, g.kind) for g in one.groups] == [(g.size, g.kind) for g in many.groups]
    for a, b in zip(one.leaves, many.leaves, strict=True):
        assert (a.path, a.kind, a.src_groups, a.dst_groups) == (b.path, b.kind, b.src_groups, b.dst_groups)
        np.testing.assert_array_equal(a.src, b.src, err_msg=a.path)
        np.testing.assert_array_equal(a.dst, b.dst, err_msg=a.path)
    assert one.positions_first == many.positions_first


def _jacobian(fn, flat, x):
    # forward mode where it is cheaper, on CPU only: JAX's JVP of a float64 max-pool runs at float32 precision on
    # GPU (its pair-reduction workaround), which adds spurious singular values
    forward = flat.size < 4 * 10**3 and jax.default_backend() == "cpu"
    try:
        return jax.jit(jax.jacfwd(fn) if forward else jax.jacrev(fn))(flat)
    except TypeError:  # custom_vjp functions have no forward mode
        return jax.jit(jax.jacrev(fn))(flat)


@pytest.mark.optimised
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_num_coords_is_jacobian_rank(case, spaces):
    """The independent check: m - H is the rank of d f(x) / d w over many inputs (float64)."""
    space = spaces[case.name]
    flat, unravel = ravel_pytree(case.params)
    assert flat.dtype == jnp.float64
    n_out = int(np.prod(case.fn(case.params, case.inputs(1)).shape))
    x = case.inputs(max(600, 6 * flat.size // n_out), seed=7)
    jac = np.asarray(_jacobian(lambda f: case.fn(unravel(f), x).ravel(), flat, x))
    sv = np.linalg.svd(jac, compute_uv=False)
    rank = int((sv > sv[0] * 1e-9).sum())
    assert rank == space.num_coords - case.extra_symmetries


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_random_rescale_keeps_function_changes_params(case, spaces):
    space = spaces[case.name]
    x = case.inputs(5, seed=3)
    scaled = pj.random_rescale(space, case.params, jax.random.key(4))
    chex.assert_trees_all_equal_shapes_and_dtypes(scaled, case.params)
    chex.assert_trees_all_close(case.fn(scaled, x), case.fn(case.params, x), rtol=1e-12, atol=1e-12)
    changed = [
        not np.array_equal(a, b)
        for a, b in zip(jax.tree_util.tree_leaves(scaled), jax.tree_util.tree_leaves(case.params))
    ]
    assert any(changed)
    pj.testing.assert_function_invariant(case.fn, space, case.params, x)


def test_rescale_moves_each_edge_by_the_ratio_of_its_end_factors():
    case = ZOO["rnn_last_step"]
    space = pj.trace(case.fn, case.params, case.inputs(2))
    alphas = pj.random_alphas(space, jax.random.key(0))
    node = np.asarray(node_vector(space, alphas))
    scaled = pj.rescale(space, case.params, alphas)
    for spec, w, w2 in zip(space.leaves, jax.tree_util.tree_leaves(case.params), jax.tree_util.tree_leaves(scaled)):
        np.testing.assert_array_equal(np.asarray(w2), np.asarray(w) * node[spec.dst] / node[spec.src])
    # the recurrent kernel's edges stay inside one group: entry (i, j) scales by a_j / a_i
    (g,) = [i for i in space.hidden_groups]
    a = np.asarray(alphas[0])
    k = case.params["SimpleCell_0"]["h"]["kernel"]
    k2 = scaled["SimpleCell_0"]["h"]["kernel"]
    np.testing.assert_array_equal(np.asarray(k2), np.asarray(k) * a[None, :] / a[:, None])
    assert space.groups[g].size == 5


def test_rescale_by_identity_and_inverse():
    case = ZOO["residual_cnn"]
    space = pj.trace(case.fn, case.params, case.inputs(2))
    alphas = pj.random_alphas(space, jax.random.key(1))
    back = pj.rescale(space, pj.rescale(space, case.params, alphas), [1.0 / a for a in alphas])
    chex.assert_trees_all_equal(back, case.params)
    ones = [jnp.ones_like(a) for a in alphas]
    chex.assert_trees_all_equal(pj.rescale(space, case.params, ones), case.params)


@pytest.mark.slow
def test_rescale_jits_and_vmaps():
    case = ZOO["mlp"]
    space = pj.trace(case.fn, case.params, case.inputs(2))
    keys = jax.random.split(jax.random.key(0), 3)
    batched = jax.vmap(lambda k: pj.random_rescale(space, case.params, k))(keys)
    one = jax.jit(lambda k: pj.random_rescale(space, case.params, k))(keys[1])
    chex.assert_trees_all_close(jax.tree_util.tree_map(lambda a: a[1], batched), one)


@pytest.mark.parametrize("taps_per_output, pins", [(1, False), (2, True)])
def test_a_constant_convolution_kernel_is_a_relabelling_only_where_it_selects(taps_per_output, pins):
    """A grouped convolution with a constant kernel whose every output feature reads one tap of its channel
    (``lax.conv_general_dilated_patches``, inside ``nn.ConvLocal``) passes the channel's nodes on; one that adds two
    taps with fixed coefficients (a blur) pins the channels it reads, since a node's rescaling cannot move them."""
    kernel = np.zeros((2, 2, 1, 8))  # HWIO, 2 channels × 4 output features each
    for o in range(8):
        for t in range(taps_per_output):
            kernel[(o + t) % 4 // 2, (o + t) % 2, 0, o] = 1.0

    def fn(p, x):
        h = jax.nn.relu(x @ p["w1"] + p["b1"])  # [B, 3, 3, 2]: the 2 channels are nodes
        dn = ("NHWC", "HWIO", "NHWC")
        y = jax.lax.conv_general_dilated(h, jnp.asarray(kernel), (1, 1), "VALID", dimension_numbers=dn,
                                         feature_group_count=2)  # fmt: skip
        return jnp.einsum("bhwc,hwcd->bd", y, p["w2"])

    rng = np.random.default_rng(0)
    params = {"w1": rng.standard_normal((1, 2)), "b1": rng.standard_normal(2), "w2": rng.standard_normal((2, 2, 8, 3))}
    space = pj.trace(fn, params, rng.standard_normal((2, 3, 3, 1)))
    assert any(g.kind == "pinned" for g in space.groups) == pins
    assert space.num_hidden == (0 if pins else 2)
    if not pins:
        chex.assert_trees_all_close(
            pj.path_kappa(space, params, second_order=False),
            jax.grad(lambda q: jnp.sum(fn(q, np.ones((1, 3, 3, 1)))))(jax.tree.map(np.square, params)),
            rtol=1e-6,
        )


def test_a_learned_per_unit_scale_is_a_diagonal_edge():
    """LayerScale on a residual branch (ConvNeXt, CaiT): ``x + γ ⊙ branch(x)``. γ is an edge from the branch's
    Dense outputs (linear nodes of their own) into the stream's nodes, which the sum ties to the first layer's:
    H = 4 + 3 + 4, every rescaling a symmetry, κ⁽¹⁾ that of the squared network. (A normalisation's scale: the
    next test.)"""

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Dense(4)(x))
            branch = nn.Dense(4)(nn.relu(nn.Dense(3)(x)))
            x = nn.relu(x + branch * self.param("layer_scale", nn.initializers.constant(0.5), (4,)))
            return nn.Dense(2)(x)

    model = Block()
    x = jax.random.normal(jax.random.key(0), (6, 3), jnp.float64)
    params = jax.tree.map(lambda a: a.astype(jnp.float64) + 0.1, model.init(jax.random.key(1), x)["params"])
    fn = lambda p, x: model.apply({"params": p}, x)  # noqa: E731
    space = pj.trace(fn, params, x)
    assert space.num_hidden == 4 + 3 + 4
    pj.testing.assert_function_invariant(fn, space, params, x)
    squared = jax.tree.map(jnp.square, params)
    ref = jax.grad(lambda q: jnp.sum(fn(q, jnp.ones((1, 3)))))(squared)  # κ⁽¹⁾ = ∂γ²/∂p̃ on the all-ones input
    chex.assert_trees_all_close(pj.path_kappa(space, params, second_order=False), ref, rtol=1e-10)


def test_a_normalisation_scale_is_an_edge_into_units_of_its_own():
    """``γ ⊙ x̂ + β``: the normalised x̂ is pinned, and the units after the scale are rescaled by γ, β and the rows of
    the next kernel: γ is an edge from x̂'s group into a hidden group of its own. Flax's LayerNorm and BatchNorm on
    the batch's statistics multiply γ into rsqrt(var + eps) before the centred value (the trace reassociates the
    product), a hand-written LayerNorm after it: H = 5 + 4 (by hand: 5, one layer after it), where the scale was
    "other" and its units pinned. Where that product is read twice, or BatchNorm divides by its running
    statistics, γ stays "other"."""
    ln, bn = norm_scale(batch=False), norm_scale(batch=True)
    x = ln.inputs(6)
    rng = np.random.default_rng(1)
    p = {"w": rng.standard_normal((3, 5)), "g": 1 + 0.3 * rng.standard_normal(5), "b": rng.standard_normal(5),
         "o": rng.standard_normal((5, 2))}  # fmt: skip

    def by_hand(p, x, read_twice=False):
        z = x @ p["w"]
        centred, inv = z - z.mean(-1, keepdims=True), jax.lax.rsqrt(z.var(-1, keepdims=True) + 1e-6)
        if not read_twice:
            return jax.nn.relu(centred * inv * p["g"] + p["b"]) @ p["o"]
        scale = inv * p["g"]  # multiplied into the deviation first (as flax does), and read by two products
        return jax.nn.relu(centred * scale + p["b"]) @ p["o"] + jax.nn.relu(z * scale) @ p["o2"]

    for fn, params, norm in ((ln.fn, ln.params, "LayerNorm_0"), (bn.fn, bn.params, "BatchNorm_0"), (by_hand, p, "")):
        space = pj.trace(fn, params, x)
        assert space.num_hidden == (5 if fn is by_hand else 5 + 4)
        (scale,) = [leaf for leaf in space.leaves if leaf.path in (f"{norm}/scale", "g")]
        (src,), (dst,) = scale.src_groups, scale.dst_groups
        assert (space.groups[src].kind, space.groups[dst].kind, space.groups[dst].size) == ("pinned", "hidden", 5)
        pj.testing.assert_function_invariant(fn, space, params, x)
    twice, p = functools.partial(by_hand, read_twice=True), {**p, "o2": rng.standard_normal((5, 2))}
    space = pj.trace(twice, p, x)
    assert [leaf.kind for leaf in space.leaves if leaf.path == "g"] == ["other"] and space.num_hidden == 0
    model = NormScaleMLP(batch=True, running=True)
    variables = model.init(jax.random.key(0), x)
    space = pj.trace(lambda q, x: model.apply({**variables, "params": q}, x), variables["params"], x)
    assert [leaf.kind for leaf in space.leaves if leaf.path == "BatchNorm_0/scale"] == ["other"]


class _WeightNormed(nn.Module):
    """A Dense layer whose kernel is v/‖v‖ times a gain g, then two ReLU layers: ``nn.WeightNorm`` (g one entry per
    output unit, ``how="units"``, also computed in float32, ``"units_cast"``; one for the whole kernel, ``"whole"``),
    or written by hand with g one per input
    row (``"rows"``), or per output unit with the kernel read by two products (``"twice"``)."""

    how: str

    @nn.compact
    def __call__(self, x):
        if self.how in ("units", "whole", "units_cast"):
            dense = nn.Dense(5, param_dtype=jnp.float64, dtype=jnp.float32 if self.how == "units_cast" else None)
            h = nn.relu(nn.WeightNorm(dense, feature_axes=None if self.how == "whole" else -1)(x))
        else:
            v = self.param("v", nn.initializers.lecun_normal(), (3, 5), jnp.float64)
            g = self.param("g", nn.initializers.constant(1.5), (3, 1) if self.how == "rows" else (5,), jnp.float64)
            k, b = v / jnp.linalg.norm(v, axis=0) * g, self.param("b", nn.initializers.normal(0.1), (5,), jnp.float64)
            h = nn.relu(x @ k + b) + (nn.relu(x[:, ::-1] @ k) if self.how == "twice" else 0.0)
        return nn.Dense(2, param_dtype=jnp.float64)(nn.relu(nn.Dense(4, param_dtype=jnp.float64)(h)))


@pytest.mark.parametrize(
    "how, hidden", [("units", 5 + 4), ("units_cast", 5 + 4), ("whole", 4), ("rows", 4), ("twice", 4)]
)
def test_a_weight_normalised_kernel_is_fixed_coefficients_times_a_per_unit_gain(how, hidden):
    """``nn.WeightNorm``'s kernel v/‖v‖·g, g one entry per output unit multiplied in last (as Flax does), read by a
    ``dot_general`` is ``(x·v/‖v‖)·g``: g an edge from v/‖v‖'s (pinned) outputs into hidden units of their own, which
    g, the bias and the next kernel rescale (H = 5; g was "other" and the units pinned). Where g is no gain per
    output unit (one for the whole kernel, one per input row: no node-wise symmetry), or the kernel is read by two
    products (g would be an edge twice), g stays "other" and the units pinned (H = 4, the next layer's). The
    function is invariant under the rescalings the space allows, in each case. Cast between v/‖v‖·g and the product
    (a layer computing in float32 from float64 params), both factors are cast. (On a convolution: the zoo's
    ``weight_norm_conv_dense``.)"""
    model = _WeightNormed(how)
    x = jax.random.normal(jax.random.key(0), (6, 3), jnp.float64)
    params = model.init(jax.random.key(1), x)["params"]
    fn = lambda p, x: model.apply({"params": p}, x)  # noqa: E731
    space = pj.trace(fn, params, x)
    assert space.num_hidden == hidden
    (g,) = [leaf for leaf in space.leaves if leaf.path in ("g", "WeightNorm_0/Dense_0/kernel/scale")]
    assert g.kind == ("weight" if hidden > 4 else "other"), g
    if hidden > 4:
        (src,), (dst,) = g.src_groups, g.dst_groups
        assert (space.groups[src].kind, space.groups[dst].kind, space.groups[dst].size) == ("pinned", "hidden", 5)
        assert "coefficients computed from parameters" in " ".join(space.groups[src].reasons)
    pj.testing.assert_function_invariant(fn, space, params, x)
    if how == "units_cast":  # κ and DDP-SGD's κ those of the network computed in float64 (same params), to float32's
        full = pj.trace(lambda p, x: _WeightNormed("units").apply({"params": p}, x), params, x)
        for got, want in (
            (pj.path_kappa(space, params), pj.path_kappa(full, params)),
            (pj.ddp_kappa(space, params, x, alpha=0.5), pj.ddp_kappa(full, params, x, alpha=0.5)),
        ):
            chex.assert_trees_all_close(got, want, rtol=1e-5)


def test_a_sum_weighted_by_pinned_values_keeps_units_along_positions_and_pins_them_across_nodes():
    """``a · h`` with ``a`` fully pinned (a tanh's output) and ``h`` a ReLU layer: an outer product keeps h's units
    (each entry of h times a coefficient no rescaling changes: H = 4, the function invariant), shared along a's
    axis, a position of the product; its path norm is the definition's, a's entries coefficients 1 (as attention's
    weights) and the paths into a's pinned units ending there (before, path_norm refused the product). A
    contraction over h's units mixes them with those coefficients, which pins them. (Attention's weights times its
    values, summed over positions: `test_kappa`.)"""
    rng = np.random.default_rng(0)
    p = {"w": rng.standard_normal((3, 4)), "u": rng.standard_normal((3, 4)), "o": rng.standard_normal((4, 2))}
    x = rng.standard_normal((5, 3))

    def outer(p, x):
        h, a = jax.nn.relu(x @ p["w"]), jnp.tanh(x @ p["u"])
        return jnp.einsum("bi,bj->bij", a, h).sum(1) @ p["o"]

    def across_units(p, x):
        h, a = jax.nn.relu(x @ p["w"]), jnp.tanh(x @ p["u"])
        return jnp.einsum("bi,bi->b", a, h)[:, None] + h @ p["o"]

    space = pj.trace(outer, p, x)
    assert [(g.size, g.kind) for g in space.groups] == [(3, "input"), (4, "hidden"), (4, "pinned"), (2, "output")]
    pj.testing.assert_function_invariant(outer, space, p, x)
    per_unit = (p["w"] ** 2).sum(0) * (p["o"] ** 2).sum(1)  # Σ_k w_kj² Σ_c o_jc², once per entry of a (4)
    np.testing.assert_allclose(pj.path_norm(space, p), np.sqrt(4 * per_unit.sum() + (p["u"] ** 2).sum()), rtol=1e-12)
    assert pj.trace(across_units, p, x).num_hidden == 0


@pytest.mark.parametrize("fill, pins", [(-np.inf, False), (0.0, False), (1.0, True)])
def test_a_segment_max_is_homogeneous_into_minus_infinity_or_zero(fill, pins):
    """``operand.at[ids].max(messages)``: into −∞ (``jax.ops.segment_max``) or 0 the messages' nodes go on; into
    1 it is an offset, which pins them. Graph node 3 receives no message: it is −∞ (then 0 after the ReLU) in the
    network, and its segment carries no path in the |·|^p network, whose κ stays finite (DDP-SGD's κ on this graph:
    test_ddp's graph_empty_segment)."""
    senders, receivers = np.array([0, 1, 2, 0]), np.array([1, 2, 0, 2])

    def fn(p, x):  # x: [B, graph nodes 4, 3]
        msg = x[:, senders] @ p["w_msg"]
        agg = jnp.full((x.shape[0], 4, 5), fill).at[:, receivers].max(msg)
        return jax.nn.relu(agg + x @ p["w_self"] + p["b"]).sum(1) @ p["w"]

    rng = np.random.default_rng(0)
    params = {k: rng.standard_normal(s) for k, s in (("w_msg", (3, 5)), ("w_self", (3, 5)), ("b", 5), ("w", (5, 2)))}
    x = rng.standard_normal((6, 4, 3))
    space = pj.trace(fn, params, x)
    assert space.num_hidden == (0 if pins else 5)
    if not pins:
        pj.testing.assert_function_invariant(fn, space, params, x)
        for kappa in (pj.path_kappa(space, params), pj.path_kappa(space, params, second_order=False)):
            assert all(np.all(np.isfinite(k)) for k in jax.tree_util.tree_leaves(kappa))


def test_a_batch_axis_of_weights_gives_nodes_of_their_own_unless_a_layer_shares_it():
    """Weights with a batch axis in a ``dot_general`` (experts, ensemble members, the positions of ``nn.ConvLocal``)
    have nodes of their own along it: node (member, unit) feeds (member, unit') only. Where a bias is shared by
    every member, or a convolution shares weights across ConvLocal's positions, the axis is a position instead (the
    nodes shared along it): smaller, still exact symmetries. Where a layer contracts the members alone, only the
    output side of the layer before is shared: the units before it stay apart (18, not 6 as before)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((5, 4)))
    w1, w2, e = rng.standard_normal((3, 4, 6)), rng.standard_normal((3, 6, 2)), rng.standard_normal((3, 2))

    def experts(p, x):
        h = jax.nn.relu(jnp.einsum("ni,eij->enj", x, p["w1"]) + p["b1"])
        return jnp.einsum("enj,ejk->enk", h, p["w2"])

    def contracted(p, x):  # the members contracted alone, the units left apart
        h = jax.nn.relu(jnp.einsum("ni,eij->enj", x, p["w1"]))
        h = jax.nn.relu(jnp.einsum("enj,ejk->enk", h, p["w2"]))
        return jnp.einsum("enk,em->nkm", h, p["e"]).reshape(x.shape[0], -1)

    class PerMemberInputs(nn.Module):  # nn.vmap over the inputs' first axis too
        @nn.compact
        def __call__(self, x):
            mlp = nn.vmap(_Mlp, variable_axes={"params": 0}, split_rngs={"params": True}, in_axes=0, axis_size=3)
            return mlp()(x)

    class CNNs(nn.Module):  # JAX batches the second convolution as a grouped one, one group per member
        @nn.compact
        def __call__(self, x):
            cnn = nn.vmap(_Cnn, variable_axes={"params": 0}, split_rngs={"params": True}, in_axes=None, axis_size=2)
            return cnn()(x)

    class LocalThenConv(nn.Module):  # nn.ConvLocal's positions are a batch axis of its kernel: a 1×1 conv shares it
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.ConvLocal(3, (2, 2), padding="VALID")(x))
            return nn.Conv(2, (1, 1))(x).reshape(x.shape[0], -1)

    xs, images = jnp.stack([x, 2 * x, -x]), jnp.asarray(rng.standard_normal((3, 5, 5, 2)))
    vmapped = PerMemberInputs().init(jax.random.key(0), xs)["params"]
    cnns = CNNs().init(jax.random.key(0), images)["params"]
    local = LocalThenConv().init(jax.random.key(0), images)["params"]
    for fn, params, inputs, hidden in (
        (experts, {"w1": w1, "b1": rng.standard_normal((3, 1, 6)), "w2": w2}, x, 18),
        (experts, {"w1": w1, "b1": rng.standard_normal(6), "w2": w2}, x, 6),  # one bias for all members
        (contracted, {"w1": w1, "w2": w2, "e": e}, x, 18),  # (the second layer's members shared, the first's apart)
        (lambda p, x: PerMemberInputs().apply({"params": p}, x), vmapped, xs, 3 * 5),
        (lambda p, x: CNNs().apply({"params": p}, x), cnns, images, 2 * (4 + 3)),
        (lambda p, x: LocalThenConv().apply({"params": p}, x), local, images, 3),
    ):
        space = pj.trace(fn, params, inputs)
        assert space.num_hidden == hidden
        pj.testing.assert_function_invariant(fn, space, params, inputs)
    space = pj.trace(PerMemberInputs().apply, {"params": vmapped}, xs)  # κ runs it on one example: members first fail
    with pytest.raises(pj.PathKappaUnsupportedError, match=r"shapes \[\(1, 5, 4\)\].*Put the examples first"):
        pj.path_kappa(space, {"params": vmapped})


class _Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2)(nn.relu(nn.Dense(5)(x)))


class _Cnn(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(3, (3, 3))(nn.relu(nn.Conv(4, (3, 3))(x))))
        return nn.Dense(2)(x.mean(axis=(1, 2)))


def test_structure_not_names_or_leaf_order():
    """Twelve layers: flattening order is Dense_0, Dense_1, Dense_10, Dense_11, Dense_2, ..."""

    class Deep(nn.Module):
        @nn.compact
        def __call__(self, x):
            for w in range(2, 13):
                x = nn.relu(nn.Dense(w)(x))
            return nn.Dense(1)(x)

    x = jnp.ones((2, 3))
    params = Deep().init(jax.random.key(0), x)["params"]
    space = pj.trace(lambda p, x: Deep().apply({"params": p}, x), params, x)
    assert space.num_hidden == sum(range(2, 13))
    by_path = {leaf.path: leaf for leaf in space.leaves}
    for i in range(11):
        out_group = by_path[f"Dense_{i}/kernel"].dst_groups
        assert by_path[f"Dense_{i + 1}/kernel"].src_groups == out_group
        assert by_path[f"Dense_{i}/bias"].dst_groups == out_group
        assert space.groups[out_group[0]].size == i + 2
    # groups are numbered in the order of the forward pass, not of the pytree
    assert [space.groups[by_path[f"Dense_{i}/kernel"].dst_groups[0]].name for i in range(12)] == [
        f"g{i + 1}" for i in range(12)
    ]


def test_linen_nnx_and_plain_jax_agree():
    from flax import nnx

    k = jax.random.split(jax.random.key(0), 2)
    w1, w2 = jax.random.normal(k[0], (4, 6)), jax.random.normal(k[1], (6, 2))
    x = jnp.ones((3, 4))
    plain = pj.trace(
        lambda p, x: jax.nn.relu(x @ p["a"]["kernel"] + p["a"]["bias"]) @ p["b"]["kernel"],
        {"a": {"kernel": w1, "bias": jnp.zeros(6)}, "b": {"kernel": w2}},
        x,
    )

    class L(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2, use_bias=False, name="b")(nn.relu(nn.Dense(6, name="a")(x)))

    linen = pj.trace(lambda p, x: L().apply({"params": p}, x), L().init(jax.random.key(0), x)["params"], x)

    class N(nnx.Module):
        def __init__(self):
            self.a = nnx.Linear(4, 6, rngs=nnx.Rngs(0))
            self.b = nnx.Linear(6, 2, use_bias=False, rngs=nnx.Rngs(1))

        def __call__(self, x):
            return self.b(nnx.relu(self.a(x)))

    gdef, state = nnx.split(N(), nnx.Param)
    nnx_space = pj.trace(lambda s, x: nnx.merge(gdef, s)(x), state, x)
    for s in (plain, linen, nnx_space):
        assert (s.num_params, s.num_hidden) == (4 * 6 + 6 + 12, 6)
        assert [leaf.path for leaf in s.leaves] == ["a/bias", "a/kernel", "b/kernel"]
        np.testing.assert_array_equal(s.leaves[1].dst, plain.leaves[1].dst)


def test_nnx_rnn_traces_with_its_rng_state_as_an_argument_and_says_so_when_closed_over():
    """nnx.RNN draws its initial carry from an nnx.Rngs stream, which the forward pass advances: closing over that
    state fails (as under ``jax.jit``) with a flax error, which the message completes with what to do."""
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.rnn = nnx.RNN(nnx.SimpleCell(3, 5, activation_fn=nnx.relu, rngs=rngs))
            self.out = nnx.Linear(5, 2, rngs=rngs)

        def __call__(self, x):
            return self.out(self.rnn(x)[:, -1])

    graphdef, params, rest = nnx.split(Net(nnx.Rngs(0)), nnx.Param, ...)
    x = jnp.ones((2, 4, 3))
    with pytest.raises(ValueError, match=r"TraceContextError.*pass that state as an argument"):
        pj.trace(lambda p, x: nnx.merge(graphdef, p, rest)(x), params, x)
    space = pj.trace(lambda p, x, rest: nnx.merge(graphdef, p, rest)(x), params, x, rest)
    assert space.num_hidden == 5  # the cell's ReLU units


def test_describe_names_roles_and_reasons():
    rnn = pj.trace(
        ZOO["stacked_rnn_every_step"].fn, ZOO["stacked_rnn_every_step"].params, ZOO["stacked_rnn_every_step"].inputs(2)
    )
    text = pj.describe(rnn)
    assert "SimpleCell_0/h/kernel" in text and "(recurrent)" in text
    assert "SimpleCell_0/i/bias" in text and "bias -> g" in text
    assert "skeleton chosen by index" in text  # the default: from the graph alone
    by_value = pj.trace(
        ZOO["stacked_rnn_every_step"].fn,
        ZOO["stacked_rnn_every_step"].params,
        ZOO["stacked_rnn_every_step"].inputs(2),
        skeleton="values",
    )
    assert "skeleton chosen from the params' values" in pj.describe(by_value)
    tanh = ZOO["tanh_mlp_partly_pinned"]
    text = pj.describe(pj.trace(tanh.fn, tanh.params, tanh.inputs(2)))
    assert "pinned, because:" in text and "- tanh: nonlinear" in text and "zoo.py:" in text
    assert "hidden" in text and "input" in text and "output" in text


def test_pathspace_is_frozen_hashable_and_holds_no_jax_arrays():
    case = ZOO["cnn2d_stride_padding_maxpool"]
    space = pj.trace(case.fn, case.params, case.inputs(2))
    again = pj.trace(case.fn, case.params, case.inputs(2))
    assert hash(space) == hash(again) and space == again
    assert space != pj.trace(ZOO["mlp"].fn, ZOO["mlp"].params, ZOO["mlp"].inputs(2))
    with pytest.raises(AttributeError):
        space.num_nodes = 3
    for leaf in space.leaves:
        assert isinstance(leaf.src, np.ndarray) and not leaf.src.flags.writeable

    def no_jax(obj):
        assert not isinstance(obj, jax.Array)

    jax.tree_util.tree_map(no_jax, [leaf.__dict__ for leaf in space.leaves] + [g.__dict__ for g in space.groups])
    # usable as a static argument
    f = jax.jit(lambda p, s: pj.random_rescale(s, p, jax.random.key(0)), static_argnums=1)
    chex.assert_trees_all_close(f(case.params, space), pj.random_rescale(space, case.params, jax.random.key(0)))
    pickle.dumps([leaf.path for leaf in space.leaves])


def test_batch_size_does_not_change_structure():
    case = ZOO["embedding_rnn"]
    a = pj.trace(case.fn, case.params, case.inputs(2))
    b = pj.trace(case.fn, case.params, jax.ShapeDtypeStruct((7, 5), jnp.int32))
    assert [(leaf.src_groups, leaf.dst_groups) for leaf in a.leaves] == [
        (leaf.src_groups, leaf.dst_groups) for leaf in b.leaves
    ]
    assert a.num_hidden == b.num_hidden


@pytest.mark.parametrize(
    "read",
    ["iterate", "split", "take", "fori_loop", "fori_loop take", "some layers", "fori_loop from 1", "whole too",
     "mixed roles"],
)  # fmt: skip
def test_layers_stacked_in_one_leaf_and_read_one_by_one(read):
    """Layers stacked in one leaf and read one by one (``ws[i]``, ``for w in ws``: static slices or, on JAX 0.12+,
    an unstack; ``jnp.split``; ``jnp.take(ws, i, axis=0)``, a gather of a known row; ``lax.fori_loop`` reading
    ``ws[i]`` or ``jnp.take(ws, i, axis=0)`` by its counter, which the trace unrolls) are edge bundles of their
    own, as under nn.scan. A leaf of which some layers are never read, that is also read whole, or whose layers
    have different roles (biases and a scale) is "other" and its layers' units are pinned: the function stays
    invariant under the rescalings that are left."""
    rng = np.random.default_rng(0)
    shapes = {"w0": (3, 4), "w1": (4, 4), "ws": (3, 4, 4), "bs": (3, 4), "out": (4, 2)}
    params = {k: jnp.asarray(rng.standard_normal(shape)) for k, shape in shapes.items()}

    def fn(p, x):
        x = jax.nn.relu(jax.nn.relu(x @ p["w0"]) @ p["w1"])
        if read == "iterate":  # slices, or (JAX 0.12+) an unstack
            layers = zip(p["ws"], p["bs"], strict=True)
        elif read == "split":
            layers = [(w[0], b[0]) for w, b in zip(jnp.split(p["ws"], 3), jnp.split(p["bs"], 3), strict=True)]
        elif read == "take":
            layers = [(jnp.take(p["ws"], i, axis=0), jnp.take(p["bs"], i, axis=0)) for i in range(3)]
        elif read == "fori_loop take":
            layers = []
            x = jax.lax.fori_loop(
                0, 3, lambda i, h: jax.nn.relu(h @ jnp.take(p["ws"], i, axis=0) + jnp.take(p["bs"], i, axis=0)), x
            )
        elif read.startswith("fori_loop"):
            layers = []
            x = jax.lax.fori_loop(
                int(read == "fori_loop from 1"), 3, lambda i, h: jax.nn.relu(h @ p["ws"][i] + p["bs"][i]), x
            )
        else:
            layers = [(p["ws"][i], p["bs"][i]) for i in range(3 if read == "whole too" else 2)]
        for w, b in layers:
            x = jax.nn.relu(x @ w + b)
        if read == "mixed roles":  # the last layer's "bias" read as a per-unit scale
            x = jax.nn.relu(x @ p["ws"][2]) * p["bs"][2]
        if read == "whole too":
            x = x + x @ p["ws"].sum(0)
        return x @ p["out"]

    x = jnp.asarray(rng.standard_normal((5, 3)))
    space = pj.trace(fn, params, x)
    kinds = {leaf.path: leaf.kind for leaf in space.leaves}
    one_by_one = ("iterate", "split", "take", "fori_loop", "fori_loop take")
    if read in one_by_one:
        assert space.num_hidden == 4 + 4 + 3 * 4
        assert kinds == {"w0": "weight", "w1": "weight", "ws": "weight", "bs": "bias", "out": "weight"}
    elif read == "mixed roles":  # bs's layers are biases and a scale: bs is "other", the units it touches pinned
        assert space.num_hidden == 4 + 4 and kinds["bs"] == "other" and kinds["ws"] == "weight"
        assert "its layers have different roles" in pj.describe(space)
    else:
        assert space.num_hidden == 4  # the first layer's: the stack's inputs and outputs are pinned
        assert kinds["ws"] == "other"
        note = "read whole as well as layer by layer" if read == "whole too" else "reads 2 of its 3 layers"
        assert note in pj.describe(space)
    pj.testing.assert_function_invariant(fn, space, params, x)
    if read in one_by_one:  # Path-SGD's κ: the one of the same network with each layer a leaf of its own
        unstacked = {**params, "ws": list(params["ws"]), "bs": list(params["bs"])}

        def fn_list(p, x):
            x = jax.nn.relu(jax.nn.relu(x @ p["w0"]) @ p["w1"])
            for w, b in zip(p["ws"], p["bs"], strict=True):
                x = jax.nn.relu(x @ w + b)
            return x @ p["out"]

        want = pj.path_kappa(pj.trace(fn_list, unstacked, x), unstacked)
        got = pj.path_kappa(space, params)
        chex.assert_trees_all_close({**got, "ws": list(got["ws"]), "bs": list(got["bs"])}, want, rtol=1e-12)


@pytest.mark.parametrize("reverse", [False, True])
def test_leaves_stacked_for_a_scan_are_the_layers_written_as_a_loop(reverse):
    """Per-layer params, one leaf each, stacked inside the traced function for ``lax.scan`` (``jax.tree.map(lambda
    *l: jnp.stack(l), *layers)``): each layer of the scan reads its own leaves, an edge bundle each, as if the
    layers were written in a loop (H = 4 + 3 × 4, the same groups, path norm, κ and DDP-SGD's κ; ``reverse``: the
    scan runs them last to first). Before, the stack made them "other" and the stack's units pinned. Leaves whose
    stack is also read otherwise stay "other"."""
    rng = np.random.default_rng(0)
    layers = [{"w": jnp.asarray(rng.standard_normal((4, 4))), "b": jnp.asarray(0.1 * rng.standard_normal(4))}
              for _ in range(3)]  # fmt: skip
    params = {"inp": jnp.asarray(rng.standard_normal((3, 4))), "layers": layers,
              "out": jnp.asarray(rng.standard_normal((4, 2)))}  # fmt: skip
    x = jnp.asarray(rng.standard_normal((6, 3)))

    def layer(h, lp):
        return jax.nn.relu(h @ lp["w"] + lp["b"]), None

    def scanned(p, x, also=False):
        stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *p["layers"])
        h, _ = jax.lax.scan(layer, jax.nn.relu(x @ p["inp"]), stacked, reverse=reverse)
        return h @ p["out"] + (jnp.sum(stacked["b"]) if also else 0.0)

    def looped(p, x):
        h = jax.nn.relu(x @ p["inp"])
        for lp in p["layers"][::-1] if reverse else p["layers"]:
            h, _ = layer(h, lp)
        return h @ p["out"]

    np.testing.assert_allclose(scanned(params, x), looped(params, x), rtol=1e-12)
    space, ref = pj.trace(scanned, params, x), pj.trace(looped, params, x)
    assert space.num_hidden == ref.num_hidden == 4 + 3 * 4
    assert [(g.kind, g.size) for g in space.groups] == [(g.kind, g.size) for g in ref.groups]
    assert [leaf.kind for leaf in space.leaves] == [leaf.kind for leaf in ref.leaves]
    np.testing.assert_allclose(pj.path_norm(space, params), pj.path_norm(ref, params), rtol=1e-12)
    chex.assert_trees_all_close(pj.path_kappa(space, params), pj.path_kappa(ref, params), rtol=1e-12)
    chex.assert_trees_all_close(pj.ddp_kappa(space, params, x, alpha=0.5), pj.ddp_kappa(ref, params, x, alpha=0.5),
                                rtol=1e-10)  # fmt: skip
    pj.testing.assert_function_invariant(scanned, space, params, x)
    also = functools.partial(scanned, also=True)  # the biases' stack read otherwise too: they are "other"
    space = pj.trace(also, params, x)
    kinds = {leaf.path.split("/")[-1]: leaf.kind for leaf in space.leaves if leaf.path.startswith("layers")}
    assert kinds == {"b": "other", "w": "weight"}
    pj.testing.assert_function_invariant(also, space, params, x)


def test_a_loop_that_looks_up_tokens_by_its_counter_stays_a_recurrence():
    """A ReLU RNN written with ``lax.fori_loop`` that reads token ``t``'s embeddings by its counter
    (``jnp.take(emb, ids[:, t], axis=0)`` or ``emb[ids[:, t]]``, a lookup of a batch of ids) is a recurrence, not a
    stack of layers unrolled by the counter (as a loop reading one row ``jnp.take(ws, i, axis=0)`` is): the
    recurrent kernel ties its group to itself, H 4."""
    rng = np.random.default_rng(0)
    shapes = {"emb": (7, 4), "w": (4, 4), "out": (4, 2)}
    params = {k: jnp.asarray(rng.standard_normal(shape)) for k, shape in shapes.items()}
    ids = jnp.asarray(rng.integers(0, 7, (5, 6)))
    for lookup in (lambda p, i: jnp.take(p["emb"], i, axis=0), lambda p, i: p["emb"][i]):

        def fn(p, ids, lookup=lookup):
            body = lambda t, h: jax.nn.relu(h @ p["w"] + lookup(p, ids[:, t]))  # noqa: E731
            return jax.lax.fori_loop(0, ids.shape[1], body, jnp.zeros((ids.shape[0], 4))) @ p["out"]

        space = pj.trace(fn, params, ids)
        assert space.num_hidden == 4
        assert {leaf.path: (leaf.kind, leaf.recurrent) for leaf in space.leaves} == {
            "emb": ("weight", False), "w": ("weight", True), "out": ("weight", False)}  # fmt: skip


# ------------------------------------------------------------------------- bad input


def test_strict_raises_on_tanh_naming_primitive_line_and_params():
    case = ZOO["tanh_mlp_partly_pinned"]
    with pytest.raises(pj.UnsupportedModelError) as err:
        pj.trace(case.fn, case.params, case.inputs(2), strict=True)
    msg = str(err.value)
    assert "tanh" in msg and "zoo.py" in msg and "Dense_0/kernel" in msg and "Dense_1/kernel" in msg
    for name in ("layernorm_mlp_partly_pinned", "fused_lstm_relu_head"):  # one short line per problem
        case = ZOO[name]
        space = pj.trace(case.fn, case.params, case.inputs(2))
        with pytest.raises(pj.UnsupportedModelError) as err:
            pj.trace(case.fn, case.params, case.inputs(2), strict=True)
        lines = str(err.value).splitlines()
        hints = [line for line in lines if line.startswith("      what you can do: ")]
        problems = sum(g.kind == "pinned" for g in space.groups) + sum(leaf.kind == "other" for leaf in space.leaves)
        assert len(lines) == problems + len(hints) + 2 and max(map(len, lines)) <= 250, lines
        assert hints, lines  # a pinned group says what the user can do about it
    # the homogeneous models pass strict mode
    pj.trace(ZOO["residual_cnn"].fn, ZOO["residual_cnn"].params, ZOO["residual_cnn"].inputs(2), strict=True)


def test_a_rule_table_entry_teaches_trace_and_kappa_a_primitive():
    """One `pathspace_jax.rules` entry is all a new primitive needs (docs/architecture.md): unknown, it pins
    the layer around it; registered as a relabelling, the structure, path norm and κ are those of the same
    network without it."""
    name = f"pj_test_copy_{len(ZOO)}_{id(object())}"  # a fresh primitive: the table is global
    copy_p = Primitive(name)
    copy_p.def_impl(lambda x: x)
    copy_p.def_abstract_eval(lambda aval: aval)
    mlir.register_lowering(copy_p, mlir.lower_fun(lambda x: x, multiple_results=False))
    ad.deflinear2(copy_p, lambda t, x: [t])

    def fn(p, x, copy=True):
        h = jax.nn.relu(x @ p["w1"] + p["b1"])
        return (copy_p.bind(h) if copy else h) @ p["w2"]

    keys = jax.random.split(jax.random.key(0), 3)
    params = {"w1": jax.random.normal(keys[0], (4, 6)), "b1": jax.random.normal(keys[1], (6,)),
              "w2": jax.random.normal(keys[2], (6, 2))}  # fmt: skip
    x = jnp.ones((3, 4))
    with pytest.raises(pj.UnsupportedModelError, match=name):
        pj.trace(fn, params, x, strict=True)
    rules.register(name, rules.Rule("relabel", as_is=True, passes_node=True, keeps_ones=True))
    space, plain = pj.trace(fn, params, x, strict=True), pj.trace(lambda p, x: fn(p, x, False), params, x)
    assert space.num_hidden == plain.num_hidden == 6
    np.testing.assert_allclose(pj.path_norm(space, params), pj.path_norm(plain, params), rtol=1e-6)
    chex.assert_trees_all_close(pj.path_kappa(space, params), pj.path_kappa(plain, params), rtol=1e-6)
    with pytest.raises(ValueError, match="already has a rule"):
        rules.register(name, rules.Rule("nonlinear"))


def test_a_rule_names_its_tracing_function_or_a_family_never_nothing_that_is_then_pinned():
    """A primitive with a rule of its own gives its tracing function (``Rule(trace=f)``); a structure that is no
    family (the old ``"method"``, which looked a method up by name) is refused when the rule is made, not pinned
    silently at trace time."""
    with pytest.raises(ValueError, match="trace=f"):
        rules.Rule("method")
    with pytest.raises(ValueError, match="not both"):
        rules.Rule("relabel", trace=lambda walker, eqn, ins: ins)
    assert rules.Rule("relabel").trace is rules.rule("copy").trace


def test_the_library_errors_share_one_base_and_keep_their_builtin_ones():
    """``except pj.PathSpaceError`` catches every model error, and the builtin bases they had stay."""
    case = ZOO["tanh_mlp_partly_pinned"]
    with pytest.raises(pj.PathSpaceError):
        pj.trace(case.fn, case.params, case.inputs(2), strict=True)
    builtin = {pj.UnsupportedModelError: ValueError, pj.UnsupportedJaxprError: NotImplementedError,
               pj.PathKappaUnsupportedError: ValueError, pj.DDPUnsupportedError: ValueError,
               pj.DDPNormalizationError: ValueError}  # fmt: skip
    for cls, base in builtin.items():
        assert issubclass(cls, pj.PathSpaceError) and issubclass(cls, base), cls


def test_fn_that_does_not_use_params():
    with pytest.raises(ValueError, match="does not use params"):
        pj.trace(lambda p, x: jax.nn.relu(x), {"w": jnp.ones((3, 3))}, jnp.ones((2, 3)))


def test_unused_leaf_is_named():
    with pytest.raises(ValueError, match="'extra'"):
        pj.trace(lambda p, x: x @ p["w"], {"w": jnp.ones((3, 3)), "extra": jnp.ones(2)}, jnp.ones((2, 3)))


@pytest.mark.parametrize(
    "params, match",
    [
        ({"w": "not an array"}, "params leaf 'w' is a str"),
        ({"w": jnp.ones((3, 2), jnp.int32)}, "params leaf 'w' has dtype int32"),
        ({}, "no array leaves"),
    ],
)
def test_params_must_be_float_arrays(params, match):
    with pytest.raises(TypeError, match=match):
        pj.trace(lambda p, x: x @ p["w"], params, jnp.ones((2, 3)))


def test_args_that_do_not_fit():
    case = ZOO["mlp"]
    with pytest.raises(ValueError, match=r"could not be traced with args of shapes \('float64\[2, 9\]'"):
        pj.trace(case.fn, case.params, jnp.ones((2, 9)))


def test_rescale_rejects_bad_alphas_and_mismatched_params():
    case = ZOO["mlp"]
    space = pj.trace(case.fn, case.params, case.inputs(2))
    alphas = pj.random_alphas(space, jax.random.key(0))
    with pytest.raises(ValueError, match="one vector per hidden group"):
        pj.rescale(space, case.params, alphas[:1])
    with pytest.raises(ValueError, match="positive"):
        pj.rescale(space, case.params, [-a for a in alphas])
    with pytest.raises(ValueError, match="shape"):
        pj.rescale(space, case.params, [alphas[0][:2], alphas[1]])
    with pytest.raises(ValueError, match="leaves of the params"):
        pj.rescale(space, {"Dense_0": case.params["Dense_0"]}, alphas)
    bad = jax.tree_util.tree_map(lambda a: a, case.params)
    bad["Dense_1"]["kernel"] = jnp.ones((2, 2))
    with pytest.raises(ValueError, match="Dense_1/kernel"):
        pj.rescale(space, bad, alphas)


def test_assert_function_invariant_catches_a_non_invariant_function():
    case = ZOO["mlp"]
    space = pj.trace(case.fn, case.params, case.inputs(2))
    # (squaring every weight would not do: that is invariant under the rescaling by α²)
    shifted = lambda p, x: case.fn(jax.tree_util.tree_map(lambda a: a + 1.0, p), x)  # noqa: E731
    with pytest.raises(AssertionError):
        pj.testing.assert_function_invariant(shifted, space, case.params, case.inputs(3))


@pytest.mark.slow
def test_sharded_trace_and_rescale_8_devices():
    """rescale under jit with params sharded over 8 simulated CPU devices."""
    code = textwrap.dedent(
        """
        import jax, jax.numpy as jnp, numpy as np, flax.linen as nn, pathspace_jax as pj
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        assert jax.device_count() == 8
        m = nn.Sequential([nn.Dense(16), nn.relu, nn.Dense(8), nn.relu, nn.Dense(2)])
        x = jnp.ones((8, 4)); p = m.init(jax.random.key(0), x)["params"]
        space = pj.trace(lambda p, x: m.apply({"params": p}, x), p, x)
        mesh = Mesh(np.array(jax.devices()), ("d",))
        spec = lambda a: P(None, "d") if a.ndim == 2 and a.shape[1] % 8 == 0 else P()
        shard = lambda a: jax.device_put(a, NamedSharding(mesh, spec(a)))
        ps = jax.tree_util.tree_map(shard, p)
        f = jax.jit(lambda p, k: pj.random_rescale(space, p, k))
        a, b = f(ps, jax.random.key(1)), f(p, jax.random.key(1))
        for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
            np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
        print("ok")
        """
    )
    import os

    env = {"XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip(),
           "JAX_PLATFORMS": "cpu"}  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


# ------------------------------------------------------------------------- primitive rules

_RELUS = {
    "jax.nn.relu": jax.nn.relu,
    "jnp.maximum(0, x)": lambda z: jnp.maximum(0.0, z),
    "x * (x > 0)": lambda z: z * (z > 0),
    "jnp.where": lambda z: jnp.where(z > 0, z, 0.0),
    "x * (sign(x) + 1) / 2": lambda z: z * (jnp.sign(z) + 1) / 2,
    "leaky_relu": lambda z: jax.nn.leaky_relu(z, 0.05),
    "abs": jnp.abs,
    "identity": lambda z: z,
}
_NOT_HOMOGENEOUS = {
    "gelu": jax.nn.gelu,
    "relu6": jax.nn.relu6,
    "silu (a product of activations)": jax.nn.silu,
    "softplus": jax.nn.softplus,
    "x + 1 (a constant offset)": lambda z: jax.nn.relu(z + 1.0),
    "x > 0.5 (a non-zero threshold)": lambda z: jnp.where(z > 0.5, z, 0.0),
    "softmax over the units": lambda z: jax.nn.softmax(z, axis=-1),
    "relu(x) * stop_gradient(x) (of degree 2)": lambda z: jax.nn.relu(z) * jax.lax.stop_gradient(z),
}


def _two_layer(act):
    k = jax.random.split(jax.random.key(0), 3)
    params = {
        "l1": {"w": jax.random.normal(k[0], (3, 4)), "b": jnp.zeros(4)},
        "l2": {"w": jax.random.normal(k[1], (4, 2)), "b": jnp.zeros(2)},
    }
    fn = lambda p, x: act(x @ p["l1"]["w"] + p["l1"]["b"]) @ p["l2"]["w"] + p["l2"]["b"]  # noqa: E731
    return fn, params, jax.random.normal(k[2], (5, 3))


@pytest.mark.parametrize("name", list(_RELUS))
def test_homogeneous_activations_however_written(name):
    fn, params, x = _two_layer(_RELUS[name])
    space = pj.trace(fn, params, x, strict=True)
    assert space.num_hidden == 4
    pj.testing.assert_function_invariant(fn, space, params, x)


_SAME_AS_RELU = ["jnp.maximum(0, x)", "x * (x > 0)", "jnp.where", "x * (sign(x) + 1) / 2"]


@pytest.mark.parametrize("recurrent", [False, True], ids=["mlp", "rnn"])
def test_relu_however_written_has_the_path_norm_and_kappas_of_jax_nn_relu(recurrent):
    """ReLU written as a mask (``x * (x > 0)``, whose mask the trace reads as a constant of the structure), a
    select or a sign gate: the |·|^p network evaluates the mask on its non-negative values, where it is ReLU's gate,
    so the path norm, κ (κ⁽²⁾ in a recurrence), DDP-SGD's κ (α 0.5: its γ² recursion) and DDP-Normalization equal
    those of the network with ``jax.nn.relu``. Before, a product with a mask was refused as "not positively
    homogeneous", the sign gate's 1/2 was squared without its 2, and a select refused κ⁽²⁾."""
    k = jax.random.split(jax.random.key(3), 6)
    if recurrent:
        params = {"wi": jax.random.normal(k[0], (3, 4)), "wh": 0.5 * jax.random.normal(k[1], (4, 4)),
                  "b": 0.1 * jax.random.normal(k[2], (4,)), "wo": jax.random.normal(k[3], (4, 2))}  # fmt: skip
        x = jax.random.normal(k[4], (6, 5, 3))

        def network(act):
            def fn(p, xs):
                step = lambda h, xt: (act(xt @ p["wi"] + h @ p["wh"] + p["b"]), None)  # noqa: E731
                h, _ = jax.lax.scan(step, jnp.zeros((xs.shape[0], 4)), jnp.swapaxes(xs, 0, 1))
                return h @ p["wo"]

            return fn
    else:
        params = {"w1": jax.random.normal(k[0], (3, 4)), "b1": 0.1 * jax.random.normal(k[2], (4,)),
                  "w2": jax.random.normal(k[1], (4, 5)), "w3": jax.random.normal(k[3], (5, 2))}  # fmt: skip
        x = jax.random.normal(k[4], (6, 3))

        def network(act):
            return lambda p, x: act(act(x @ p["w1"] + p["b1"]) @ p["w2"]) @ p["w3"]

    def quantities(act):
        fn = network(act)
        space = pj.trace(fn, params, x, strict=True)
        out = {"norm": pj.path_norm(space, params), "kappa": pj.path_kappa(space, params, second_order=recurrent),
               "ddp": pj.ddp_kappa(space, params, x, alpha=0.5)}  # fmt: skip
        if not recurrent:
            out["normalized"] = pj.ddp_normalize(space, alpha=0.5)(params, x)
        return out

    expected = quantities(jax.nn.relu)
    # (in the recurrence, the forms that κ⁽²⁾'s linearity check reads differently: a mask product and a select)
    for name in ["x * (x > 0)", "jnp.where"] if recurrent else _SAME_AS_RELU:
        chex.assert_trees_all_close(quantities(_RELUS[name]), expected, rtol=1e-12)


class _FusedAttention(nn.Module):
    """A Transformer-style block whose q, k and v come from one Dense, cut by ``jnp.split`` (as GPT ports write it),
    and a ReLU feed-forward head."""

    heads: int = 2

    @nn.compact
    def __call__(self, x):
        q, k, v = jnp.split(nn.Dense(3 * 4)(x), 3, axis=-1)
        split = lambda t: t.reshape(*t.shape[:2], self.heads, -1)  # noqa: E731
        a = jax.nn.softmax(jnp.einsum("bthd,bshd->bhts", split(q), split(k)), axis=-1)
        h = jnp.einsum("bhts,bshd->bthd", a, split(v)).reshape(v.shape)
        return nn.Dense(2)(nn.relu(nn.Dense(5)(h)).mean(1))


def test_a_fused_kernel_writes_into_the_groups_it_is_cut_into_and_steps_stay_invariant():
    """``q, k, v = jnp.split(Dense(12)(x), 3, -1)``: the kernel's columns are edges into three groups (q and k pinned
    by the softmax, v rescalable), not "other"; G-SGD and DDP-SGD steps commute with rescaling v's units
    (and the feed-forward layer's). Before, all twelve units were pinned and the kernel rescaled nothing."""
    x = jax.random.normal(jax.random.key(0), (3, 5, 4), jnp.float64)
    model = _FusedAttention()
    params = jax.tree.map(lambda a: a.astype(jnp.float64) + 0.1, model.init(jax.random.key(1), x)["params"])
    fn = lambda p, x: model.apply({"params": p}, x)  # noqa: E731
    space = pj.trace(fn, params, x)
    assert space.num_hidden == 4 + 5
    assert sorted((g.kind, g.size) for g in space.groups if g.kind in ("hidden", "pinned")) == [
        ("hidden", 4), ("hidden", 5), ("pinned", 4), ("pinned", 4)
    ]  # fmt: skip
    (kernel,) = [leaf for leaf in space.leaves if leaf.path == "Dense_0/kernel"]
    assert kernel.kind == "weight" and len(kernel.dst_groups) == 3
    y = jax.random.normal(jax.random.key(2), (3, 2), jnp.float64)
    loss = lambda p, batch: jnp.mean((fn(p, batch[0]) - batch[1]) ** 2)  # noqa: E731
    for tx, kwargs in [(pj.g_sgd(space, 0.05), None), (pj.ddp_sgd(space, 0.05, alpha=0.5), {"inputs": x})]:
        pj.testing.assert_update_invariant(tx, loss, space, params, (x, y), update_kwargs=kwargs, num_steps=2,
                                           rtol=1e-8)  # fmt: skip


def test_units_a_slice_leaves_out_are_pinned_and_the_rest_trains_invariantly():
    """``relu(x @ w1)[:, :3] @ w2``: the three units read on are hidden, the two left out are a group of their own,
    pinned (no path through them reaches an output: the skeleton method has no outgoing edge for them), and
    G-SGD's and Path-SGD's steps stay invariant."""
    ks = jax.random.split(jax.random.key(0), 4)
    p = {"w1": jax.random.normal(ks[0], (3, 5), jnp.float64), "w2": jax.random.normal(ks[1], (3, 2), jnp.float64)}
    fn = lambda p, x: jax.nn.relu(x @ p["w1"])[:, :3] @ p["w2"]  # noqa: E731
    x, y = jax.random.normal(ks[2], (6, 3), jnp.float64), jax.random.normal(ks[3], (6, 2), jnp.float64)
    space = pj.trace(fn, p, x)
    assert space.num_hidden == 3
    (left_out,) = [g for g in space.groups if g.kind == "pinned"]
    assert left_out.size == 2 and "no parameter edge leaves these nodes" in left_out.reasons[0]
    assert "what you can do: units that nothing reads" in pj.describe(space)
    loss = lambda p, batch: jnp.mean((fn(p, batch[0]) - batch[1]) ** 2)  # noqa: E731
    for tx in (pj.g_sgd(space, 0.05), pj.path_sgd(space, 0.05)):
        pj.testing.assert_update_invariant(tx, loss, space, p, (x, y), num_steps=2, rtol=1e-8)


def test_a_nonlinear_function_of_a_concatenation_pins_both_groups():
    """``tanh(concatenate([relu(x @ a), relu(x @ b)]))``: both groups are pinned. Before, a pin of the concatenation
    reached neither group, and their units were called rescalable (H 9) where rescaling them changes the function."""
    ks = jax.random.split(jax.random.key(0), 4)
    p = {"a": jax.random.normal(ks[0], (3, 4)), "b": jax.random.normal(ks[1], (3, 5)),
         "w": jax.random.normal(ks[2], (9, 2))}  # fmt: skip
    fn = lambda p, x: jnp.tanh(jnp.concatenate([jax.nn.relu(x @ p["a"]), jax.nn.relu(x @ p["b"])], -1)) @ p["w"]  # noqa: E731
    space = pj.trace(fn, p, jax.random.normal(ks[3], (6, 3)))
    assert space.num_hidden == 0
    assert sorted(g.size for g in space.groups if g.kind == "pinned") == [4, 5]


@pytest.mark.parametrize("case", ["shared bias", "read again"])
def test_a_kernel_cut_along_its_pieces_axis_and_read_otherwise_is_pinned_saying_why(case):
    """A kernel with a pieces axis (``nn.DenseGeneral((2, 4))``, its halves read apart: one group each) whose output
    also gets a bias shared by the pieces, or that is read again whole: its units are pinned, and the trace says
    why (no quiet mix of the pieces' groups and the kernel's own axes)."""
    ks = jax.random.split(jax.random.key(0), 4)
    p = {"w": jax.random.normal(ks[0], (3, 2, 4)), "u": jax.random.normal(ks[1], (4, 2))}
    dense = lambda x, w: jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())))  # noqa: E731

    def fn(p, x):
        z = dense(x, p["w"]) + p["b"] if case == "shared bias" else dense(x, p["w"])
        out = (jax.nn.relu(z[:, 0]) * jax.nn.sigmoid(z[:, 1])) @ p["u"]
        return out if case == "shared bias" else out + jax.nn.relu(dense(x, p["w"])).sum(1) @ p["u"]

    p = p | {"b": jax.random.normal(ks[2], (4,))} if case == "shared bias" else p
    space = pj.trace(fn, p, jax.random.normal(ks[3], (6, 3)))
    assert space.num_hidden == 0
    why = {"shared bias": "adds to a kernel's output cut into pieces something other than its bias",
           "read again": "read as one node axis cut into pieces and again with its axes apart"}[case]  # fmt: skip
    assert why in pj.describe(space)


class _QKV(nn.Module):
    """Attention of 2 heads of 4 on queries, keys and values from one projection, laid out as GPT-NeoX ports write it
    (``qkv.reshape(b, t, heads, 3 * d)`` split on its last axis), as ``nn.DenseGeneral((heads, 3, d))`` read along
    its middle axis, or with the pieces axis first (``qkv.reshape(b, t, 3, heads, d)``); with ``extra``, the
    reshaped output is read otherwise too (a sum over its pieces added to the values' mixture; without, that sum is
    computed and dropped)."""

    layout: str
    extra: bool = False

    @nn.compact
    def __call__(self, x):
        b, t, _ = x.shape
        if self.layout == "neox":
            qkv = nn.Dense(24)(x).reshape(b, t, 2, 12)
            q, k, v = jnp.split(qkv, 3, axis=-1)
            extra = qkv.reshape(b, t, 2, 3, 4).sum(-2)
        elif self.layout == "heads_first":
            qkv = nn.DenseGeneral((2, 3, 4))(x)
            q, k, v = qkv[:, :, :, 0], qkv[:, :, :, 1], qkv[:, :, :, 2]
            extra = qkv.sum(-2)
        else:
            qkv = nn.Dense(24)(x).reshape(b, t, 3, 2, 4)
            q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
            extra = qkv.sum(2)
        a = nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k), axis=-1)
        mixed = jnp.einsum("bhqk,bkhd->bqhd", a, v)
        o = nn.DenseGeneral(6, axis=(-2, -1))(mixed + extra if self.extra else mixed)
        return nn.Dense(2)(nn.relu(o).mean(1))


def test_a_fused_projection_whose_pieces_interleave_is_cut_into_them():
    """Queries, keys and values that interleave in one projection's output (GPT-NeoX's layout, or
    ``nn.DenseGeneral((heads, 3, d))`` read along its middle axis) are groups of their own, as with the pieces axis
    first: the values' 8 units and the output projection's 6 are hidden (`test_kappa` compares the path norm, κ and
    DDP-SGD's κ with one kernel per piece). Where the output is read otherwise too, its pieces are not cut apart,
    and ``describe`` says so and what to do. Before, the pieces shared the heads axis in every case, so the pinned
    queries and keys pinned the values."""
    x = jax.random.normal(jax.random.key(1), (2, 5, 6))
    for layout in ("neox", "heads_first", "pieces_first"):
        for extra in (False, True):
            model = _QKV(layout, extra)
            params = model.init(jax.random.key(0), x)["params"]
            space = pj.trace(lambda p, x, m=model: m.apply({"params": p}, x), params, x)
            if not extra:
                assert space.num_hidden == 8 + 6, layout
                assert sorted(g.size for g in space.groups if g.kind == "pinned") == [8, 8], layout
            elif layout != "pieces_first":  # (there a sum over the pieces axis reads them)
                assert space.num_hidden == 6, layout
                what = "reshaped output" if layout == "neox" else "kernel's output (plus its bias)"
                assert f"read the {what} only in whole pieces" in " ".join(pj.describe(space).split())


def test_values_computed_and_dropped_pin_nothing():
    """A value the function computes and drops (a statistic a model computes for a log, a head whose output is not
    returned) is not part of the network: ``tanh(h)`` dropped does not pin h, and a leaf that only such values read
    is "other", saying so (no error, as for a leaf that nothing reads). Before, the dropped tanh pinned h (H 0)."""
    ks = jax.random.split(jax.random.key(3), 4)
    x = jax.random.normal(ks[0], (6, 3))
    p = {"a": jax.random.normal(ks[1], (3, 4)), "aux": jax.random.normal(ks[2], (4, 2)),
         "b": jax.random.normal(ks[3], (4, 2))}  # fmt: skip

    def fn(p, x):
        h = x @ p["a"]
        jnp.tanh(h).mean(), jax.nn.relu(h) @ p["aux"]  # (computed, dropped)
        return jax.nn.relu(h) @ p["b"]

    space = pj.trace(fn, p, x)
    assert space.num_hidden == 4
    assert [leaf.kind for leaf in space.leaves] == ["weight", "other", "weight"]
    assert "read only by values fn computes and drops" in " ".join(pj.describe(space).split())
    loss = lambda p, x: jnp.sum(fn(p, x) ** 2)  # noqa: E731
    for tx in (pj.g_sgd(space, 0.01), pj.path_sgd(space, 0.01)):
        pj.testing.assert_update_invariant(tx, loss, space, p, x, num_steps=2, rtol=1e-9)


def _frozen_first_layer(n_in: int, n_frozen: int):
    """``relu(relu(x @ stop_gradient(w1)) @ w2) @ w3``, its params, a batch and its space."""
    k = jax.random.split(jax.random.key(0), 4)
    p = {"w1": jax.random.normal(k[0], (n_in, n_frozen)), "w2": jax.random.normal(k[1], (n_frozen, 5)),
         "w3": jax.random.normal(k[2], (5, 2))}  # fmt: skip
    fn = lambda p, x: jax.nn.relu(jax.nn.relu(x @ jax.lax.stop_gradient(p["w1"])) @ p["w2"]) @ p["w3"]  # noqa: E731
    x = jax.random.normal(k[3], (6, n_in))
    space = pj.trace(fn, p, x)
    assert space.num_hidden == 5 and [leaf.kind for leaf in space.leaves] == ["other", "weight", "weight"]
    return fn, p, x, space


def test_a_layer_frozen_by_stop_gradient_is_no_edge_and_stays_frozen():
    """``x @ stop_gradient(w1)``: the frozen layer is fixed coefficients ("other", said so), the optimisers leave it
    as it is, and the layers after it are rescaled as usual."""
    fn, p, x, space = _frozen_first_layer(3, 4)
    assert "held fixed (a frozen layer)" in pj.describe(space)
    loss = lambda p, x: jnp.sum(fn(p, x) ** 2)  # noqa: E731
    for tx in (pj.g_sgd(space, 0.01), pj.path_sgd(space, 0.01)):
        updates, _ = tx.update(jax.grad(loss)(p, x), tx.init(p), p)
        assert not np.any(updates["w1"]) and np.any(updates["w2"])
        pj.testing.assert_update_invariant(tx, loss, space, p, x, num_steps=2, rtol=1e-9)


@pytest.mark.parametrize("name", list(_NOT_HOMOGENEOUS))
def test_other_activations_pin_their_group(name):
    fn, params, x = _two_layer(_NOT_HOMOGENEOUS[name])
    space = pj.trace(fn, params, x)
    assert space.num_hidden == 0
    (pinned,) = [g for g in space.groups if g.kind == "pinned"]
    assert pinned.size == 4 and pinned.reasons
    with pytest.raises(pj.UnsupportedModelError, match="l1/w"):
        pj.trace(fn, params, x, strict=True)


def test_grouped_conv_on_the_inputs_keeps_its_groups_apart():
    """Two groups on a two-channel input: input channel g feeds output channels 2g and 2g + 1 only."""

    class G(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Conv(4, (3,), feature_group_count=2)(x))
            x = nn.relu(nn.Conv(3, (3,))(x))
            return nn.Dense(2)(x.reshape(x.shape[0], -1))

    x = jnp.ones((2, 6, 2))
    params = G().init(jax.random.key(0), x)["params"]
    fn = lambda p, x: G().apply({"params": p}, x)  # noqa: E731
    space = pj.trace(fn, params, x, strict=True)
    assert space.num_hidden == 4 + 3
    (kernel,) = [leaf for leaf in space.leaves if leaf.path == "Conv_0/kernel"]  # (tap, in, out): 3 x 1 x 4
    assert reduced(kernel.src)[0].ravel().tolist() == [1, 1, 2, 2]  # node 0 is the bias node, then the inputs
    pj.testing.assert_function_invariant(fn, space, params, jax.random.normal(jax.random.key(1), x.shape))


def test_batchnorm_in_eval_mode_pins_and_keeps_the_rest():
    class B(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.BatchNorm(use_running_average=True)(nn.Dense(5)(x)))
            x = nn.relu(nn.Dense(4)(x))
            return nn.Dense(2)(x)

    x = jnp.ones((3, 3))
    variables = B().init(jax.random.key(0), x)
    stats = jax.tree_util.tree_map(lambda a: a + 0.5, variables["batch_stats"])
    fn = lambda p, x: B().apply({"params": p, "batch_stats": stats}, x)  # noqa: E731
    space = pj.trace(fn, variables["params"], x)
    assert space.num_hidden == 4
    assert {leaf.path: leaf.kind for leaf in space.leaves}["BatchNorm_0/scale"] == "other"
    pj.testing.assert_function_invariant(fn, space, variables["params"], jax.random.normal(jax.random.key(1), x.shape))


class _ReshapedInputCNN(nn.Module):
    """A CNN on flat (b, 64) inputs, reshaped to (b, 8, 8, 1) inside the model."""

    reshape: bool = True

    @nn.compact
    def __call__(self, x):
        if self.reshape:
            x = x.reshape(x.shape[0], 8, 8, 1)
        h = nn.relu(nn.Conv(4, (3, 3))(x))
        return nn.Dense(3)(h.reshape(h.shape[0], -1))


@pytest.mark.slow
def test_input_reshaped_to_a_channel_axis_stays_an_input():
    model = _ReshapedInputCNN()
    x = jax.random.normal(jax.random.key(0), (5, 64), jnp.float64)
    params = model.init(jax.random.key(1), x)["params"]
    fn = lambda p, x: model.apply({"params": p}, x)
    space = pj.trace(fn, params, x)
    assert [(g.size, g.kind) for g in space.groups] == [(1, "input"), (4, "hidden"), (3, "output")]
    pj.testing.assert_function_invariant(fn, space, params, x)
    pj.g_sgd(space, 0.1).init(params)  # a skeleton exists (it did not when the channel node was 'hidden')
    # the same network fed the images directly
    images = x.reshape(5, 8, 8, 1)
    direct = _ReshapedInputCNN(reshape=False)
    other = pj.trace(lambda p, x: direct.apply({"params": p}, x), params, images)
    np.testing.assert_allclose(pj.path_norm(space, params), pj.path_norm(other, params), rtol=1e-12)


def test_hidden_layer_reshaped_to_a_new_channel_axis_is_pinned_not_rescaled():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.relu(nn.Dense(64)(x)).reshape(x.shape[0], 8, 8, 1)
            h = nn.relu(nn.Conv(4, (3, 3))(h))
            return nn.Dense(3)(h.reshape(h.shape[0], -1))

    model = Net()
    x = jax.random.normal(jax.random.key(0), (5, 10), jnp.float64)
    params = model.init(jax.random.key(1), x)["params"]
    fn = lambda p, x: model.apply({"params": p}, x)
    space = pj.trace(fn, params, x)
    g0 = space.groups[0]
    assert (g0.size, g0.kind) == (1, "pinned") and "no parameter edge enters" in g0.reasons[-1]
    pj.testing.assert_function_invariant(fn, space, params, x)  # the unit channel node was rescaled before


@pytest.mark.parametrize("fused", [True, False])
def test_activations_from_parameters_that_are_not_edges_are_a_pinned_group(fused):
    """A layer reading activations computed from the inputs with parameters that are not edges (a kernel
    concatenated from two parameters, as Flax's fast LSTM builds its gates) is an edge from a pinned group, as it is
    when the kernel is one parameter; it was labelled a bias (edges from the constant node) and G-SGD diverged."""

    def fn(p, x):
        k = jnp.concatenate([p["a"], p["b"]], 1) if fused else p["k"]
        z = jax.nn.relu(jnp.tanh(x @ k) @ p["w1"] + p["b1"])
        return z @ p["w2"]

    ks = jax.random.split(jax.random.key(0), 5)
    a, b = jax.random.normal(ks[0], (4, 8), jnp.float64), jax.random.normal(ks[1], (4, 8), jnp.float64)
    params = {"w1": jax.random.normal(ks[2], (16, 8), jnp.float64), "b1": jnp.zeros(8, jnp.float64),
              "w2": jax.random.normal(ks[3], (8, 3), jnp.float64)}  # fmt: skip
    params.update({"a": a, "b": b} if fused else {"k": jnp.concatenate([a, b], 1)})
    x = jax.random.normal(ks[4], (5, 4), jnp.float64)
    space = pj.trace(fn, params, x)
    w1 = next(leaf for leaf in space.leaves if leaf.path == "w1")
    assert w1.kind == "weight"
    (src,) = w1.src_groups
    assert (space.groups[src].size, space.groups[src].kind) == (16, "pinned")
    assert space.num_hidden == 8
    pj.testing.assert_function_invariant(fn, space, params, x)


def test_a_space_without_hidden_nodes_says_so_and_the_optimisers_warn():
    """A ResNet-style CNN with BatchNorm (running statistics) after every convolution has no rescalable unit: H = 0
    and every path-space optimiser is its plain form. `describe` says so in its first line, and constructing an
    optimiser warns at the user's line; a network with hidden nodes stays silent."""

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.relu(nn.BatchNorm(use_running_average=True)(nn.Conv(4, (3, 3))(x)))
            return nn.relu(x + nn.BatchNorm(use_running_average=True)(nn.Conv(4, (3, 3))(h)))

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.BatchNorm(use_running_average=True)(nn.Conv(4, (3, 3))(x)))
            return nn.Dense(3)(Block()(x).mean((1, 2)))

    x = jax.random.normal(jax.random.key(0), (2, 6, 6, 1))
    variables = Net().init(jax.random.key(1), x)
    fn = lambda p, x: Net().apply({"params": p, "batch_stats": variables["batch_stats"]}, x)  # noqa: E731
    space = pj.trace(fn, variables["params"], x)
    assert space.num_hidden == 0
    assert "NO hidden node can be rescaled" in pj.describe(space).splitlines()[0]
    makers = (
        lambda: pj.g_sgd(space, 0.1),
        lambda: pj.path_sgd(space, 0.1),
        lambda: pj.ddp_sgd(space, 0.1, alpha=0.5),
        lambda: pj.in_path_space(optax.adam(1e-3), space),
    )
    for make in makers:
        with pytest.warns(UserWarning, match="reduces to its plain form") as record:
            make()
        assert record[0].filename == __file__
    mlp = ZOO["mlp"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pj.g_sgd(pj.trace(mlp.fn, mlp.params, mlp.inputs(2)), 0.1)


def test_the_optimisers_warn_where_most_parameters_are_no_edge_unless_they_are_frozen():
    """An LSTM with a ReLU head: its kernels, concatenated into the fused gates, are fixed coefficients ("other"), so
    every optimiser applies its plain update to most of the network: it says so at the user's line, naming the
    leaves and why. A network whose largest layer is frozen by ``stop_gradient`` (no gradient: nothing to say) stays
    silent."""
    lstm = ZOO["fused_lstm_relu_head"]
    space = pj.trace(lstm.fn, lstm.params, lstm.inputs(2))
    assert 2 * sum(leaf.size for leaf in space.leaves if leaf.kind == "other") > space.num_params > 0
    makers = (lambda: pj.g_sgd(space, 0.1), lambda: pj.path_sgd(space, 0.1), lambda: pj.ddp_sgd(space, 0.1, alpha=0.5))
    for make in makers:
        with pytest.warns(UserWarning, match=r"parameters are in leaves that are no edge .*concatenated") as record:
            make()
        assert record[0].filename == __file__
    frozen = _frozen_first_layer(30, 40)[3]  # w1: 1200 of 1410 parameters
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pj.path_sgd(frozen, 0.1)


def test_every_pinned_group_of_the_zoo_says_what_the_user_can_do():
    """`describe` and ``strict=True`` follow each pinned group's reasons with a hint (`graph.PIN_HINTS`)."""
    from pathspace_jax.graph import pin_hint

    for case in ZOO.values():
        space = pj.trace(case.fn, case.params, case.inputs(2))
        for g in space.groups:
            if g.kind == "pinned":
                hint = pin_hint(g.reasons)
                assert hint, (case.name, g.reasons)
                assert f"what you can do: {hint[:40]}" in " ".join(pj.describe(space).split()), case.name
