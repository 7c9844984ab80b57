"""The jaxpr-format module: every layout it reads, checked on whichever JAX is installed.

JAX 0.10 and 0.11+ store scans, calls and branches differently (see `pathspace_jax.jaxpr`). The tests
below read real equations of the installed JAX, and rebuild the *other* release's scan layout from them,
so both layouts are checked on either version and a change cannot silently break one of them.
"""

import pathlib
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from pathspace_jax import jaxpr as jx


def _eqns(fn, *args):
    return jax.make_jaxpr(fn)(*args).jaxpr.eqns


def _rnn(w, u, xs):
    def body(c, x):
        c = jax.nn.relu(c @ w + x @ u)
        return c, 2.0 * c

    return jax.lax.scan(body, jnp.zeros(w.shape[0]), xs)


W, U, XS = jnp.ones((4, 4)), jnp.ones((3, 4)), jnp.ones((5, 3))


def _scan_eqn():
    (e,) = [e for e in _eqns(_rnn, W, U, XS) if e.primitive.name == "scan"]
    return e


class _FlatTrees:
    """The shape of JAX 0.11's ``ft_in``: ``unpack()`` gives one sized group per operand group."""

    def __init__(self, *sizes):
        self.sizes = sizes

    def unpack(self):
        return tuple([None] * n for n in self.sizes)


def test_scan_of_installed_jax():
    sc = jx.scan(_scan_eqn())
    assert (sc.num_consts, sc.num_carry, sc.length, sc.reverse) == (2, 1, 5, False)
    assert isinstance(sc.body, jx.ClosedJaxpr)
    assert len(sc.body.jaxpr.invars) == 4 and len(sc.body.jaxpr.outvars) == 2


@pytest.mark.parametrize("layout", ["0.10", "0.11"])
def test_scan_split_in_both_layouts(layout):
    """The operand split computed from either release's params, rebuilt from a real scan of this JAX."""
    e = _scan_eqn()
    if layout == "0.10":
        params = {"num_consts": 2, "num_carry": 1, "length": 5, "reverse": False, "jaxpr": e.params["jaxpr"]}
    else:
        params = {"ft_in": _FlatTrees(2, 1, 1), "length": 5, "reverse": False, "jaxpr": e.params["jaxpr"]}
    assert jx.scan_split(params, 4) == (2, 1)
    sc = jx.scan(e.replace(params=params))
    assert (sc.num_consts, sc.num_carry) == (2, 1)
    with pytest.raises(ValueError, match="operands"):
        jx.scan_split(params, 2)


def test_unknown_scan_layout_names_primitive_version_and_line():
    e = _scan_eqn()
    bad = e.replace(params={k: v for k, v in e.params.items() if k not in ("num_consts", "num_carry", "ft_in")})
    with pytest.raises(jx.UnsupportedJaxprError) as info:
        jx.scan(bad)
    msg = str(info.value)
    assert "'scan'" in msg and f"JAX {jax.__version__}" in msg and "test_jaxpr.py" in msg


def test_missing_param_is_not_a_key_error():
    (e,) = [e for e in _eqns(lambda x: x.reshape(6), jnp.ones((2, 3)))]
    assert jx.param(e, "new_sizes") == (6,)
    assert jx.param(e, "no_such_key", 7) == 7
    with pytest.raises(jx.UnsupportedJaxprError, match=r"'reshape'.*no parameter 'no_such_key'.*test_jaxpr.py"):
        jx.param(e, "no_such_key")


@jax.custom_vjp
def _relu_vjp(x):
    return jnp.maximum(x, 0.0)


_relu_vjp.defvjp(lambda x: (_relu_vjp(x), x), lambda x, g: (g * (x > 0),))


@pytest.mark.parametrize(
    "fn, name",
    [
        (lambda w, x: jax.jit(lambda x: x @ w)(x), "jit"),
        (lambda w, x: jax.nn.relu(x @ w), "custom_jvp_call"),
        (lambda w, x: _relu_vjp(x @ w), "custom_vjp_call"),
        (lambda w, x: jax.checkpoint(lambda x: x @ w)(x), None),  # remat2 / checkpoint, by release
    ],
)
def test_call_body_of_call_like_primitives(fn, name):
    """Open (0.11+) or closed (0.10) sub-jaxprs come back closed, with the equation's arity."""
    eqns = _eqns(fn, W, jnp.ones((2, 4)))
    calls = [e for e in eqns if jx.call_body(e) is not None]
    assert calls, [e.primitive.name for e in eqns]
    e = calls[0]
    if name is not None:
        assert e.primitive.name == name
    body = jx.call_body(e)
    assert isinstance(body, jx.ClosedJaxpr)
    assert len(body.jaxpr.invars) == len(e.invars) and len(body.jaxpr.outvars) == len(e.outvars)


