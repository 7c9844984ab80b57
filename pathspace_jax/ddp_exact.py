"""DDP-SGD's second-order term, exactly: Σ_t ν_t mean_i (∂z_t(x_i)/∂w)² over the nodes t of the unrolled network.

One batched backward pass per node entry t; a dense kernel or a bias used once per example has the per-example
gradient a_i ⊗ δ_i, so Σ_i (a_i ⊗ δ_i)² = (a²)ᵀ (δ²) needs no per-example gradient (the identity BackPACK uses for
the exact diagonal Gauss–Newton: Dangel, Kunstner, Hennig, "BackPACK: Packing more into backprop", ICLR 2020); the
other leaves take per-example Jacobians. `pathspace_jax.ddp` (the module docstring) says where the term comes from.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pathspace_jax import jaxpr as jx
from pathspace_jax import program as flat
from pathspace_jax.ddp_inputs import batch_size, example_shapes, per_example
from pathspace_jax.forward import run_program
from pathspace_jax.rules import Op

__all__ = ["second_order_exact", "outer_product_leaves"]


def outer_product_leaves(prog: flat.Program, shapes: dict) -> dict:
    """The leaves whose per-example gradient is an outer product, as ``{leaf: (tap var, activation var or
    None)}``: a dense kernel W used once, in ``a @ W`` with a (1, k) per example (gradient a ⊗ δ, δ the
    cotangent of the product: the tap), and a bias used once (after a reshape) in ``z + b`` with z of
    b's size per example (gradient δ at the sum). ``shapes``: the per-example shape of every value."""
    uses, out = prog.uses, {}
    for j, p in enumerate(prog.in_ids[: prog.n_params]):
        v, size = p, int(np.prod(shapes[p], dtype=np.int64))
        while len(uses.get(v, [])) == 1 and uses[v][0].rule.same_entries and len(uses[v][0].outs) == 1:
            v = uses[v][0].outs[0]  # a relabelling of the same entries (a bias reshaped to (1, m))
        if len(uses.get(v, [])) != 1 or int(np.prod(shapes[v], dtype=np.int64)) != size:
            continue
        e = uses[v][0]
        other = [x for x in e.ins if x != v]
        if len(e.ins) != 2 or len(other) != 1 or isinstance(other[0], tuple):
            continue
        a = other[0]
        if e.rule.op is Op.DOT and e.ins[1] == v and shapes[v] == shapes[p] and len(shapes[p]) == 2:
            if jx.is_plain_matmul(e.params) and shapes[a] == (1, shapes[p][0]):
                out[j] = (e.outs[0], a)
        elif e.rule.op is Op.ADD and shapes[a] == shapes[v] == (1, size):
            out[j] = (e.outs[0], None)
    return out


