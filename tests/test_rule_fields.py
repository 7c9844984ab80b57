"""A primitive the library has never seen, taught by one `pathspace_jax.rules` entry: the executors (the |·|^p
network, DDP's forward pass, DDP-Normalization) read what it is from its `Rule` fields, never from its name."""

from __future__ import annotations

import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

import pathspace_jax as pj
from pathspace_jax import rules

_FRESH = itertools.count()


def _relu_primitive() -> Primitive:
    """A fresh primitive computing ReLU (the rule table is global: a name of its own per test), registered as one:
    the identity on non-negative values (``relu``), evaluated as it is by the |·|^p network (``as_is``), and
    non-linear in a recurrence's carry but for that (``breaks_linearity``)."""
    relu_p = Primitive(f"pj_test_relu_{next(_FRESH)}_{id(object())}")
    relu_p.def_impl(lambda x: jnp.maximum(x, 0))
    relu_p.def_abstract_eval(lambda aval: aval)
    mlir.register_lowering(relu_p, mlir.lower_fun(lambda x: jnp.maximum(x, 0), multiple_results=False))
    ad.defjvp(relu_p, lambda g, x: jnp.where(x > 0, g, jnp.zeros_like(g)))
    batching.defvectorized(relu_p)
    rules.register(relu_p.name, rules.Rule("relabel", as_is=True, breaks_linearity=True, relu=True))
    return relu_p


def _params(*shapes):
    keys = jax.random.split(jax.random.key(0), len(shapes))
    return [jax.random.normal(k, s, jnp.float64) for k, s in zip(keys, shapes, strict=True)]


def test_a_registered_relu_primitive_gives_the_path_norm_kappa_and_ddp_of_relu():
    relu_p = _relu_primitive()

    def mlp(relu):
        def fn(p, x):
            h = relu(x @ p["w1"] + p["b1"])
            return relu(h @ p["w2"] + p["b2"]) @ p["w3"]

        return fn

    w1, b1, w2, b2, w3 = _params((4, 6), (6,), (6, 5), (5,), (5, 2))
    params = {"w1": w1, "b1": b1, "w2": w2, "b2": b2, "w3": w3}
    x = jax.random.normal(jax.random.key(1), (8, 4), jnp.float64)
    mine, theirs = pj.trace(mlp(relu_p.bind), params, x, strict=True), pj.trace(mlp(jax.nn.relu), params, x)
    assert mine.num_hidden == theirs.num_hidden == 11
    np.testing.assert_allclose(pj.path_norm(mine, params), pj.path_norm(theirs, params), rtol=1e-10)
    chex.assert_trees_all_close(pj.path_kappa(mine, params), pj.path_kappa(theirs, params), rtol=1e-10)
    key = jax.random.key(2)
    chex.assert_trees_all_close(pj.ddp_kappa(mine, params, x, alpha=0.5, key=key),
                                pj.ddp_kappa(theirs, params, x, alpha=0.5, key=key), rtol=1e-10)  # fmt: skip
    grads = jax.tree_util.tree_map(jnp.ones_like, params)
    steps = []
    for space in (mine, theirs):
        tx = pj.ddp_sgd(space, 0.1, alpha=0.5)
        steps.append(tx.update(grads, tx.init(params), params, inputs=(x,), key=key)[0])
    chex.assert_trees_all_close(*steps, rtol=1e-10)
    normalised = [pj.ddp_normalize(space, alpha=0.5)(params, x) for space in (mine, theirs)]
    chex.assert_trees_all_close(*normalised, rtol=1e-10)


def test_a_registered_relu_primitive_keeps_a_recurrence_linear_for_the_exact_kappa():
    """κ⁽²⁾ needs the squared recurrent body linear in its carry: ``relu`` says that the primitive is (ReLU's
    ``max(x, 0)``), where ``breaks_linearity`` alone would refuse it."""
    relu_p = _relu_primitive()

    def rnn(relu):
        def fn(p, xs):
            def cell(h, x):
                h = relu(x @ p["wx"] + h @ p["wh"] + p["b"])
                return h, h

            h, _ = jax.lax.scan(cell, jnp.zeros((xs.shape[0], 4), xs.dtype), jnp.swapaxes(xs, 0, 1))
            return h @ p["wo"]

        return fn

    wx, wh, b, wo = _params((3, 4), (4, 4), (4,), (4, 2))
    params = {"wx": wx, "wh": wh, "b": b, "wo": wo}
    xs = jax.random.normal(jax.random.key(1), (2, 5, 3), jnp.float64)
    mine, theirs = pj.trace(rnn(relu_p.bind), params, xs), pj.trace(rnn(jax.nn.relu), params, xs)
    np.testing.assert_allclose(pj.path_norm(mine, params), pj.path_norm(theirs, params), rtol=1e-10)
    chex.assert_trees_all_close(pj.path_kappa(mine, params), pj.path_kappa(theirs, params), rtol=1e-10)