def test_control_flow_is_not_a_call():
    def fn(w, x):
        y = jax.lax.cond(x[0, 0] > 0, lambda c: c @ w, lambda c: -c @ w, x)
        z = jax.lax.while_loop(lambda c: c[1] < 3, lambda c: (jax.nn.relu(c[0] @ w), c[1] + 1), (y, 0))[0]
        return _rnn(w, w, z)[0]

    eqns = {e.primitive.name: e for e in _eqns(fn, W, jnp.ones((2, 4)))}
    for name in ("cond", "while", "scan"):
        assert jx.call_body(eqns[name]) is None
    branches = jx.cond_branches(eqns["cond"])
    assert len(branches) == 2 and all(len(b.jaxpr.invars) == len(eqns["cond"].invars) - 1 for b in branches)
    w = jx.while_loop(eqns["while"])
    assert (w.cond_nconsts, w.body_nconsts) == (0, 1)
    assert len(w.body.jaxpr.invars) == len(eqns["while"].invars)


def test_literals_and_bind():
    (e,) = _eqns(lambda x: jnp.maximum(x, 0.0), jnp.ones(3))
    lit = [x for x in e.invars if jx.is_literal(x)]
    assert len(lit) == 1 and jx.literal_value(lit[0]) == 0.0
    out = jx.bind(e.primitive, e.params, [jnp.array([-1.0, 2.0, -3.0]), jnp.zeros(())])
    assert jnp.array_equal(out[0], jnp.array([0.0, 2.0, 0.0]))


def test_open_jaxpr_with_unbound_constants_is_refused():
    body = jax.make_jaxpr(lambda x: x * jnp.arange(3.0))(jnp.ones(3)).jaxpr
    if body.constvars:
        with pytest.raises(jx.UnsupportedJaxprError, match="constant variables"):
            jx.closed(body)
    assert isinstance(jx.closed(jax.make_jaxpr(lambda x: 2 * x)(1.0).jaxpr), jx.ClosedJaxpr)


def test_flax_rnn_scan_reads_on_this_jax():
    """nn.RNN's scan (the failing case on JAX 0.11): consts are the cell's parameters."""
    m = nn.RNN(nn.SimpleCell(6, activation_fn=nn.relu))
    x = jnp.ones((2, 5, 3), jnp.float32)
    p = m.init(jax.random.key(0), x)
    (e,) = [e for e in _eqns(lambda p, x: m.apply(p, x), p, x) if e.primitive.name == "scan"]
    sc = jx.scan(e)
    assert sc.num_carry == 1 and sc.length == 5
    assert len(e.invars) == sc.num_consts + sc.num_carry + 1


def test_only_the_jaxpr_module_reads_jax_internals():
    """Primitive params and JAX's internal modules are read in pathspace_jax/jaxpr.py alone."""
    pkg = pathlib.Path(jx.__file__).parent
    pattern = re.compile(r"\.params\[|\.params\.get\(|jax\.extend|jax\._src|get_bind_params")
    offenders = [
        f"{f.name}:{i}: {line.strip()}"
        for f in sorted(pkg.glob("*.py"))
        if f.name != "jaxpr.py"
        for i, line in enumerate(f.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not offenders, offenders


def test_random_state_only_finds_keys_and_counters_through_scans():
    """Inputs whose values reach only random primitives (an nnx stream's keys and counters, sliced per layer by a
    scan) are random state; data, and a key the function returns, are not."""
    from pathspace_jax.rules import is_random

    def fn(w, keys, counts, ids, x, out_key):
        def layer(h, kc):
            key, count = kc
            keep = jax.random.bernoulli(jax.random.fold_in(key, count + 1), 0.5, h.shape)
            return jnp.where(keep, jax.nn.relu(h @ w), 0.0), None

        h, _ = jax.lax.scan(layer, x + ids.astype(x.dtype)[:, None], (keys, counts))
        return h, out_key

    args = (jnp.ones((3, 3)), jax.random.split(jax.random.key(0), 2), jnp.zeros(2, jnp.uint32),
            jnp.zeros(4, jnp.int32), jnp.ones((4, 3)), jax.random.key(1))  # fmt: skip
    closed = jax.make_jaxpr(fn)(*args)
    assert jx.random_state_only(closed, is_random) == [False, True, True, False, False, False]
