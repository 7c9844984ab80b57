"""Every transformation in a real nnx training loop: ``nnx.Optimizer`` inside ``nnx.jit``.

``nnx.Optimizer`` calls ``tx.init`` on the ``nnx.State`` of ``nnx.Param`` variables (the structure that
was traced) but ``tx.update`` on ``nnx.as_pure`` states (plain arrays, no ``Variable`` wrappers). The
loop must accept both and give, step for step, the same params as the functional loop over the traced
state.
"""

from __future__ import annotations

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx, struct
from flax.training import train_state

import pathspace_jax as pj
from pathspace_jax.kappa import RankOne


def _is_rank_one(k) -> bool:
    return isinstance(k, RankOne)


class _MLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(4, 8, rngs=rngs)
        self.l2 = nnx.Linear(8, 6, rngs=rngs)
        self.l3 = nnx.Linear(6, 3, rngs=rngs)

    def __call__(self, x):
        return self.l3(jax.nn.relu(self.l2(jax.nn.relu(self.l1(x)))))


_X = jax.random.normal(jax.random.key(0), (16, 4), jnp.float32)
_Y = jnp.arange(16) % 3
_TXS = {
    "g_sgd": (lambda space: pj.g_sgd(space, 0.05, momentum=0.9), False),
    "g_adam": (lambda space: pj.g_adam(space, 1e-2), False),
    "path_sgd": (lambda space: pj.path_sgd(space, 0.05), False),
    "ddp_sgd": (lambda space: pj.ddp_sgd(space, 0.05, alpha=0.5), True),
}
# and one whose state keeps κ (`pathspace_jax.scaling.PackedKappa`, a pytree that nnx wraps leaf by leaf)
_NNX_TXS = {**_TXS, "path_sgd_every3": (lambda space: pj.path_sgd(space, 0.05, every=3), False)}


