"""Random numbers inside the traced function (issue 76): dropout, a VAE's noise, a decoder sampling its next input.

A random draw from a key the function is given (an argument, closed over, or drawn by ``make_rng``) is a value of the
inputs alone: the structure is the deterministic network's, Path-SGD's κ takes every draw as a gate of value 1 (the
network with every unit kept), and DDP-SGD's statistics run the function with the draws it makes.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pathspace_jax as pj

F64 = jnp.float64


class _DropMLP(nn.Module):
    @nn.compact
    def __call__(self, x, deterministic):
        x = nn.relu(nn.Dense(8)(x))
        x = nn.Dropout(0.3)(x, deterministic=deterministic)
        x = nn.relu(nn.Dense(6)(x))
        x = nn.Dropout(0.5)(x, deterministic=deterministic)
        return nn.Dense(3)(x)


class _DropCNN(nn.Module):
    @nn.compact
    def __call__(self, x, deterministic):
        x = nn.relu(nn.Conv(4, (3, 3))(x))
        x = nn.Dropout(0.2, broadcast_dims=(1, 2))(x, deterministic=deterministic)  # whole channels
        x = nn.avg_pool(x, (2, 2), (2, 2)).reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(6)(x))
        x = nn.Dropout(0.5)(x, deterministic=deterministic)
        return nn.Dense(3)(x)


def _scaled_mlp(p, x):
    """`_DropMLP` with every unit kept: the definition Path-SGD's κ of the dropout network is checked against."""
    d = lambda name, h: h @ p[name]["kernel"] + p[name]["bias"]  # noqa: E731
    h = jax.nn.relu(d("Dense_0", x)) / 0.7
    h = jax.nn.relu(d("Dense_1", h)) / 0.5
    return d("Dense_2", h)


def _drop_case(cls, xshape):
    model = cls()
    x = jax.random.normal(jax.random.key(0), xshape, F64)
    params = jax.tree.map(lambda a: a.astype(F64), model.init(jax.random.key(1), x, True)["params"])

    def on(p, x, key):
        return model.apply({"params": p}, x, False, rngs={"dropout": key})

    return model, params, x, on, lambda p, x: model.apply({"params": p}, x, True)


def _structure(space):
    groups = [(g.size, g.kind, g.offset) for g in space.groups]
    leaves = [(leaf.path, leaf.kind, leaf.src_groups, leaf.dst_groups, leaf.src.tolist(), leaf.dst.tolist())
              for leaf in space.leaves]  # fmt: skip
    return groups, leaves, space.num_nodes


@pytest.mark.parametrize("cls, xshape", [(_DropMLP, (4, 5)), (_DropCNN, (2, 6, 6, 2))])
def test_dropout_traces_as_the_deterministic_network(cls, xshape):
    _, params, x, on, det = _drop_case(cls, xshape)
    space_det = pj.trace(det, params, x, strict=True)
    for space in (
        pj.trace(on, params, x, jax.random.key(3), strict=True),  # the key an argument
        pj.trace(lambda p, x: on(p, x, jax.random.key(4)), params, x, strict=True),  # closed over
    ):
        assert space.num_hidden == space_det.num_hidden > 0
        assert _structure(space) == _structure(space_det)
        for a, b in zip(pj.basis_paths(space), pj.basis_paths(space_det), strict=True):
            np.testing.assert_array_equal(a, b)
        _leafwise_close(pj.to_coords(space, params), pj.to_coords(space_det, params), rtol=0)


def _leafwise_close(a, b, **kw):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), **kw)


