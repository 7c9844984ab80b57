"""The |·|^p network's scans (`pathspace_jax.squared`): a recurrence or a stack of layers evaluated step by step, the
records Path-SGD's κ⁽²⁾ needs from it (`ScanRecord`, the recurrent entries), and the products whose κ⁽¹⁾ is taken
from their operands (`Tap`); `sum_v` and `to_v`, the `V` arithmetic they share with `evaluate`. `eval_scan` is handed
`evaluate` (for the body) by its caller."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pathspace_jax.exact import V, align, is_float, ldexp, raise_power, renorm
from pathspace_jax.program import Eqn, Program, is_key, nbytes, scan_unroll
from pathspace_jax.rules import Op


@dataclasses.dataclass
class Tap:
    """A product of an activation and a parameter whose κ⁽¹⁾ is taken from its operand and result cotangent.

    The evaluation stops the parameter's gradient there, records the activation operand x and adds a zero
    perturbation to the product's result, whose gradient is the result's cotangent ȳ. Inside a scan body: the
    VJP through ``lax.scan`` adds each step's outer product into the gradient of every parameter the body
    multiplies, T read-modify-write passes over an n × n kernel, where Σ_t (∂(x_t·P)/∂P)ᵀ ȳ_t is one batched
    product. At the top level: a dense kernel's κ⁽¹⁾ is x ⊗ ȳ, which Path-SGD keeps as two vectors.
    """

    param: int  # the operand index of the parameter
    act: int  # the operand index of the activation
    pert: Any = None  # zeros: (T, *result) for the scan, its slice at each step (None while shapes are found)
    seen: list = dataclasses.field(default_factory=list)  # activation operand: (T, ...) for the scan, x_t per step
    shapes: dict = dataclasses.field(default_factory=dict)  # body equation index -> the result's shape


class ScanRecord(NamedTuple):
    """What κ⁽²⁾ needs from one top-level scan (recorded during the evaluation)."""

    cin: Any  # (T, n): carry entering every step (processing order as stored by scan: index order)
    a: Any  # (n, n): carry-to-carry Jacobian of the squared body, A[out, in]


def sum_v(parts: list) -> V:
    """The sum of scalar `V`s (aligned to the largest exponent where exponents are tracked)."""
    if not parts:
        return V(jnp.zeros(()), None)
    if any(p.e is not None for p in parts):
        parts = [p if p.e is not None else renorm(V(p.m, jnp.zeros((), jnp.int32))) for p in parts]
    ms, top = align(parts)
    return V(functools.reduce(jnp.add, ms), top)


def to_v(x, power: float, stable: bool, dtype) -> V:
    """A scan's carry as a `V`: a constant entering a non-constant slot (a zero initial carry) raised to ``power``;
    with ``stable``, its exponent tracked (a carry whose value the body computes from untracked values alone, a
    decoder's feedback, would otherwise change the carry's structure from one step to the next)."""
    if isinstance(x, V):
        return renorm(V(x.m, jnp.zeros((), jnp.int32))) if stable and x.e is None and is_float(x.m) else x
    x = jnp.asarray(x)
    m = raise_power(x if is_float(x) else x.astype(dtype), power)
    return renorm(V(m, jnp.zeros((), jnp.int32) if stable else None))


class _Carries(NamedTuple):
    """A scan's activation carries (the others are constants: a loop counter, a key) as one flat vector, the
    perturbation and carry-to-carry Jacobian of κ⁽²⁾."""

    act: list[int]  # their positions among the carries
    shapes: list[tuple]
    dtype: Any

    @property
    def size(self) -> int:
        return sum(int(np.prod(s, dtype=np.int64)) for s in self.shapes)

    def flat(self, cs: list):
        return jnp.concatenate([jnp.ravel(c) for c in cs]) if cs else jnp.zeros((0,), self.dtype)

    def unflat(self, vec) -> list:
        out, o = [], 0
        for s in self.shapes:
            n = int(np.prod(s, dtype=np.int64))
            out.append(vec[o : o + n].reshape(s))
            o += n
        return out


def eval_scan(e: Eqn, vals, power, pert, record, idx, sinks=None, body_post=None, taps=None, unroll=True, *, evaluate):
    """A ``scan`` equation of the |·|^p network evaluated step by step (`pathspace_jax.squared.evaluate`, handed in
    as ``evaluate``, runs its body; its arguments of the same names are this scan's: ``pert`` its ``hooks`` entry,
    ``body_post`` its ``scan_posts`` entry, ``taps`` its `Tap`s by body equation). Returns its results as `V`s."""
    bp = e.body
    nc, ncar = e.scan.num_consts, e.scan.num_carry
    bk = [bp.kinds[i] for i in bp.in_ids]
    stable = any(isinstance(v, V) and v.e is not None for v in vals)
    fdt = next((v.m.dtype for v in vals if isinstance(v, V) and is_float(v.m)), jnp.float32)
    consts, xs = vals[:nc], vals[nc + ncar :]
    init = [to_v(v, power, stable, fdt) if bk[nc + j] != "const" else v for j, v in enumerate(vals[nc : nc + ncar])]
    xs_m = [v.m if isinstance(v, V) else v for v in xs]
    act = [j for j in range(ncar) if bk[nc + j] != "const"]
    carries = _Carries(act, [jnp.shape(init[j].m) for j in act], fdt)
    if pert is not None:
        _check_linear_body(bp)
    collect = sinks is not None and _collects(bp)
    data, make_post = body_post if body_post is not None else (None, None)
    tap_perts = None if taps is None else {k: t.pert for k, t in taps.items()}

    def step(carry, x):
        x_m, p_t, d_t, tp_t = x
        carry_v = [V(*c) if isinstance(c, tuple) else c for c in carry]
        x_v = [V(m, v.e) if isinstance(v, V) else m for m, v in zip(x_m, xs, strict=True)]
        perturb = None if p_t is None else dict(zip([bp.out_ids[j] for j in act], carries.unflat(p_t), strict=True))
        found = [] if collect else None
        taps_t = None
        if taps is not None:
            taps_t = {k: Tap(t.param, t.act, None if tp_t is None else tp_t[k], [], t.shapes) for k, t in taps.items()}
        post = None if make_post is None else make_post(d_t)
        outs = _eval_body(evaluate, bp, list(consts) + carry_v + x_v, power, perturb, found, post, taps_t)
        new = [tuple(to_v(o, power, stable, fdt)) if bk[nc + j] != "const" else o for j, o in enumerate(outs[:ncar])]
        ys = [tuple(o) if isinstance(o, V) else (o, None) for o in outs[ncar:]]
        if p_t is not None:
            ys.append((jax.lax.stop_gradient(carries.flat([carry_v[j].m for j in act])), None))
        if collect:
            s = sum_v(found)
            ys.append((s.m.astype(fdt), s.e))
        if taps_t is not None:  # the activation operands of the tapped products (one use each per step)
            ys.append(({k: jax.lax.stop_gradient(t.seen[0]) for k, t in taps_t.items()}, None))
        return new, ys

    init_c = [tuple(v) if isinstance(v, V) else v for v in init]
    carry, ys = jax.lax.scan(
        step,
        init_c,
        (xs_m, pert, data, tap_perts),
        length=e.scan.length,
        reverse=e.scan.reverse,
        unroll=scan_unroll(e.scan.length, nbytes(init_c)) if unroll and not e.layers else 1,
    )
    outs = [V(*c) if isinstance(c, tuple) else c for c in carry]
    if taps is not None:
        for k, x in ys.pop()[0].items():
            taps[k].seen.append(x)
    if collect:  # the paths that end at boundary nodes inside the body, over every step
        s_m, s_e = ys.pop()
        if s_e is None:
            sinks.append(V(jnp.sum(s_m), None))
        else:
            top = jnp.max(s_e)
            sinks.append(renorm(V(jnp.sum(ldexp(s_m, s_e - top)), top)))
    if pert is not None:
        _record_recurrence(e, evaluate, power, consts, init, xs, xs_m, carries, ys.pop()[0], record, idx)
    return outs + [_stacked(y_m, y_e) for y_m, y_e in ys]


def _stacked(m, e):
    """Values stacked over a scan's steps, each step's mantissa ``m[t]`` at its exponent ``e[t]`` (None: not
    tracked), as one `V` (an integer array as it is)."""
    if e is None:
        return V(m, None) if is_float(m) else m
    top = jnp.max(e)
    return renorm(V(ldexp(m, (e - top).reshape((-1,) + (1,) * (jnp.ndim(m) - 1))), top))


def _record_recurrence(e: Eqn, evaluate, power, consts, init, xs, xs_m, carries: _Carries, cin, record, idx) -> None:
    """Record what κ⁽²⁾ needs from a scan in ``record``: under ``idx``, a `ScanRecord` (``cin``: the carries entering
    every step; the squared body's carry-to-carry Jacobian), under ``("entries", idx)`` its recurrent entries
    (`_recurrent_entries`)."""
    bp, nc, ncar, act, fdt = e.body, e.scan.num_consts, e.scan.num_carry, carries.act, carries.dtype
    # the constant carries as the probes of `_recurrent_entries` need them, known: a literal start (a loop counter,
    # `lax.fori_loop`'s) as its value (under jit, ``jnp.asarray`` of it is traced)
    cv = [np.asarray(x[1]) if isinstance(x, tuple) else v for x, v in zip(e.ins[nc : nc + ncar], init, strict=True)]
    for j, v in enumerate(cv):
        if j not in act and isinstance(v, jax.core.Tracer) and is_key(v.dtype):
            with jax.ensure_compile_time_eval():  # what it draws is 1 in the |·|^p network: any key will do
                cv[j] = jnp.zeros(jnp.shape(v), v.dtype)
        elif j not in act and isinstance(v, jax.core.Tracer):
            raise bp.err(
                f"{bp.who}(second_order=True): the scan at {e.where} carries a value computed at run time besides "
                f"its activations (carry #{j}); the exact κ⁽²⁾ probes the recurrence with that value known (use "
                "second_order=False)"
            )
    x0 = [jax.lax.stop_gradient(m[0]) for m in xs_m]

    def carry_map(vec, cs, xv):
        body_in = list(cv)
        for j, c in zip(act, carries.unflat(vec), strict=True):
            body_in[j] = V(c, None)
        xv = [V(m, None) if isinstance(v, V) else m for m, v in zip(xv, xs, strict=True)]
        o = evaluate(bp, list(cs) + body_in + xv, power)
        return carries.flat([o[j].m if isinstance(o[j], V) else jnp.asarray(o[j], fdt) for j in act])

    n = carries.size
    cs = [jax.lax.stop_gradient(c) for c in consts]  # A carries no gradient
    a = jax.jacfwd(carry_map)(jnp.zeros((n,), fdt), cs, x0)
    record[idx] = ScanRecord(cin, a)
    record[("entries", idx)] = _recurrent_entries(e, bp, consts, xs_m, act, carry_map, n, fdt)


def _collects(prog: Program) -> bool:
    """Whether paths can end at boundary nodes in ``prog`` (or a scan body in it)."""
    return bool(prog.sinks or prog.bnd) or any(e.body is not None and _collects(e.body) for e in prog.eqns)


def _eval_body(
    evaluate,
    bp: Program,
    invals: list,
    power: float,
    perturb: dict | None,
    sinks: list | None = None,
    post=None,
    taps=None,
):
    """`evaluate` for a scan body, adding ``perturb[v]`` to the value of var v where it is produced (then
    applying ``post``, if given)."""
    if not perturb:
        return evaluate(bp, invals, power, sinks=sinks, post=post, taps=taps)
    produced = {o for e in bp.eqns for o in e.outs}
    if set(perturb) - produced:
        raise bp.err(
            f"{bp.who}(second_order=True): a scan carry is passed through its body unchanged; the exact κ⁽²⁾ "
            "is implemented for bodies that compute every carry (use second_order=False)"
        )

    def add(o, v):
        v = V(v.m + perturb[o].astype(v.m.dtype), v.e) if o in perturb else v
        return v if post is None else post(o, v)

    return evaluate(bp, invals, power, post=add, sinks=sinks, taps=taps)


def _check_linear_body(bp: Program) -> None:
    for e in bp.eqns:
        if bp.kinds[e.outs[0]] == "const" or all(o in bp.bnd for o in e.outs):
            continue  # (a boundary value is 1 in the |·|^p network: a random draw, a sample of a pinned output)
        if e.body is not None:  # a scan
            raise bp.err(
                f"{bp.who}(second_order=True): nested scan at {e.where}; the exact κ⁽²⁾ is implemented for one level "
                "of recurrence (use second_order=False for κ⁽¹⁾)"
            )
        if e.rule.breaks_linearity:
            zero = any(isinstance(x, tuple) and not np.any(np.asarray(x[1])) for x in e.ins)
            relu = e.rule.relu and (len(e.ins) == 1 or zero)  # max(x, 0)
            gate = not isinstance(e.ins[0], tuple) and e.ins[0] in bp.masks  # where(h > 0, h, 0): one case a step
            if not (relu or e.rule.op is Op.SELECT and gate):
                raise bp.err(
                    f"{bp.who}(second_order=True): {e.prim.name} at {e.where} makes the squared recurrent body "
                    "non-linear in its carry; the exact κ⁽²⁾ needs a ReLU cell (use second_order=False)"
                )


def _recurrent_entries(e, bp, consts, xs_m, act_carry, carry_map, n, fdt) -> list:
    """For each parameter const of the scan that maps carry to carry: (const position, src, dst, mask).

    Probes the squared body with concrete all-ones parameters. For an entry e, let d1_e = ∂c_out/∂p̃_e with
    the carry set to 1, and d2_e the same with the carry (1, 2, …, n), each minus its value at carry 0; both
    must be one unit entry at row dst_e, d1 equal to 1 there and d2 to src_e + 1 (an entry that adds
    p̃_e · c[src_e] to c_out[dst_e]); any other pattern is refused for κ⁽²⁾. The columns d1_e, d2_e are
    never formed (n × size(p) numbers: 15 GB for a 1550-unit kernel): each is contracted with weights w over
    its n rows, one VJP per w: with w = 1 and w = (1, …, n) a unit entry at dst_e gives 1 and dst_e + 1,
    and a random positive w must then give w[dst_e] (times src_e + 1 for d2), which any other column fails.
    """
    nc = e.scan.num_consts
    bk = [bp.kinds[i] for i in bp.in_ids]
    found = []
    with jax.ensure_compile_time_eval():
        cs = [jnp.ones(jnp.shape(c.m if isinstance(c, V) else c), fdt) for c in consts]
        x0 = [jnp.ones(jnp.shape(m)[1:], jnp.result_type(m)) for m in xs_m]
        ramp = np.arange(1, n + 1, dtype=np.float64)
        rand = np.random.default_rng(0).uniform(1.0, 2.0, n)
        ws = jnp.asarray(np.stack([np.ones(n), ramp, rand]), fdt)
        for j in range(nc):
            if bk[j] != "param":
                continue

            def contracted(carry, j=j):
                def f(pj):
                    c2 = list(cs)
                    c2[j] = pj
                    return carry_map(carry, c2, x0)

                out, vjp = jax.vjp(f, cs[j])
                return np.stack([np.asarray(vjp(w.astype(out.dtype))[0], np.float64).reshape(-1) for w in ws])

            d0 = contracted(jnp.zeros((n,), fdt))
            s1, m1, r1 = contracted(jnp.ones((n,), fdt)) - d0
            s2, _, r2 = contracted(jnp.asarray(ramp, fdt)) - d0
            cols = (s1 != 0) | (r1 != 0)
            if not cols.any():
                continue
            dst = np.clip(np.rint(m1).astype(np.int64) - 1, 0, n - 1)
            src = np.rint(s2).astype(np.int64) - 1
            w_dst = rand[dst]
            ok = ~cols | ((s1 == 1.0) & np.isclose(r1, w_dst, rtol=1e-5, atol=0.0) & (src >= 0) & (src < n))
            ok &= ~cols | np.isclose(r2, w_dst * (src + 1), rtol=1e-5, atol=0.0)
            if not ok.all():
                raise bp.err(
                    f"{bp.who}(second_order=True): the scan at {e.where} uses a parameter (its const #{j}) for carry-"
                    "to-carry connections other than single entries (e.g. a convolutional or two-layer recurrence); "
                    "the exact κ⁽²⁾ is implemented for dense recurrent kernels (use second_order=False)"
                )
            shape = jnp.shape(cs[j])
            found.append((j, np.where(cols, src, 0).reshape(shape), np.where(cols, dst, 0).reshape(shape),
                          cols.reshape(shape)))  # fmt: skip
    return found
