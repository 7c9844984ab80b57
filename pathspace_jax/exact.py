"""Exact power-of-two numerics: `pow2`, `ldexp`, and values with a tracked exponent (`V`, `renorm`, `align`).

Power-of-two rescalings of a ReLU network are exact in floating point, and the library keeps them exact: its
frames, gauges and path products are taken with these functions, so a rescaled network gives the same
coordinates, κ and updates bit for bit. The |·|^p network (`pathspace_jax.squared`) carries each value as a
mantissa times ``2^e`` (`V`), so that products of many weights neither overflow nor underflow.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class V(NamedTuple):
    """A non-constant value of the |·|^p network: mantissa ``m`` times 2^``e`` (``e`` None: not tracked)."""

    m: Any
    e: Any


def is_float(x) -> bool:
    """Whether ``x`` has a floating (or complex) dtype."""
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def pow2(k, dtype) -> jax.Array:
    """Exactly ``2^k`` in ``dtype`` for integer-valued ``k`` in the dtype's normal range (clipped to it).

    Built from the float's exponent bits. ``jnp.exp2`` is not exact at integers (on CPU, float32
    ``exp2(13.0)`` is off by an ulp; on GPU more often), and exactness is what makes power-of-two
    rescalings commute bit for bit with the library's frames.
    """
    info = jnp.finfo(dtype)
    bias = info.maxexp - 1
    ity = jnp.dtype(f"int{info.bits}")
    k = jnp.clip(jnp.asarray(k), 1 - bias, bias).astype(ity)
    return jax.lax.bitcast_convert_type((k + bias) << info.nmant, dtype)


def ldexp(x, k) -> jax.Array:
    """``x · 2^k``, exact wherever ``x`` and the result are normal floats (XLA flushes subnormals to zero).

    As `jnp.ldexp`, but with `pow2`'s exact powers: `jnp.ldexp` raises 2 to a float power, which GPUs
    round in float64 (2^k off by an ulp at about one k in seven). Three factors ``2^k1 2^k2 2^k3`` with
    ``k1 + k2 + k3 = k``, taken greedily (``k1`` is k clipped to the normal exponents, ``k2`` the rest
    clipped, ``k3`` what is left): every one is a normal float wherever x and the result are, and every
    partial product lies between x and the result, so each product is exact. Clips and subtractions only:
    an earlier split into thirds (integer floor divisions) was most of what a Transformer's |·|^p network
    compiled to, since XLA repeats such scalar arithmetic in every kernel that reads it. No ``frexp`` of x: its
    bit-level selects, repeated along the chains of renormalisations, made LLVM's loop vectoriser take minutes on
    one fused kernel (jaxlib 0.12, CPU).
    """
    x = jnp.asarray(x)
    k = jnp.asarray(k, jnp.int32)
    top = jnp.finfo(x.dtype).maxexp - 2
    k1 = jnp.clip(k, -top, top)
    k2 = jnp.clip(k - k1, -top, top)
    return x * pow2(k1, x.dtype) * pow2(k2, x.dtype) * pow2(k - k1 - k2, x.dtype)


def renorm(v: V) -> V:
    """``v`` with its mantissa brought to [0.5, 1) in its largest entry, the exponent moved to ``e`` (exact)."""
    if v.e is None or not is_float(v.m) or jnp.size(v.m) == 0:
        return v
    _, k = jnp.frexp(jax.lax.stop_gradient(jnp.max(jnp.abs(v.m))))
    k = k.astype(jnp.int32)
    return V(ldexp(v.m, -k), v.e + k)


def align(vals: list) -> tuple[list, Any]:
    """Bring every tracked float operand to the largest exponent; returns mantissas and that exponent."""
    es = [v.e for v in vals if isinstance(v, V) and v.e is not None and is_float(v.m)]
    if len(es) < 2:  # nothing to bring to another exponent (a shift by 0 is still three products)
        return [v.m if isinstance(v, V) else v for v in vals], (es[0] if es else None)
    top = functools.reduce(jnp.maximum, es)
    out = []
    for v in vals:
        if isinstance(v, V):
            out.append(ldexp(v.m, v.e - top) if v.e is not None and is_float(v.m) else v.m)
        else:
            out.append(v)
    return out, top


def raise_power(v, power: float):
    """|v|^power of a coefficient (``v * v`` for power 2, exact)."""
    return v * v if power == 2.0 else jnp.abs(v) ** power


def power_v(w, p: float) -> V:
    """|w|^p as a mantissa and exponent, formed after factoring out the array's largest power of two (the
    mantissa's largest entry lies in [2^-p, 2): normalised enough, and no second reduction)."""
    if jnp.size(w) == 0:
        return V(w, jnp.zeros((), jnp.int32))
    _, k = jnp.frexp(jnp.max(jnp.abs(w)))
    pk = p * k.astype(w.dtype)
    e = jnp.floor(pk)
    return V(raise_power(ldexp(w, -k), p) * jnp.exp2(pk - e), e.astype(jnp.int32))