def second_order_exact(prog, leaves, xs, axes, want, zs, nus, moment, conv_vjp=False) -> list:
    """Σ_t ν_t mean_i (∂z_t(x_i)/∂w)² (centred over i for the variance), exactly: one batched backward pass
    per entry t of the per-example nodes ``want``, without per-example gradients where they are outer
    products (`outer_product_leaves`): there Σ_i (a_i ⊗ δ_i)² = (a²)ᵀ δ², one product per layer (the
    per-example squared-gradient identity used for the exact diagonal Gauss–Newton in BackPACK; Dangel,
    Kunstner, Hennig, ICLR 2020). Other leaves (convolutions, shared and recurrent weights, embeddings)
    take per-example gradients. ``axes``: each input's batch axis (`pathspace_jax.ddp_inputs.per_example`)."""
    n, dtype = batch_size(xs, axes), jnp.result_type(*leaves)
    examples = example_shapes(xs, axes)
    shapes = dict(zip(prog.in_ids[prog.n_params :], examples, strict=True))
    shapes.update({i: tuple(jnp.shape(p)) for i, p in zip(prog.in_ids, leaves, strict=False)})

    dtypes = {}  # an activation's dtype can be wider than the params' (float64 inputs, float32 params)

    def record(o, v, e):
        shapes[o], dtypes[o] = tuple(jnp.shape(v)), jnp.result_type(v)
        return v

    one_example = [jax.ShapeDtypeStruct(s, x.dtype) for s, x in zip(examples, xs, strict=True)]
    jax.eval_shape(lambda ps, x: run_program(prog, list(ps) + list(x), [], post=record), leaves, one_example)
    outer = outer_product_leaves(prog, shapes)
    taps = list(dict.fromkeys(t for t, _ in outer.values()))
    acts = list(dict.fromkeys(a for _, a in outer.values() if a is not None))
    rest = [j for j in range(len(leaves)) if j not in outer]

    def one(eps, w_rest, x1):  # one example (the program's inputs); eps (zero) is added at the taps
        ps = list(leaves)
        for j, w in zip(rest, w_rest, strict=True):
            ps[j] = w
        add = dict(zip(taps, eps, strict=True))

        def tap(o, v, e):
            return v + add[o] if o in add else v

        vals = run_program(prog, ps + x1, list(want) + acts, post=tap, batch=n, conv_vjp=conv_vjp)[1]
        return vals[: len(want)], vals[len(want) :]

    weights = jnp.concatenate([jnp.broadcast_to(nu, jnp.shape(z)[1:]).ravel() for nu, z in zip(nus, zs, strict=True)])
    out = [None] * len(leaves)
    w_rest = [leaves[j] for j in rest]
    if outer:  # one batched backward pass per entry o, to the taps only: Σ_o ν_o δ_o², then (a²)ᵀ(·) per layer
        eps0 = [jnp.zeros((n, *shapes[t]), dtypes[t]) for t in taps]
        _, vjp, act_vals = jax.vjp(lambda e: per_example(lambda x, ei: one(ei, w_rest, x), xs, axes, e), eps0,
                                   has_aux=True)  # fmt: skip
        act_of = {a: v.reshape(n, -1) for a, v in zip(acts, act_vals, strict=True)}
        sizes = [int(np.prod(jnp.shape(z)[1:], dtype=np.int64)) for z in zs]

        def mean_grad(j, d_eps):  # ḡ = mean_i a_i ⊗ δ_i (a kernel) or mean_i δ_i (a bias), shaped like the leaf
            t, a = outer[j]
            d = d_eps[taps.index(t)].reshape(n, -1)
            return (act_of[a].T @ d / n if a is not None else jnp.mean(d, axis=0)).reshape(jnp.shape(leaves[j]))

        def body(acc, o):
            parts = jnp.split(jax.nn.one_hot(o, weights.size, dtype=dtype), np.cumsum(sizes)[:-1])
            (d_eps,) = vjp([jnp.broadcast_to(c.reshape(z.shape[1:]), z.shape).astype(z.dtype)
                            for c, z in zip(parts, zs, strict=True)])  # fmt: skip
            sq, mean_sq = acc
            # (in the accumulators' dtypes: the weights ν may be wider, float64 under x64 for float32 params)
            sq = [(s + weights[o] * d.reshape(n, -1) ** 2).astype(s.dtype) for s, d in zip(sq, d_eps, strict=True)]
            if moment == "variance":  # Σ_i (g_i − ḡ)² = Σ_i g_i² − n ḡ²
                mean_sq = {j: (m + weights[o] * n * mean_grad(j, d_eps) ** 2).astype(m.dtype)
                           for j, m in mean_sq.items()}  # fmt: skip
            return (sq, mean_sq), None

        init = ([jnp.zeros((n, int(np.prod(shapes[t], dtype=np.int64))), dtypes[t]) for t in taps],
                {j: jnp.zeros(jnp.shape(leaves[j]), dtype) for j in outer} if moment == "variance" else {})  # fmt: skip
        (sq, mean_sq), _ = jax.lax.scan(body, init, jnp.arange(weights.size))
        for j, (t, a) in outer.items():
            d2 = sq[taps.index(t)]
            k = ((act_of[a] ** 2).T @ d2 if a is not None else jnp.sum(d2, axis=0)).reshape(jnp.shape(leaves[j]))
            out[j] = (k - mean_sq[j] if moment == "variance" else k) / n
    if rest:  # per-example Jacobians of every entry, for these leaves only: (n, entries, *leaf)
        zero = [jnp.zeros(shapes[t], dtypes[t]) for t in taps]

        def flat(w, x):
            return jnp.concatenate([z.ravel() for z in one(zero, w, x)[0]])

        jac = per_example(lambda x: jax.jacrev(flat)(w_rest, x), xs, axes)
        for j, J in zip(rest, jac, strict=True):
            if moment == "variance":
                J = J - jnp.mean(J, axis=0, keepdims=True)
            # Σ_i Σ_t ν_t J² over the examples and entries as one axis (ν tiled over the examples): over both axes
            # at once, a leaf whose J is the same for every example (vmap broadcasts it) made a reduction of the
            # broadcast that raced between threads on jaxlib 0.10-0.11's CPU, also inside the caller's jit
            # (`frames._xla_cpu_options`); a matrix-vector product instead is slower (benchmarks/README.md)
            sq = (J * J).reshape(n * weights.size, -1)
            out[j] = jnp.sum(jnp.tile(weights, n)[:, None] * sq, axis=0).reshape(jnp.shape(J)[2:]) / n
    return out
