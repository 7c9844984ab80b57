"""XLA:CPU and a convolution's gradients inside a ``lax.cond`` or a ``lax.scan``, against the top level.

At the top level of a program XLA:CPU rewrites autodiff's filter gradient (a convolution with the batch as
its contracted feature axis) into the axis order its convolution library takes; inside a nested computation
it leaves it as it is, and it runs tens of times slower. This is why DDP-SGD's refresh at ``every > 1``
takes a convolution's gradients through `pathspace_jax.forward.conv` on the CPU (benchmarks/README.md).
Run: ``python benchmarks/xla_cpu_conv_in_cond.py`` (prints milliseconds; about a minute on 2 cores).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from pathspace_jax import forward


def _ms(fn, *args) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * sorted(times)[2]


def main() -> None:
    x = jax.random.normal(jax.random.key(0), (64, 28, 28, 32))
    w = 0.1 * jax.random.normal(jax.random.key(1), (3, 3, 32, 64))

    def conv(x, w):
        return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))

    (eqn,) = jax.make_jaxpr(conv)(x, w).jaxpr.eqns

    class Eqn:  # what forward.conv reads of a traced equation
        prim, params = eqn.primitive, eqn.params

    dy = jax.random.normal(jax.random.key(2), (64, 28, 28, 64))
    grads = {
        "autodiff": lambda x, w: jax.vjp(conv, x, w)[1](dy),
        "forward.conv": lambda x, w: jax.vjp(lambda x, w: forward.conv(Eqn, x, w), x, w)[1](dy),
    }
    print(f"{jax.default_backend()}, jax {jax.__version__}: both gradients of a 3x3 convolution, 32 -> 64 channels, "
          "batch 64 at 28 x 28 (ms)")  # fmt: skip
    zeros = jax.tree.map(jnp.zeros_like, (x, w))
    for name, g in grads.items():
        top = jax.jit(g)
        in_cond = jax.jit(lambda x, w, c, g=g: jax.lax.cond(c, lambda: g(x, w), lambda: zeros))
        in_scan = jax.jit(lambda x, w, g=g: jax.lax.scan(lambda c, _: (g(x, w), None), (x, w), length=1)[0])
        print(f"  {name:10s} top level {_ms(top, x, w):8.1f}   in a cond {_ms(in_cond, x, w, True):8.1f}   "
              f"in a scan {_ms(in_scan, x, w):8.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
