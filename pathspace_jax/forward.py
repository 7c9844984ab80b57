"""The forward executor: the real forward pass of a flat program (`pathspace_jax.program`), keeping the values
that DDP-SGD's statistics and DDP-Normalization need.

`run_program` evaluates the program's equations on real values (one example, batch of one, under a ``vmap``),
with a hook after every equation; `forward` returns the pre-activations asked for (a node inside a scan body
stacked over the steps). Scans run step by step (`pathspace_jax.program.scan_unroll`), and `conv` is a
convolution whose gradients take the top-level form on every backend (XLA:CPU runs them slowly inside a
``lax.cond``).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pathspace_jax import jaxpr as jx
from pathspace_jax import program as flat
from pathspace_jax.errors import DDPUnsupportedError
from pathspace_jax.rules import Op

__all__ = ["run_program", "forward", "scan_nodes", "conv", "unrolled"]


def forward(prog: flat.Program, params: Sequence, inputs: Sequence, want: Sequence, batch: int = 1,
             conv_vjp: bool = False) -> list:  # fmt: skip
    """The real forward pass (one example, batch of one); returns the values of ``want``: var ids, or
    ``(scan equation index, body var id)`` for a node inside a scan body (stacked over the steps).
    ``batch``: how many examples a ``vmap`` around the call runs at once (it sizes the scans' unrolling);
    ``conv_vjp``: the convolutions go through `conv` (a pass differentiated in reverse mode only)."""
    return run_program(prog, list(params) + list(inputs), want, batch=batch, conv_vjp=conv_vjp)[1]


def run_program(prog: flat.Program, invals: list, want: Sequence, post=None, batch: int = 1,
         conv_vjp: bool = False) -> tuple[list, list]:  # fmt: skip
    """`forward` on ``prog``'s inputs; returns the values of ``prog.out_ids`` and of ``want``. Boundary
    values (the boundary of `pathspace_jax.program`) are held fixed (``stop_gradient``) for what comes after them.
    ``post(var, value, eqn)`` replaces every value where it is produced (DDP-Normalization)."""
    env = dict(prog.consts)
    env.update(zip(prog.in_ids, invals, strict=False))
    boundary, kept, got = prog.bnd | set(prog.sinks), {}, {}
    for idx, e in enumerate(prog.eqns):
        vals = [jnp.asarray(x[1]) if isinstance(x, tuple) else env[x] for x in e.ins]
        if e.body is not None:  # a scan, step by step: the wanted body nodes are stacked over the steps
            inner = [w[1] for w in want if isinstance(w, tuple) and w[0] == idx]
            outs, got_scan = _run_scan(e, vals, inner, batch)
            got.update({(idx, v): g for v, g in zip(inner, got_scan, strict=True)})
        elif e.rule.relu and prog.kinds[e.outs[0]] == "act" and _is_relu(e):
            # a ReLU max(x, 0): use jax.nn.relu (derivative 0 at 0, as the user's model has)
            outs = [jax.nn.relu(vals[0] if isinstance(e.ins[1], tuple) else vals[1])]
        else:
            outs = [conv(e, *vals)] if conv_vjp and e.rule.op is Op.CONV else flat.bind(e, vals)
        for o, v in zip(e.outs, outs, strict=False):
            env[o] = v = v if post is None else post(o, v, e)
            if o in boundary:  # a boundary value: downstream, an input of the homogeneous part
                kept[o], env[o] = v, jax.lax.stop_gradient(v)
    outs = [jnp.asarray(x[1]) if isinstance(x, tuple) else env[x] for x in prog.out_ids]
    got = [got[w] if isinstance(w, tuple) else kept.get(w, env[w]) for w in want]
    if any(e.rule.fills_neg_inf for e in prog.eqns):
        got = [_no_value_as_zero(z) for z in got]
    return outs, got


def _no_value_as_zero(z):
    """A pre-activation at −∞ has no value: a segment max that no message reaches (``jax.ops.segment_max``) plus
    anything finite, which the ReLU after it turns into 0. It reads as 0 with no derivative, so a node that carries
    nothing has no statistic (as the |w|^p network reads the −∞ as 0: no path) instead of an infinite one."""
    return jnp.where(jnp.isneginf(z), jnp.zeros_like(z), z) if jnp.issubdtype(z.dtype, jnp.floating) else z


def scan_nodes(prog: flat.Program, which: str = "sinks") -> list:
    """The boundary nodes (``"sinks"``) or all the nodes (``"nodes"``) inside scan bodies, as ``(scan
    equation index, body var)`` (see `forward`)."""
    out = []
    for i, e in enumerate(prog.eqns):
        if e.body is None:
            continue
        if any(x.body is not None and (which == "nodes" or x.body.sinks or scan_nodes(x.body)) for x in e.body.eqns):
            raise DDPUnsupportedError(
                f"ddp_kappa: a nested scan at {e.where}: one level of recurrence is supported. Fix: write the inner "
                "loop as a Python loop (unrolled), or train this model with Path-SGD or G-SGD"
            )
        out += [(i, v) for v in getattr(e.body, which)]
    return out


def _is_relu(e) -> bool:
    """Whether a ``relu`` rule's equation of two operands is ``max(x, 0)``: one of them a literal scalar zero."""
    zero = [x for x in e.ins if isinstance(x, tuple)]
    return len(e.ins) == 2 and len(zero) == 1 and not np.any(np.asarray(zero[0][1])) and np.ndim(zero[0][1]) == 0


def _run_scan(e, vals, inner: list, batch: int) -> tuple[list, list]:
    bp, nc, ncar = e.body, e.scan.num_consts, e.scan.num_carry
    consts, init, xs = vals[:nc], vals[nc : nc + ncar], vals[nc + ncar :]

    def step(carry, x):
        outs, got = run_program(bp, list(consts) + list(carry) + list(x), inner, batch=batch)
        return outs[:ncar], (outs[ncar:], got)

    # unrolled off the CPU (`unrolled`) within `flat.scan_unroll`'s memory budget, counting the carries of the
    # whole batch (the scan runs per example under a vmap, where they look ``batch`` times smaller) in its three
    # passes (forward, linearised and transposed): counted per example, the language model's DDP step took 502 MB
    # of temporaries, not 177 MB
    unroll = flat.scan_unroll(e.scan.length, 3 * batch * flat.nbytes(init)) if unrolled() and not e.layers else 1
    carry, (ys, got) = jax.lax.scan(
        step, list(init), list(xs), length=e.scan.length, reverse=e.scan.reverse, unroll=unroll
    )
    return list(carry) + list(ys), list(got)


def conv(e, x, w):
    """The convolution of equation ``e``, as `flat.bind`, with its gradients in the form XLA:CPU gives them
    at the top level of a program but not inside a ``cond`` or a loop, where
    autodiff's filter gradient runs 50× slower and its input gradient 3× (DDP-SGD's refresh at
    ``every > 1``; at the top level this form is slower than XLA's own: small CNN, one probe, 1.96 -> 2.17×
    SGD's step).

    Both are forward convolutions with the axes in the order the convolution library takes: the filter
    gradient ``dW[k, i, o] = Σ_{b,s} x_pad[b, s·stride + k, i] dy[b, s, o]`` convolves the input, batch and
    feature axes swapped, with the output cotangent as kernel, dilated by the strides; the input gradient
    convolves the cotangent, dilated by the strides, with the kernel flipped and its features swapped.
    Convolutions with dilations or groups use `flat.bind`. `ddp_kappa_canonical` takes this form on the CPU only.
    """
    specs = jx.plain_conv_specs(e.params)
    if specs is None:
        return flat.bind(e, [x, w])[0]
    lhs_spec, rhs_spec, out_spec, strides, pads = specs
    n = len(strides)
    sp = tuple(range(1, n + 1))
    # both gradients as convolutions of [batch, spatial..., feature] with kernels [spatial..., in, out]
    dn = jax.lax.ConvDimensionNumbers((0, n + 1, *sp), (n + 1, n, *range(n)), (0, n + 1, *sp))
    ksz = [jnp.shape(w)[rhs_spec[2 + k]] for k in range(n)]
    size = [jnp.shape(x)[lhs_spec[2 + k]] for k in range(n)]
    rem = [(size[k] + pads[k][0] + pads[k][1] - ksz[k]) % strides[k] for k in range(n)]
    pads_dx = [(ksz[k] - 1 - pads[k][0], ksz[k] - 1 - pads[k][1] + rem[k]) for k in range(n)]

    @jax.custom_vjp
    def conv(x, w):
        return flat.bind(e, [x, w])[0]

    def fwd(x, w):
        return conv(x, w), (x, w)

    def bwd(res, dy):
        x, w = res
        # dx: dy dilated by the strides, convolved with the kernel flipped, in and out features swapped
        dyn = jnp.transpose(dy, (out_spec[0], *out_spec[2:], out_spec[1]))  # [batch, spatial..., out feature]
        zero = jnp.zeros((), dy.dtype)
        dyn = jax.lax.pad(dyn, zero, [(0, 0, 0), *((0, 0, s - 1) for s in strides), (0, 0, 0)])
        wf = jnp.flip(jnp.transpose(w, (*rhs_spec[2:], rhs_spec[0], rhs_spec[1])), tuple(range(n)))  # [k..., out, in]
        dxn = jax.lax.conv_general_dilated(dyn, wf, (1,) * n, pads_dx, dimension_numbers=dn)  # [batch, spatial.., in]
        dx = jnp.transpose(dxn, np.argsort((lhs_spec[0], *lhs_spec[2:], lhs_spec[1]))).astype(x.dtype)
        xc = jnp.transpose(x, (lhs_spec[1], *lhs_spec[2:], lhs_spec[0]))  # [in feature, spatial..., batch]
        dyc = jnp.transpose(dy, (*out_spec[2:], out_spec[0], out_spec[1]))  # [spatial..., batch, out feature]
        # dW: the input's batch axis is x's in feature, its feature axis x's batch; the kernel is dy
        dwc = jax.lax.conv_general_dilated(xc, dyc, (1,) * n, pads, rhs_dilation=strides, dimension_numbers=dn)
        dwc = dwc[(slice(None), *(slice(0, k) for k in ksz))]  # [in, spatial..., out]
        perm = (rhs_spec[1], *rhs_spec[2:], rhs_spec[0])  # w's axes in dwc's order
        return dx, jnp.transpose(dwc, np.argsort(perm)).astype(w.dtype)

    conv.defvjp(fwd, bwd)
    return conv(x, w)


def unrolled() -> bool:
    """Whether DDP's scans are unrolled: off the CPU, where a loop pays a kernel launch per iteration. On the CPU
    they ran slower unrolled (ReLU RNN h100 T28, × SGD in one process: one probe 2.31 -> 2.41, the exact
    estimator 19.8 -> 49.3, α = 0.5 4.54 -> 5.09)."""
    return jax.default_backend() != "cpu"