def _loss(model, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(_NNX_TXS))
def test_nnx_optimizer_matches_the_functional_loop(name):
    make, needs_inputs = _NNX_TXS[name]
    model = _MLP(nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    space = pj.trace(lambda p, x: nnx.merge(graphdef, p)(x), params, _X)
    params = pj.skeleton_init(space, params)  # G-SGD's start (A = B = ±1); the same start for all
    nnx.update(model, params)
    tx = make(space)
    kw = {"inputs": _X} if needs_inputs else {}

    # nnx: the optimizer owns the state, updates the model in place
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def nnx_step(model, opt):
        loss, grads = nnx.value_and_grad(_loss)(model, _X, _Y)
        opt.update(model, grads, **kw)
        return loss

    # functional: the traced nnx.State of params through tx.init / tx.update / optax.apply_updates
    @jax.jit
    def step(p, s):
        g = jax.grad(lambda p: _loss(nnx.merge(graphdef, p), _X, _Y))(p)
        u, s = tx.update(g, s, p, **kw)
        return optax.apply_updates(p, u), s

    p, s = params, tx.init(params)
    losses = []
    for _ in range(5):
        losses.append(float(nnx_step(model, opt)))
        p, s = step(p, s)
    chex.assert_trees_all_close(nnx.state(model, nnx.Param), p, rtol=1e-5, atol=1e-6)
    assert losses[-1] < losses[0]
    assert not np.allclose(nnx.state(model, nnx.Param)["l1"]["kernel"][...], params["l1"]["kernel"][...])


def test_pure_state_and_structure_errors():
    """The path-space maps take pure states and return their structure; other trees get a clear error."""
    graphdef, params = nnx.split(_MLP(nnx.Rngs(0)), nnx.Param)
    space = pj.trace(lambda p, x: nnx.merge(graphdef, p)(x), params, _X)
    pure = nnx.as_pure(params)
    assert jax.tree_util.tree_structure(pure) != jax.tree_util.tree_structure(params)
    c = pj.to_coords(space, pure)
    assert jax.tree_util.tree_structure(c) == jax.tree_util.tree_structure(pure)
    chex.assert_trees_all_equal(c, nnx.as_pure(pj.to_coords(space, params)))
    chex.assert_trees_all_equal(pj.path_kappa(space, pure), nnx.as_pure(pj.path_kappa(space, params)))

    renamed = {"a" + k: v for k, v in nnx.to_pure_dict(pure).items()}
    with pytest.raises(ValueError, match="leaves of the params"):
        pj.to_coords(space, renamed)
    shorter = nnx.to_pure_dict(pure)
    del shorter["l3"]
    with pytest.raises(ValueError, match="leaves of the params"):
        pj.g_sgd(space, 0.1).update(shorter, optax.EmptyState(), shorter)


@pytest.mark.slow
def test_optax_inject_hyperparams():
    """``optax.inject_hyperparams`` turns every numeric argument into a (traced) array: the learning rate
    in the state then acts like the constant, and DDP's program-selecting arguments get a clear error."""
    graphdef, params = nnx.split(_MLP(nnx.Rngs(0)), nnx.Param)
    space = pj.trace(lambda p, x: nnx.merge(graphdef, p)(x), params, _X)
    params = nnx.as_pure(pj.skeleton_init(space, params))
    grads = jax.grad(lambda p: _loss(nnx.merge(graphdef, p), _X, _Y))(params)
    for name, (_, needs_inputs) in _TXS.items():
        kw = {"inputs": _X} if needs_inputs else {}
        factory = getattr(pj, name)
        extra = {"alpha": 0.5} if name == "ddp_sgd" else {}
        tx = factory(space, 0.05, **extra)
        injected = optax.inject_hyperparams(factory)(space, learning_rate=0.5, **extra)
        update = jax.jit(lambda g, s, p, tx=injected, kw=kw: tx.update(g, s, p, **kw))
        if name == "ddp_sgd":
            with pytest.raises(TypeError, match="static_args"):
                update(grads, injected.init(params), params)
            injected = optax.inject_hyperparams(factory, static_args=("alpha", "num_probes"))(
                space, learning_rate=0.5, **extra
            )
            update = jax.jit(lambda g, s, p, tx=injected, kw=kw: tx.update(g, s, p, **kw))
        state = injected.init(params)
        state.hyperparams["learning_rate"] = jnp.asarray(0.05, jnp.float32)
        want, _ = tx.update(grads, tx.init(params), params, **kw)  # 0.05 built in
        got, _ = update(grads, state, params)
        chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_flax_train_state_apply_gradients_passes_the_batch():
    """``pj.apply_gradients`` on a ``TrainState`` subclass: the same params as the functional DDP-SGD loop."""

    class State(train_state.TrainState):
        seen: int = struct.field(pytree_node=False, default=0)  # an extra field, kept

    model = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(3)])
    # float64: the jitted and the eager loop compile differently, which float32 on GPU shows at 1e-4
    params = jax.tree_util.tree_map(lambda a: a.astype(jnp.float64), model.init(jax.random.key(0), _X)["params"])
    space = pj.trace(lambda p, x: model.apply({"params": p}, x), params, _X)
    tx = pj.ddp_sgd(space, 0.05, alpha=0.5)

    def loss(p, x):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": p}, x), _Y).mean()

    state = State.create(apply_fn=model.apply, params=params, tx=tx, seen=7)
    step = jax.jit(lambda st, x: pj.apply_gradients(st, grads=jax.grad(loss)(st.params, x), inputs=x))
    p, s = params, tx.init(params)
    for i in range(3):
        x = _X + 0.1 * i
        state = step(state, x)
        u, s = tx.update(jax.grad(loss)(p, x), s, p, inputs=x)
        p = optax.apply_updates(p, u)
    assert int(state.step) == 3 and state.seen == 7
    chex.assert_trees_all_close(state.params, p, rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match="inputs=x"):  # what TrainState.apply_gradients cannot do
        state.apply_gradients(grads=jax.grad(loss)(state.params, _X))


@pytest.mark.parametrize("name", ["path_sgd", "ddp_sgd"])
def test_kept_kappa_round_trips_through_flax_serialization(name):
    """With ``every > 1`` the state keeps κ packed (`pathspace_jax.scaling.PackedKappa`): ``flax.serialization``
    saves it to bytes and restores it into a fresh state, and the restored run reuses the kept κ and goes on bit
    for bit (msgpack could not serialise the pytree class before it registered)."""
    from flax import serialization

    model = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(3)])
    params = model.init(jax.random.key(0), _X)["params"]
    space = pj.trace(lambda p, x: model.apply({"params": p}, x), params, _X)
    make = {"path_sgd": pj.path_sgd, "ddp_sgd": functools.partial(pj.ddp_sgd, alpha=0.5)}[name]
    tx = make(space, 0.05, momentum=0.9, every=3)
    kw = {"inputs": _X} if name == "ddp_sgd" else {}

    @jax.jit
    def step(p, s):
        u, s = tx.update(jax.grad(lambda p: jnp.sum(model.apply({"params": p}, _X) ** 2))(p), s, p, **kw)
        return optax.apply_updates(p, u), s

    p, s = step(*step(params, tx.init(params)))  # two steps: the kept κ is step 0's, reused at the next step
    restored = serialization.from_bytes(tx.init(params), serialization.to_bytes(s))
    chex.assert_trees_all_equal(restored, s)
    chex.assert_trees_all_equal(step(p, restored), step(p, s))