def test_path_kappa_of_dropout_is_the_network_with_every_unit_kept():
    """κ and the path norm do not depend on the draw: every draw is a gate of value 1, so the dropout layers keep every
    unit, scaled by 1/keep (squared in γ²) as Flax's Dropout scales them; checked against that network written out."""
    _, params, x, on, det = _drop_case(_DropMLP, (4, 5))
    spaces = [pj.trace(on, params, x, jax.random.key(k)) for k in (3, 8)]
    spaces += [pj.trace(lambda p, x, k=k: on(p, x, jax.random.key(k)), params, x) for k in (3, 8)]
    ref = pj.path_kappa(pj.trace(_scaled_mlp, params, x, strict=True), params)
    kd = pj.path_kappa(pj.trace(det, params, x), params)
    for space in spaces:
        kappa = pj.path_kappa(space, params)
        _leafwise_close(kappa, ref, rtol=1e-12)
        # the deterministic network's κ times 1/keep² for each dropout layer that every path through the leaf crosses
        _leafwise_close(kappa["Dense_0"], jax.tree.map(lambda k: k / (0.7**2 * 0.5**2), kd["Dense_0"]), rtol=1e-12)
        np.testing.assert_allclose(kappa["Dense_1"]["bias"], kd["Dense_1"]["bias"] / 0.5**2, rtol=1e-12)
        np.testing.assert_allclose(pj.path_norm(space, params), pj.path_norm(pj.trace(_scaled_mlp, params, x), params),
                                   rtol=1e-12)  # fmt: skip
    # DDP at α = 0 is Path-SGD's κ: the same |·|^p network, the draws not computed
    keys = jax.random.split(jax.random.key(5), 4)
    per_example = pj.trace(lambda p, x, k: on(p, x, k[0]), params, x, keys)
    _leafwise_close(pj.ddp_kappa(per_example, params, (x, keys), alpha=0.0), ref, rtol=1e-12)


