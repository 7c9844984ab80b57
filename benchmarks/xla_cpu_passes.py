"""What one pass over a weight matrix costs on the CPU: SGD's update against the reductions G-SGD needs.

G-SGD's normalised chart (`pathspace_jax.in_path_space`) reads each weight matrix in four reductions before
its update: the path norms into and out of every node (column and row sums of ``w² q``), the norms ‖v_x‖
(row sums of ``w² α²``) and the in-skeleton correction (row sums of ``g w``). XLA:CPU runs such a fused
reduction about as slowly as SGD's whole update of the matrix (read w and g, write w), and several times
slower than a matrix-vector product that reads the same matrix once; that, not the arithmetic, is what
G-SGD's step costs on an MLP beyond SGD's (benchmarks/README.md, "Accepted floors"). The column sums
are written ``w (w p)`` as `pathspace_jax.gsgd.path_norms` writes them: ``(w w) p``, the same sum, is
tens of times slower on the 2048 x 2048 matrix (the last line).
Run: ``python benchmarks/xla_cpu_passes.py`` (prints microseconds; under a minute on 2 cores).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp


def _us(fn, *args, donate: bool = False, repeats: int = 100) -> float:
    """Median microseconds of one call; ``donate``: the first argument is consumed and replaced by the result."""
    fn = jax.jit(fn, donate_argnums=0 if donate else ()).lower(*args).compile()
    first = jnp.copy(args[0])
    times = []
    for _ in range(7):
        a0 = jnp.copy(first)
        jax.block_until_ready(a0)
        t0 = time.perf_counter()
        for _ in range(repeats):
            out = fn(a0, *args[1:])
            if donate:
                a0 = out
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / repeats)
    return 1e6 * sorted(times)[3]


def main() -> None:
    print(f"{jax.default_backend()}, jax {jax.__version__}: one pass over a float32 weight matrix (µs)")
    passes = {
        "SGD's update w - 0.01 g (in place)": (lambda w, g, q, p: w - 0.01 * g, True),
        "row sums of g w": (lambda w, g, q, p: jnp.sum(g * w, axis=1), False),
        "row sums of w² q": (lambda w, g, q, p: jnp.sum(w * (w * q), axis=1), False),
        "column sums of w² p": (lambda w, g, q, p: jnp.sum(w * (w * p[:, None]), axis=0), False),
        "column sums of w² p, as (w w) p": (lambda w, g, q, p: jnp.sum(w * w * p[:, None], axis=0), False),
        "matrix-vector product w q": (lambda w, g, q, p: w @ q, False),
    }
    for rows, cols in ((784, 512), (2048, 2048)):
        keys = jax.random.split(jax.random.key(0), 4)
        w, g = (jax.random.normal(k, (rows, cols)) for k in keys[:2])
        q, p = jax.random.uniform(keys[2], (cols,)), jax.random.uniform(keys[3], (rows,))
        print(f"  {rows} x {cols}:")
        for name, (fn, donate) in passes.items():
            print(f"    {name:36s} {_us(fn, w, g, q, p, donate=donate):8.1f}")


if __name__ == "__main__":
    main()