@pytest.mark.parametrize("name", ["path_sgd", "ddp_sgd"])
def test_kappa_kept_in_the_state_only_when_reused(name):
    """``every=1`` (a Python int, the default) keeps nothing of the params' size in the state; the step is the
    one of the same transform that stores κ (``every`` given as an array, as ``inject_hyperparams`` does)."""
    model = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(3)])
    params = jax.tree_util.tree_map(lambda a: a.astype(jnp.float64), model.init(jax.random.key(0), _X)["params"])
    space = pj.trace(lambda p, x: model.apply({"params": p}, x), params, _X)
    make = {"path_sgd": pj.path_sgd, "ddp_sgd": functools.partial(pj.ddp_sgd, alpha=0.5)}[name]
    kw = {"inputs": _X} if name == "ddp_sgd" else {}
    grads = jax.tree_util.tree_map(jnp.ones_like, params)
    steps = []
    for every in (1, jnp.asarray(1)):
        tx = make(space, 0.05, every=every)
        state = tx.init(params)
        u, new = jax.jit(lambda g, s, p, tx=tx: tx.update(g, s, p, **kw))(grads, state, params)
        kept = [s.kept.unpack().kappa for s in (state[0], new[0]) if s.kept is not None]
        kept = jax.tree_util.tree_leaves(kept, is_leaf=_is_rank_one)
        assert len(kept) == (0 if isinstance(every, int) else 2 * len(jax.tree_util.tree_leaves(params)))
        for k, p in zip(kept[len(kept) // 2 :], jax.tree_util.tree_leaves(params)):
            if name == "path_sgd" and p.ndim == 2:  # a dense kernel's κ is kept as two vectors, κ = a bᵀ
                assert isinstance(k, RankOne) and (k.a.shape, k.b.shape) == ((p.shape[0],), (p.shape[1],))
            else:
                assert k.shape == p.shape
        steps.append(u)
    chex.assert_trees_all_close(*steps, rtol=1e-12)


@pytest.mark.parametrize("name", ["path_sgd", "ddp_sgd"])
def test_refresh_kappa_schedules_kappa_outside_the_step(name):
    """``update(..., refresh_kappa=True/False)``, static in the jitted step, recomputes or reuses κ with no
    conditional in the compiled step, and a schedule of refreshes at steps 0, 3, ... trains exactly as
    ``every=3``, through the alias's ``optax.chain``. Misuse is an error that says what to do."""
    model = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(3)])
    params = jax.tree_util.tree_map(lambda a: a.astype(jnp.float64), model.init(jax.random.key(0), _X)["params"])
    space = pj.trace(lambda p, x: model.apply({"params": p}, x), params, _X)
    make = {"path_sgd": pj.path_sgd, "ddp_sgd": functools.partial(pj.ddp_sgd, alpha=0.5)}[name]
    kw = {"inputs": _X} if name == "ddp_sgd" else {}
    tx = make(space, 0.05, momentum=0.9, every=3)

    def loss(p):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": p}, _X), _Y).mean()

    @functools.partial(jax.jit, static_argnames="refresh")
    def step(p, s, refresh=None):
        extra = {} if refresh is None else {"refresh_kappa": refresh}
        u, s = tx.update(jax.grad(loss)(p), s, p, **kw, **extra)
        return optax.apply_updates(p, u), s

    def has_cond(refresh):
        return "cond[" in str(jax.make_jaxpr(functools.partial(step.__wrapped__, refresh=refresh))(params, state))

    state = tx.init(params)
    assert has_cond(None) and not has_cond(True) and not has_cond(False)
    a, sa, b, sb = params, state, params, state
    for t in range(7):
        a, sa = step(a, sa)
        b, sb = step(b, sb, refresh=t % 3 == 0)
        chex.assert_trees_all_close(b, a, rtol=1e-12, atol=0)
    assert int(optax.tree_utils.tree_get(sb, "count")) == 7

    every_step = make(space, 0.05)  # keeps no κ: refresh_kappa=True is its own step, False has nothing to reuse
    s1 = every_step.init(params)
    g = jax.grad(loss)(params)
    chex.assert_trees_all_close(
        every_step.update(g, s1, params, **kw, refresh_kappa=True), every_step.update(g, s1, params, **kw)
    )
    with pytest.raises(ValueError, match="every=k > 1"):
        every_step.update(g, s1, params, **kw, refresh_kappa=False)
    with pytest.raises(TypeError, match="static_argnames"):
        jax.jit(lambda r: tx.update(g, state, params, **kw, refresh_kappa=r))(True)