def test_nnx_dropout_drawing_from_an_rngs_stream_passed_as_state():
    """nnx.Dropout draws from the nnx.Rngs stream in the state passed as an argument (its key and count): the
    structure is the deterministic model's, κ the deterministic κ times 1/keep² where paths cross the dropout."""
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.l1, self.l2 = nnx.Linear(5, 8, rngs=rngs), nnx.Linear(8, 3, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.l2(self.drop(nnx.relu(self.l1(x))))

    model, x = Net(nnx.Rngs(0, dropout=1)), jnp.ones((4, 5))
    spaces = []
    for deterministic in (False, True):
        model.drop.deterministic = deterministic
        graph, params, rest = nnx.split(model, nnx.Param, ...)
        spaces.append(pj.trace(lambda p, x, r, g=graph: nnx.merge(g, p, r)(x), params, x, rest, strict=True))
    assert _structure(spaces[0]) == _structure(spaces[1])
    k_on, k_off = (pj.path_kappa(s, params) for s in spaces)
    for path in (("l1", "kernel"), ("l1", "bias"), ("l2", "kernel")):
        np.testing.assert_allclose(k_on[path[0]][path[1]].value, k_off[path[0]][path[1]].value / 0.25, rtol=1e-6)
    np.testing.assert_array_equal(k_on["l2"]["bias"].value, k_off["l2"]["bias"].value)


class _VAE(nn.Module):
    """google/flax examples/vae's model, small: z = mean + eps · exp(logvar / 2), eps drawn per example from ``keys``
    or from the ``noise`` stream (``make_rng``)."""

    latent: int = 3

    def __call__(self, x, keys=None, cut=False):
        mean, logvar = self.encode(x)
        if keys is None:
            eps = jax.random.normal(self.make_rng("noise"), mean.shape, mean.dtype)
        else:
            eps = jax.vmap(lambda k, m: jax.random.normal(k, m.shape, m.dtype))(keys, mean)
        z = mean + eps * jnp.exp(0.5 * logvar)
        return self.decode(jax.lax.stop_gradient(z) if cut else z), mean, logvar

    def setup(self):
        self.e1, self.mean, self.logvar = nn.Dense(8), nn.Dense(self.latent), nn.Dense(self.latent)
        self.d1, self.d2 = nn.Dense(8), nn.Dense(6)

    def encode(self, x):
        h = nn.relu(self.e1(x))
        return self.mean(h), self.logvar(h)

    def decode(self, z):
        return self.d2(nn.relu(self.d1(z)))


def _vae_loss(out, x):
    logits, mean, logvar = out
    bce = jnp.sum(optax.sigmoid_binary_cross_entropy(logits, x), -1)
    kl = -0.5 * jnp.sum(1 + logvar - mean**2 - jnp.exp(logvar), -1)
    return jnp.mean(bce + kl)


def _vae_case(batch=6, dtype=F64):
    model = _VAE()
    x = (jax.random.uniform(jax.random.key(0), (batch, 6)) > 0.5).astype(dtype)
    keys = jax.random.split(jax.random.key(5), batch)
    params = model.init({"params": jax.random.key(1), "noise": jax.random.key(2)}, x)["params"]
    return model, jax.tree.map(lambda a: a.astype(dtype), params), x, keys


def test_vae_kappa_ends_paths_at_mean_and_logvar_and_starts_them_at_the_sample():
    """The noise is a value of the inputs: κ of the VAE is the encoder's (paths end at mean and logvar, pinned by the
    exp) beside the decoder's, whose paths start at z as at an input; the same for every key."""
    model, params, x, keys = _vae_case()
    enc = {k: params[k] for k in ("e1", "mean", "logvar")}
    dec = {k: params[k] for k in ("d1", "d2")}
    k_enc = pj.path_kappa(pj.trace(lambda p, x: model.apply({"params": {**p, **dec}}, x, method="encode"), enc, x),
                          enc)  # fmt: skip
    z = jnp.ones((x.shape[0], 3), F64)
    k_dec = pj.path_kappa(pj.trace(lambda p, z: model.apply({"params": {**enc, **p}}, z, method="decode"), dec, z),
                          dec)  # fmt: skip
    spaces = [pj.trace(lambda p, x, k: model.apply({"params": p}, x, k), params, x, keys)]
    spaces += [pj.trace(lambda p, x, s=s: model.apply({"params": p}, x, rngs={"noise": jax.random.key(s)}), params, x)
               for s in (7, 9)]  # fmt: skip
    for space in spaces:
        _leafwise_close(pj.path_kappa(space, params), {**k_enc, **k_dec}, rtol=1e-12)


def test_ddp_kappa_at_alpha_one_uses_the_draws_the_function_makes():
    """α = 1: κ = mean_i Σ_out (∂f_out(x_i)/∂w)², each example run alone with the draws the function makes from its
    inputs: here its own key, the same eps as the loss's. The sample z is a boundary value (computed from mean and
    logvar, pinned by the exp): the decoder's outputs are differentiated with z held, as DDP holds every boundary."""
    model, params, x, keys = _vae_case()
    fn = lambda p, x, k: model.apply({"params": p}, x, k)  # noqa: E731
    space = pj.trace(fn, params, x, keys)
    kappa = pj.ddp_kappa(space, params, (x, keys), alpha=1.0)

    def per_example(i):
        def outs(p):
            return jnp.concatenate([o.ravel() for o in model.apply({"params": p}, x[i : i + 1], keys[i : i + 1], True)])

        jac = jax.jacrev(outs)(params)
        return jax.tree.map(lambda j: jnp.sum(j * j, axis=0), jac)

    ref = jax.tree.map(lambda *a: sum(a) / len(a), *[per_example(i) for i in range(x.shape[0])])
    _leafwise_close(kappa, ref, rtol=1e-10, atol=1e-14)
    other = jax.random.split(jax.random.key(6), x.shape[0])
    changed = pj.ddp_kappa(space, params, (x, other), alpha=1.0)
    assert not np.allclose(changed["d1"]["kernel"], kappa["d1"]["kernel"])  # the draws are the keys'


class _Sampler(nn.Module):
    """A ReLU RNN decoder that feeds back a token sampled from its logits (``jax.random.categorical``), in a Python
    loop or, with ``scan``, in ``nn.scan``; with ``teacher``, it reads the tokens after the first from its input."""

    vocab: int = 4
    hidden: int = 6
    steps: int = 3
    scan: bool = False

    @nn.compact
    def __call__(self, x, tok, key, teacher=None):
        cell, out = nn.SimpleCell(self.hidden, activation_fn=nn.relu), nn.Dense(self.vocab)
        h = nn.relu(nn.Dense(self.hidden)(x))  # the state from a context x; tok: the first token, one-hot
        if self.scan:
            step = nn.scan(_Step, variable_broadcast="params", split_rngs={"params": False}, length=self.steps)
            return jnp.swapaxes(step(self.hidden, self.vocab)((h, tok, key), None)[1], 0, 1)
        logits = []
        for t in range(self.steps):
            h, _ = cell(h, tok)
            logits.append(out(h))
            if teacher is None:
                key, sub = jax.random.split(key)
                tok = jax.nn.one_hot(jax.random.categorical(sub, logits[-1]), self.vocab, dtype=x.dtype)
            elif t + 1 < self.steps:
                tok = teacher[:, t]
        return jnp.stack(logits, 1)


class _Step(nn.Module):
    hidden: int
    vocab: int

    @nn.compact
    def __call__(self, carry, _):
        h, tok, key = carry
        h, _ = nn.SimpleCell(self.hidden, activation_fn=nn.relu)(h, tok)
        logits = nn.Dense(self.vocab)(h)
        key, sub = jax.random.split(key)
        return (h, jax.nn.one_hot(jax.random.categorical(sub, logits), self.vocab, dtype=h.dtype), key), logits


def test_a_sampled_token_fed_back_enters_as_an_input():
    """The sampled one-hot is computed from the logits (pinned: the noise is added to them) and the key alone: in κ's
    |·|^p network it is a boundary value 1, as the same decoder's teacher-forced tokens are."""
    model = _Sampler()
    x, tok = jax.random.normal(jax.random.key(0), (3, 5), F64), jax.nn.one_hot(jnp.arange(3) % 4, 4, dtype=F64)
    params = model.init(jax.random.key(1), x, tok, jax.random.key(2))["params"]
    params = jax.tree.map(lambda a: a.astype(F64), params)
    teacher = jnp.ones((3, model.steps - 1, model.vocab), F64)
    forced = pj.trace(lambda p, x, tok, t: model.apply({"params": p}, x, tok, None, t), params, x, tok, teacher)
    ref = pj.path_kappa(forced, params, second_order=False)  # (the loop reads the cell's kernels at every step)
    for space in (
        pj.trace(lambda p, x, tok, k: model.apply({"params": p}, x, tok, k), params, x, tok, jax.random.key(3)),
        pj.trace(lambda p, x, tok: model.apply({"params": p}, x, tok, jax.random.key(4)), params, x, tok),
    ):
        assert space.num_hidden == forced.num_hidden > 0
        _leafwise_close(pj.path_kappa(space, params, second_order=False), ref, rtol=1e-12)


def test_random_numbers_that_multiply_parameters_are_refused_by_name():
    """DropConnect multiplies the weights themselves by a draw: κ refuses it, naming the line; G-SGD takes it."""
    k = jax.random.split(jax.random.key(0), 2)
    params = {"w1": jax.random.normal(k[0], (4, 6)), "b1": jnp.zeros(6), "w2": jax.random.normal(k[1], (6, 2))}

    def fn(p, x, key):
        mask = jax.random.bernoulli(key, 0.5, p["w1"].shape)
        return jax.nn.relu(x @ (p["w1"] * mask / 0.5) + p["b1"]) @ p["w2"]

    space = pj.trace(fn, params, jnp.ones((3, 4)), jax.random.key(1))
    why = r"mul at tests/test_random.py:\d+ .* multiplies parameters by random numbers"
    with pytest.raises(pj.PathKappaUnsupportedError, match=why):
        pj.path_kappa(space, params)
    assert np.isfinite(pj.to_coords(space, params)["w1"]).all()


# ----------------------------------------------------------------------------- training


def _steps(tx, loss, params, batches, extra):
    @jax.jit
    def step(p, s, batch):
        val, g = jax.value_and_grad(loss)(p, *batch)
        u, s = tx.update(g, s, p, **extra(batch))
        return optax.apply_updates(p, u), s, val

    state, losses = tx.init(params), []
    for batch in batches:
        params, state, val = step(params, state, batch)
        losses.append(float(val))
    return params, losses


def _trains(losses):
    assert np.all(np.isfinite(losses)), losses
    assert np.mean(losses[-5:]) < np.mean(losses[:5]), losses


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["path_sgd", "ddp_sgd", "g_sgd"])
def test_training_with_dropout_and_a_vae(algo):
    """20 jitted steps on a dropout MLP (a fresh key per step: Path-SGD and G-SGD read it as an argument; DDP-SGD's
    statistics draw from the key the traced function closes over) and on the VAE (one key per example, an input)."""
    make = {"path_sgd": lambda s: pj.path_sgd(s, 0.1), "ddp_sgd": lambda s: pj.ddp_sgd(s, 0.1, alpha=1.0),
            "g_sgd": lambda s: pj.g_sgd(s, 0.1)}[algo]  # fmt: skip
    model, params, x, on, _ = _drop_case(_DropMLP, (32, 5))
    params, x = jax.tree.map(lambda a: a.astype(jnp.float32), (params, x))
    y = jnp.stack([x[:, 0] - x[:, 1], jnp.abs(x[:, 2]), x[:, 3] * 0.5], 1)
    keys = [jax.random.key(100 + i) for i in range(20)]
    if algo == "ddp_sgd":
        space = pj.trace(lambda p, x: on(p, x, jax.random.key(3)), params, x)
        extra = lambda b: {"inputs": b[0]}  # noqa: E731
    else:
        space = pj.trace(on, params, x, keys[0])
        extra = lambda b: {}  # noqa: E731
    mse = lambda p, x, k: jnp.mean((on(p, x, k) - y) ** 2)  # noqa: E731
    _trains(_steps(make(space), mse, params, [(x, k) for k in keys], extra)[1])

    vae, vp, vx, _ = _vae_case(batch=32, dtype=jnp.float32)
    fn = lambda p, x, ks: vae.apply({"params": p}, x, ks)  # noqa: E731
    space = pj.trace(fn, vp, vx, jax.random.split(jax.random.key(0), 32))
    batches = [(vx, jax.random.split(jax.random.key(200 + i), 32)) for i in range(20)]
    loss = lambda p, x, ks: _vae_loss(fn(p, x, ks), x)  # noqa: E731
    _trains(_steps(make(space), loss, vp, batches, lambda b: {"inputs": b})[1])


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["path_sgd", "ddp_sgd", "g_sgd"])
def test_training_a_decoder_that_samples_its_next_input(algo):
    model = _Sampler(scan=True)
    x, tok = jax.random.normal(jax.random.key(0), (32, 5)), jax.nn.one_hot(jnp.arange(32) % 4, 4)
    params = model.init(jax.random.key(1), x, tok, jax.random.key(2))["params"]
    targets = jax.random.randint(jax.random.key(3), (32, model.steps), 0, model.vocab)
    keys = [jax.random.key(100 + i) for i in range(20)]
    if algo == "ddp_sgd":
        space = pj.trace(lambda p, x, tok: model.apply({"params": p}, x, tok, jax.random.key(3)), params, x, tok)
        tx, extra = pj.ddp_sgd(space, 0.1, alpha=1.0), lambda b: {"inputs": (b[0], b[1])}
    else:
        space = pj.trace(lambda p, x, tok, k: model.apply({"params": p}, x, tok, k), params, x, tok, keys[0])
        tx, extra = (pj.path_sgd(space, 0.1) if algo == "path_sgd" else pj.g_sgd(space, 0.1)), lambda b: {}

    def loss(p, x, tok, k):
        logits = model.apply({"params": p}, x, tok, k)
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets))

    _trains(_steps(tx, loss, params, [(x, tok, k) for k in keys], extra)[1])
