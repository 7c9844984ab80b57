"""Every optimiser under the three ways JAX shards a step, on 4 CPU devices, against one device.

* explicit sharding (``jax.make_mesh``'s default axis type, ``AxisType.Explicit``, with ``jax.set_mesh``): data
  parallel, the batch split over the mesh. Flax's linen layers do not run with explicitly sharded kernels (a
  ``Dense`` needs an ``out_sharding`` it does not take), so params stay replicated there.
* automatic sharding (``AxisType.Auto``): FSDP-style, every leaf split along its largest axis divisible by 4,
  and the compiled step is read for what it communicates.
* manual sharding (``jax.shard_map``): each device runs the step on its part of the batch.

Each case runs in its own process (the number of CPU devices is fixed when JAX starts).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

COMMON = """
import jax, jax.numpy as jnp, numpy as np, optax, flax.linen as nn, pathspace_jax as pj
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
assert jax.device_count() == 4

class RNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.RNN(nn.SimpleCell(8, activation_fn=nn.relu))(x)
        return nn.Dense(2)(nn.relu(nn.Dense(16)(h[:, -1])))

MODELS = {
    # (a 16x16 kernel: FSDP splits it along its output axis, which flattening it would gather)
    "mlp": (nn.Sequential([nn.Dense(16), nn.relu, nn.Dense(16), nn.relu, nn.Dense(2)]), (16, 4)),
    "rnn": (RNN(), (16, 5, 3)),
}

def optimisers(space):
    return {
        "g_sgd": pj.g_sgd(space, 0.01),
        "g_adam": pj.g_adam(space, 1e-2),
        "path_sgd": pj.path_sgd(space, 0.01, momentum=0.9),
        "ddp_sgd": pj.ddp_sgd(space, 0.01, alpha=1.0),
        # κ kept between refreshes (`PackedKappa`): the second of two steps reuses it
        "path_sgd_every2": pj.path_sgd(space, 0.01, every=2),
        "ddp_sgd_every2": pj.ddp_sgd(space, 0.01, alpha=1.0, every=2),
    }

def make_step(fn, tx, name):
    def step(p, s, x):
        g = jax.grad(lambda p: jnp.mean(fn(p, x) ** 2))(p)
        u, s = tx.update(g, s, p, **({"inputs": x} if name.startswith("ddp_sgd") else {}))
        return optax.apply_updates(p, u), s
    return jax.jit(step)

def two_steps(step, tx, p, x):
    p, s = step(p, tx.init(p), x)
    return step(p, s, x)[0]

def assert_close(a, b):
    for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-5, atol=1e-6)
"""


def _run(body: str) -> None:
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    env.pop("JAX_ENABLE_X64", None)
    out = subprocess.run(
        [sys.executable, "-c", COMMON + textwrap.dedent(body)], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-4000:]


@pytest.mark.slow
def test_explicit_mesh_data_parallel_matches_one_device():
    """Data parallel under ``jax.set_mesh`` with explicit axes, compiled before and after the same step without a
    mesh in one process (the flat programs traced for κ are cached per mesh: one traced under a mesh does not run
    without it, nor the other way round). DDP-SGD's probes are cotangents of the batch-sharded node values. The
    params are replicated here, so G-Adam (G-SGD's chart) and Path-SGD every 2 steps (DDP-SGD's kept κ) add
    nothing to what the others run: they are left to the FSDP test."""
    _run(
        """
        mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Explicit,))
        model, shape = MODELS["mlp"]  # flax's nn.RNN does not run on an explicitly sharded batch
        x = jax.random.normal(jax.random.key(1), shape)
        p = model.init(jax.random.key(0), x)["params"]
        fn = lambda p, x: model.apply({"params": p}, x)
        space = pj.trace(fn, p, x)
        for name, tx in optimisers(space).items():
            if name in ("g_adam", "path_sgd_every2"):
                continue
            step = make_step(fn, tx, name)
            ref = two_steps(step, tx, p, x)
            with jax.set_mesh(mesh):
                xs = jax.device_put(x, NamedSharding(mesh, P("data")))
                out = two_steps(step, tx, p, xs)
            assert_close(out, ref)
            assert_close(two_steps(step, tx, p, x), ref)
        print("ok")
        """
    )


@pytest.mark.slow
@pytest.mark.parametrize("model", ["mlp", "rnn"])  # a process each: the longest test of the suite, split
def test_fsdp_keeps_node_vectors_whole(model):
    """FSDP-style sharding with automatic axes and no mesh in context: the same params as one device, and no
    collective-permute in the compiled step (nor in the public functions' programs), and G-SGD's chart gathering
    no more than a node vector (it gathered whole kernels to flatten them, `frames.get_flat`). Node vectors (one
    number per node) sliced at each leaf's offsets were split by XLA at boundaries of their own, with a halo
    exchange at every slice (72 collective-permutes in G-SGD's step on a 784-512-512-10 MLP);
    `pathspace_jax.frames.replicated` keeps them whole on the params' mesh. The public functions called outside a
    trace give results sharded like the params (before, `coord_scales` and `path_kappa` gave them whole on every
    device). The RNN runs the optimisers whose step differs through a recurrence (κ⁽²⁾'s lag sums, DDP's statistics
    per step); the MLP runs them all."""
    _run(
        """
        mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,))
        def fsdp(a):
            axes = [k for k in np.argsort(a.shape)[::-1] if a.shape[k] % 4 == 0]
            return NamedSharding(mesh, P(*["data" if axes and k == axes[0] else None for k in range(a.ndim)]))
        model, shape = MODELS[__model__]
        x = jax.random.normal(jax.random.key(1), shape)
        p = model.init(jax.random.key(0), x)["params"]
        fn = lambda p, x: model.apply({"params": p}, x)
        space = pj.trace(fn, p, x)
        ps = jax.tree_util.tree_map(lambda a: jax.device_put(a, fsdp(a)), p)
        xs = jax.device_put(x, NamedSharding(mesh, P("data")))
        for name, tx in optimisers(space).items():
            if __model__ == "rnn" and name not in ("g_sgd", "path_sgd", "ddp_sgd"):
                continue
            step = make_step(fn, tx, name)
            state = jax.tree_util.tree_map(lambda a: jax.device_put(a, fsdp(a)), tx.init(ps))
            hlo = step.lower(ps, state, xs).compile().as_text()
            assert "collective-permute" not in hlo, (name, hlo.count("collective-permute"))
            for line in hlo.splitlines() if __model__ == "mlp" else ():  # G-SGD's chart gathers node vectors, no
                if " all-gather(" in line and "_chart_step" in line:  # kernel (flattened for its skeleton, it was)
                    dims = line.split("=", 1)[1].split("[", 1)[1].split("]", 1)[0]
                    assert np.prod([int(d) for d in dims.split(",") if d]) <= space.num_nodes, (name, line[:160])
            assert_close(two_steps(step, tx, ps, xs), two_steps(step, tx, p, x))
        public = {  # called directly inside a jit: they enter the params' mesh too
            "to_coords": lambda p: pj.to_coords(space, p),
            "coord_scales": lambda p: pj.coord_scales(space, p),
            "path_kappa": lambda p: pj.path_kappa(space, p),
            "ddp_kappa": lambda p: pj.ddp_kappa(space, p, xs, alpha=1.0),
        }
        for name, f in public.items():
            compiled = jax.jit(f).lower(ps).compile()
            assert "collective-permute" not in compiled.as_text(), name
            assert_close(compiled(ps), jax.jit(f)(p))
            eager = f(ps)  # called outside a trace: compiled whole, each leaf placed as the params' leaf
            assert_close(eager, compiled(ps))
            for a, b in zip(jax.tree_util.tree_leaves(eager), jax.tree_util.tree_leaves(ps), strict=True):
                assert a.sharding.is_equivalent_to(b.sharding, b.ndim), (name, a.sharding, b.sharding)
        print("ok")
        """.replace("__model__", repr(model))
    )


@pytest.mark.slow
def test_shard_map_params_only_optimisers_and_a_clear_error_for_ddp():
    """Inside ``jax.shard_map`` (manual axes) with the batch split: the optimisers that read only the params give
    one device's params; DDP-SGD and DDP-Normalization, whose statistics are means over the batch, refuse a batch
    that differs between devices instead of taking each device's own part (which failed deep in JAX before)."""
    _run(
        """
        mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,))
        model, shape = MODELS["mlp"]
        x = jax.random.normal(jax.random.key(1), shape)
        p = model.init(jax.random.key(0), x)["params"]
        fn = lambda p, x: model.apply({"params": p}, x)
        space = pj.trace(fn, p, x)
        for name, tx in optimisers(space).items():
            def local(p, s, x):  # the gradient of a replicated p is summed over "data": the mean is a quarter
                g = jax.tree_util.tree_map(lambda t: t / 4, jax.grad(lambda p: jnp.mean(fn(p, x) ** 2))(p))
                u, s = tx.update(g, s, p, **({"inputs": x} if name.startswith("ddp_sgd") else {}))
                return optax.apply_updates(p, u), s
            step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P())))
            if name.startswith("ddp_sgd"):
                try:
                    step(p, tx.init(p), x)
                except ValueError as e:
                    assert "its own part" in str(e) and "['data']" in str(e), e
                else:
                    raise AssertionError("DDP-SGD ran on each device's part of the batch")
                continue
            assert_close(two_steps(step, tx, p, x), two_steps(make_step(fn, tx, name), tx, p, x))
        fn_tilde = pj.ddp_normalize(space, alpha=1.0)
        normalize = jax.shard_map(lambda x: fn_tilde(p, x), mesh=mesh, in_specs=P("data"), out_specs=P("data"))
        try:
            jax.jit(normalize)(x)
        except ValueError as e:
            assert "its own part" in str(e), e
        else:
            raise AssertionError("DDP-Normalization ran on each device's part of the batch")
        print("ok")
        """
    )
