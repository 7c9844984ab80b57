"""The one module that reads JAX's internal jaxpr format.

Everything else in pathspace_jax (the structure interpreter in `pathspace_jax.trace`, the |·|^p network
of `pathspace_jax.squared`, DDP's forward pass) reads jaxprs through the functions here: equation
parameters (`param`), literals, source lines, the sub-jaxprs of call-like primitives, and how ``scan``,
``while`` and ``cond`` split their operands. The format changes between JAX releases; this module knows
each layout by what an equation holds, never by comparing version strings:

=====================  ==========================================  ==========================================
what                   JAX 0.10                                    JAX 0.11+
=====================  ==========================================  ==========================================
sub-jaxprs             mostly ``ClosedJaxpr`` (``remat2``: open)   open ``Jaxpr`` (constants hoisted to operands)
``scan`` split         ``num_consts``, ``num_carry``               ``ft_in`` = (consts, carry, xs) flat trees,
                                                                   ``ft_out`` = (carry, ys)
``jit`` / ``pjit``     ``jit`` with ``jaxpr``                      ``jit`` with ``jaxpr``
custom derivatives     ``custom_jvp_call`` / ``custom_vjp_call``   the same, ``call_jaxpr`` open
                       with ``call_jaxpr``
=====================  ==========================================  ==========================================

A layout it does not know raises `UnsupportedJaxprError`, naming the primitive, the installed JAX version
and the source line of the user's code that produced the equation.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.extend import core as jcore

from pathspace_jax.errors import UnsupportedJaxprError

__all__ = [
    "UnsupportedJaxprError",
    "at_top_level",
    "Scan",
    "While",
    "bind",
    "call_body",
    "closed",
    "cond_branches",
    "dynamically_sliced",
    "first_axis_entries",
    "float_dtypes",
    "fold_scalar",
    "in_avals",
    "out_avals",
    "is_literal",
    "literal_value",
    "loop_counter",
    "param",
    "primitive_names",
    "product",
    "reshape",
    "scan",
    "scan_split",
    "static_row",
    "static_slice",
    "varying_axes",
    "where",
    "while_loop",
    "widened_params",
]

Jaxpr = jcore.Jaxpr
ClosedJaxpr = jcore.ClosedJaxpr

# Parameters that hold the jaxpr of a call-like primitive (jit/pjit, custom_jvp_call, custom_vjp_call,
# remat2/checkpoint, closed_call, core_call): entered as if inlined.
_CALL_KEYS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
# Control flow with its own operand layout: never treated as a plain call.
_CONTROL = {"scan", "while", "cond"}


UNKNOWN_SOURCE = "<unknown source>"


def where(eqn) -> str:
    """``file:line (function)`` of the user's code that produced ``eqn``.

    JAX's own frames are skipped, and so are those of installed libraries (Flax, optax, this package):
    the line named is the first one in the user's own source (their model's ``__call__``), followed by
    the library line it went through, shortened to the package path (``in flax/linen/...:214``).
    """
    try:
        from jax._src import source_info_util  # private: imported here so that its drift costs a line, not import

        frames = list(source_info_util.user_frames(eqn.source_info.traceback))
    except Exception:  # pragma: no cover - private API drift
        return UNKNOWN_SOURCE
    if not frames:
        return UNKNOWN_SOURCE

    def fmt(f, path):
        if path == f.file_name and path.startswith(os.getcwd() + os.sep):
            path = os.path.relpath(path)
        return f"{path}:{f.start_line} ({f.function_name.split('.<locals>.')[0]})"

    def library_path(name: str) -> str | None:
        for marker in ("/site-packages/", "/dist-packages/"):
            if marker in name:
                return name.split(marker, 1)[1]
        return (
            "pathspace_jax/" + name.split("/pathspace_jax/", 1)[1] if "/pathspace_jax/pathspace_jax/" in name else None
        )

    inner = frames[0]
    for f in frames:
        if library_path(f.file_name) is None:  # the user's own line
            inside = library_path(inner.file_name)
            return fmt(f, f.file_name) + (f", in {fmt(inner, inside)}" if inside and f is not inner else "")
    return fmt(inner, library_path(inner.file_name) or inner.file_name)


def _unknown(eqn, what: str) -> UnsupportedJaxprError:
    return UnsupportedJaxprError(
        f"pathspace_jax does not know the jaxpr layout of primitive {eqn.primitive.name!r} in JAX {jax.__version__} "
        f"({what}; its params are {sorted(eqn.params)}), at {where(eqn)}. Please report it with your JAX version; "
        "an older or newer JAX release may work meanwhile."
    )


_REQUIRED = object()


def param(eqn, key: str, default: Any = _REQUIRED) -> Any:
    """``eqn.params[key]`` (or ``default``), else an `UnsupportedJaxprError` naming the primitive, JAX version
    and source line (never a bare ``KeyError``)."""
    if key in eqn.params:
        return eqn.params[key]
    if default is not _REQUIRED:
        return default
    raise _unknown(eqn, f"no parameter {key!r}")


def is_literal(x) -> bool:
    """True for an operand that is a literal constant written into the jaxpr (not a variable)."""
    return isinstance(x, jcore.Literal)


def literal_value(x) -> np.ndarray:
    """The value of a literal operand, as a numpy array of its dtype."""
    return np.asarray(x.val, x.aval.dtype)


def closed(j) -> ClosedJaxpr:
    """A sub-jaxpr as a ``ClosedJaxpr``: JAX 0.11+ stores open ``Jaxpr``s whose constants are operands."""
    if isinstance(j, ClosedJaxpr):
        return j
    if isinstance(j, Jaxpr):
        if j.constvars:
            raise UnsupportedJaxprError(
                f"an open sub-jaxpr with {len(j.constvars)} constant variables and no values for them "
                f"(JAX {jax.__version__}); pathspace_jax cannot evaluate it"
            )
        return ClosedJaxpr(j, ())
    raise TypeError(f"expected a Jaxpr or ClosedJaxpr, got {type(j).__name__}")


def in_avals(j) -> list:
    """The abstract values of a (closed or open) jaxpr's inputs."""
    inner = j.jaxpr if isinstance(j, ClosedJaxpr) else j
    return [v.aval for v in inner.invars]


def out_avals(j) -> list:
    """The abstract values of a (closed or open) jaxpr's outputs."""
    inner = j.jaxpr if isinstance(j, ClosedJaxpr) else j
    return [v.aval for v in inner.outvars]


def result_avals(eqn) -> list:
    """The abstract values of an equation's results."""
    return [v.aval for v in eqn.outvars]


def has_custom_derivative(eqn) -> bool:
    """Whether ``eqn`` is a call with derivatives of its own (``custom_jvp_call``, ``custom_vjp_call``: ``jax.nn.relu``
    is one), which the recording keeps as one equation beside its body's (`pathspace_jax.tracer.Walker.enter`)."""
    return eqn.primitive.name.startswith("custom_")


def call_body(eqn) -> ClosedJaxpr | None:
    """The jaxpr of a call-like equation (entered as if inlined), or None for every other primitive.

    Call-like: any primitive but scan/while/cond whose params hold one jaxpr under ``jaxpr``, ``call_jaxpr``
    or ``fun_jaxpr`` with as many inputs and outputs as the equation (``jit``/``pjit``, ``custom_jvp_call``,
    ``custom_vjp_call``, ``remat2``/``checkpoint``, ``closed_call``).
    """
    if eqn.primitive.name in _CONTROL:
        return None
    for k in _CALL_KEYS:
        sub = eqn.params.get(k)
        if isinstance(sub, (Jaxpr, ClosedJaxpr)):
            inner = sub.jaxpr if isinstance(sub, ClosedJaxpr) else sub
            if len(inner.invars) != len(eqn.invars) or len(inner.outvars) != len(eqn.outvars):
                raise _unknown(eqn, f"its {k} takes {len(inner.invars)} inputs for {len(eqn.invars)} operands")
            return closed(sub)
    return None


def random_state_only(j, is_random: Callable[[str], bool], free_outs: Sequence[bool] | None = None) -> list[bool]:
    """Per input of ``j``: whether its values reach nothing but the random primitives (``is_random``), through
    calls and scans: random state (a PRNG key, an nnx stream's counter), not data. ``free_outs``: the outputs whose
    values the caller uses only so (default: none, every output of ``j`` is used)."""
    inner = j.jaxpr if isinstance(j, ClosedJaxpr) else j
    ok = {v: True for v in inner.invars}
    for v, free in zip(inner.outvars, free_outs or [False] * len(inner.outvars), strict=True):
        if not is_literal(v) and not free:
            ok[v] = False

    def use_ok(e) -> list[bool]:
        outs_free = [ok.get(o, True) for o in e.outvars]
        if is_random(e.primitive.name):
            return [True] * len(e.invars)
        sub = call_body(e)
        if sub is not None:
            return random_state_only(sub, is_random, outs_free)
        if e.primitive.name == "scan":
            sc = scan(e)
            carry = outs_free[: sc.num_carry]  # a carry also feeds the next step: free only if free at the end
            return random_state_only(sc.body, is_random, carry + outs_free[sc.num_carry :])
        if e.primitive.name in _CONTROL:
            return [False] * len(e.invars)
        return [all(outs_free)] * len(e.invars)  # slicing, casts, a counter's increment: as free as their results

    for e in reversed(inner.eqns):
        for v, fine in zip(e.invars, use_ok(e), strict=True):
            if not is_literal(v) and not fine:
                ok[v] = False
    return [ok[v] for v in inner.invars]


def primitive_names(j) -> set[str]:
    """The names of the primitives a jaxpr runs, calls entered (control flow listed by its own name)."""
    inner = j.jaxpr if isinstance(j, ClosedJaxpr) else j
    out: set[str] = set()
    for e in inner.eqns:
        sub = call_body(e)
        out |= primitive_names(sub) if sub is not None else {e.primitive.name}
    return out


def float_dtypes(j) -> set:
    """The floating-point dtypes of the values a (closed or open) jaxpr holds: its inputs, constants, literals and
    results, sub-jaxprs included (calls, scan and loop bodies, branches)."""
    inner = j.jaxpr if isinstance(j, ClosedJaxpr) else j
    out: set = set()
    values = [*inner.invars, *inner.constvars, *inner.outvars]
    for e in inner.eqns:
        values += [*e.invars, *e.outvars]
        for p in e.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                if isinstance(sub, (Jaxpr, ClosedJaxpr)):
                    out |= float_dtypes(sub)
    for v in values:
        dtype = getattr(getattr(v, "aval", None), "dtype", None)
        if dtype is not None and jax.dtypes.issubdtype(dtype, np.floating):
            out.add(np.dtype(dtype))
    return out


# The params that name the floating-point type an equation computes in: a cast's target, a product's accumulation
# type, the type ``iota`` makes.
_DTYPE_KEYS = ("new_dtype", "preferred_element_type", "dtype")


def widened_params(prim_name: str, params: dict, dtype, narrower) -> dict:
    """``params`` with every floating-point type that ``narrower(t)`` says is narrower than ``dtype`` raised to
    ``dtype``, and a ``reduce_precision`` to fewer bits than ``dtype``'s made to round to ``dtype``'s own: the
    equation as it runs with its floating-point values in ``dtype`` (bfloat16 compute, float32 parameters)."""
    out = dict(params)
    for k in _DTYPE_KEYS:
        if out.get(k) is not None and narrower(out[k]):
            out[k] = np.dtype(dtype)
    if prim_name == "reduce_precision" and out["mantissa_bits"] < (info := jax.numpy.finfo(dtype)).nmant:
        out.update(exponent_bits=max(out["exponent_bits"], int(info.nexp)), mantissa_bits=int(info.nmant))
    return out


def equations(cj: ClosedJaxpr, ins: Sequence, new_id) -> tuple[list[tuple], list]:
    """The equations of a closed jaxpr without constants (calls entered), on value ids: ``ins`` for its inputs,
    ``new_id()`` for every result, ``("lit", value)`` for literals. Returns the equations as
    ``(primitive, params, ins, outs, source)`` and the ids of its results."""
    if cj.consts:
        raise ValueError("equations: the jaxpr must not close over arrays")
    out: list[tuple] = []

    def walk(j, env_ins):
        env = dict(zip(j.invars, env_ins, strict=True))

        def read(x):
            return ("lit", literal_value(x)) if is_literal(x) else env[x]

        for e in j.eqns:
            args = [read(x) for x in e.invars]
            sub = call_body(e)
            if sub is not None and not sub.consts:
                env.update(zip(e.outvars, walk(sub.jaxpr, args), strict=True))
                continue
            outs = [new_id() for _ in e.outvars]
            env.update(zip(e.outvars, outs, strict=True))
            out.append((e.primitive, dict(e.params), args, outs, e))
        return [read(x) for x in j.outvars]

    return out, walk(cj.jaxpr, list(ins))


class Scan(NamedTuple):
    """A ``scan`` equation: operands are ``consts + carry + xs``, results ``carry + ys``."""

    num_consts: int
    num_carry: int
    length: int
    reverse: bool
    body: ClosedJaxpr | None  # inputs consts + carry + x slices, outputs carry + y slices (None: layers rolled)


def scan_split(params: dict, num_operands: int) -> tuple[int, int]:
    """(num_consts, num_carry) of a scan from its params, in either layout (see the module docstring).

    Raises:
      KeyError: neither layout (the caller names the equation).
      ValueError: the counts do not add up to ``num_operands``.
    """
    if "num_consts" in params and "num_carry" in params:  # JAX <= 0.10
        nc, nk = int(params["num_consts"]), int(params["num_carry"])
        if nc + nk > num_operands:
            raise ValueError(f"num_consts + num_carry = {nc + nk} > {num_operands} operands")
        return nc, nk
    if "ft_in" in params:  # JAX >= 0.11: flat trees of the (consts, carry, xs) operand groups
        parts = params["ft_in"].unpack()
        sizes = [len(p) for p in parts]
        if len(sizes) != 3 or sum(sizes) != num_operands:
            raise ValueError(f"ft_in splits the operands as {sizes}, expected three groups of {num_operands} in all")
        return sizes[0], sizes[1]
    raise KeyError("num_consts/num_carry or ft_in")


def scan(eqn) -> Scan:
    """The operand split, length, direction and body of a ``scan`` equation."""
    try:
        nc, nk = scan_split(eqn.params, len(eqn.invars))
    except (KeyError, ValueError, AttributeError, TypeError) as e:
        raise _unknown(eqn, f"cannot split its operands into consts, carry and xs: {e}") from None
    return Scan(nc, nk, int(param(eqn, "length")), bool(param(eqn, "reverse")), closed(param(eqn, "jaxpr")))


class While(NamedTuple):
    """A ``while`` equation: operands are ``cond_consts + body_consts + carry``."""

    cond_nconsts: int
    body_nconsts: int
    cond: ClosedJaxpr
    body: ClosedJaxpr


def while_loop(eqn) -> While:
    """The operand split and jaxprs of a ``while`` equation."""
    return While(
        int(param(eqn, "cond_nconsts")),
        int(param(eqn, "body_nconsts")),
        closed(param(eqn, "cond_jaxpr")),
        closed(param(eqn, "body_jaxpr")),
    )


def cond_branches(eqn) -> list[ClosedJaxpr]:
    """The branches of a ``cond`` equation; its operands are ``index, *ops``, each branch takes ``ops``."""
    return [closed(b) for b in param(eqn, "branches")]


def bind(prim, params: dict, vals: Sequence) -> list:
    """Apply a primitive to concrete or traced values (as ``eval_jaxpr`` does); always returns a list."""
    bp = prim.get_bind_params(params)
    subfuns, kw = bp if isinstance(bp, tuple) else ((), bp)
    out = prim.bind(*subfuns, *vals, **kw)
    return list(out) if prim.multiple_results else [out]


_FOLD = {  # integer and boolean scalar arithmetic, as lax defines it (``rem``: the sign of the dividend)
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "neg": np.negative, "max": np.maximum,
    "min": np.minimum, "rem": np.fmod, "lt": np.less, "le": np.less_equal, "gt": np.greater,
    "ge": np.greater_equal, "eq": np.equal, "ne": np.not_equal, "and": np.bitwise_and, "or": np.bitwise_or,
    "not": np.invert, "convert_element_type": lambda x: x, "copy": lambda x: x,
}  # fmt: skip


def fold_scalar(eqn, values: Sequence) -> np.ndarray | None:
    """The result of ``eqn`` on known values, for integer and boolean scalars (a loop counter and the index
    arithmetic JAX writes around ``ws[i]``: ``i < 0``, ``i + n``, ``select_n``) and for such a scalar broadcast to
    one entry (the index array of ``jnp.take(ws, i, axis=0)``), else None."""
    if len(eqn.outvars) != 1 or any(np.shape(v) != () for v in values):
        return None
    aval = eqn.outvars[0].aval
    shape, name = getattr(aval, "shape", None), eqn.primitive.name
    if not (jax.numpy.issubdtype(aval.dtype, np.integer) or aval.dtype == bool):
        return None
    if name == "broadcast_in_dim" and shape is not None and np.prod(shape) == 1:
        return np.full(shape, values[0], aval.dtype)
    if shape != ():
        return None
    if name == "select_n":
        return np.asarray(values[1 + int(values[0])], aval.dtype)
    fold = _FOLD.get(name)
    return None if fold is None else np.asarray(fold(*values)).astype(aval.dtype)


def loop_counter(sc: Scan) -> int | None:
    """The carry index of a loop counter, an integer scalar that the body gives back plus 1 (``lax.fori_loop``'s
    ``i``), else None."""
    j = sc.body.jaxpr
    made = {o: e for e in j.eqns for o in e.outvars}
    for k, (v, o) in enumerate(zip(j.invars[sc.num_consts : sc.num_consts + sc.num_carry], j.outvars, strict=False)):
        e = made.get(o)
        if e is None or e.primitive.name != "add" or getattr(v.aval, "shape", None) != ():
            continue
        a, b = e.invars
        if jax.numpy.issubdtype(v.aval.dtype, np.integer) and (a is v) != (b is v):
            one = b if a is v else a  # the counter plus a literal 1
            if is_literal(one) and literal_value(one) == 1:
                return k
    return None


def dynamically_sliced(sc: Scan, k: int) -> bool:
    """Whether the body of scan ``sc`` reads its operand ``k`` with a ``dynamic_slice`` (``ws[i]``) or a ``gather``
    of one row (``jnp.take(ws, i, axis=0)``; not a lookup of a batch of ids), directly or inside a call
    (``jnp.take`` is a ``jit``)."""

    def one_row(e) -> bool:
        return e.primitive.name == "dynamic_slice" or (
            e.primitive.name == "gather" and getattr(e.invars[1].aval, "shape", None) == (1,)
        )

    def reads(jaxpr, v) -> bool:
        for e in jaxpr.eqns:
            if e.invars and e.invars[0] is v and one_row(e):
                return True
            sub = call_body(e)
            if sub is not None and any(reads(sub.jaxpr, w) for u, w in zip(e.invars, sub.jaxpr.invars) if u is v):
                return True
        return False

    return reads(sc.body.jaxpr, sc.body.jaxpr.invars[k])


def static_slice(eqn, starts: Sequence) -> tuple[Any, dict]:
    """``(primitive, params)`` of the static ``slice`` that a ``dynamic_slice`` equation is at known ``starts``
    (clamped, as ``dynamic_slice`` clamps them, so that the slice fits)."""
    sizes, in_shape = param(eqn, "slice_sizes"), eqn.invars[0].aval.shape
    lo = [min(max(int(s), 0), d - z) for s, d, z in zip(starts, in_shape, sizes, strict=True)]
    limits = tuple(a + z for a, z in zip(lo, sizes, strict=True))
    return jax.lax.slice_p, {"start_indices": tuple(lo), "limit_indices": limits, "strides": None}


def static_row(eqn, row: int) -> tuple[tuple[Any, dict], tuple[Any, dict]]:
    """``(primitive, params)`` of the static ``slice`` and the ``squeeze`` that a ``gather`` equation reading one
    whole row ``row`` of its operand's first axis (``jnp.take(ws, i, axis=0)``) is."""
    starts = (row, *[0] * (len(eqn.invars[0].aval.shape) - 1))
    return static_slice(eqn, starts), (jax.lax.squeeze_p, {"dimensions": (0,)})


@functools.lru_cache(maxsize=256)
def primitive_and_params(eqn) -> tuple[Any, dict]:
    """``(primitive, params)`` of a jaxpr equation, as a recorded equation holds them (`pathspace_jax.ir.Eqn`)."""
    return eqn.primitive, dict(eqn.params)


def reshape(shape: tuple, new_shape: tuple, dtype) -> tuple[Any, dict]:
    """``(primitive, params)`` of the ``reshape`` of a ``shape`` array of ``dtype`` to ``new_shape`` (the same
    number of entries), as the installed JAX writes it."""
    (eqn,) = jax.make_jaxpr(lambda a: jax.lax.reshape(a, new_shape))(jax.ShapeDtypeStruct(shape, dtype)).eqns
    return eqn.primitive, dict(eqn.params)


@functools.lru_cache(maxsize=256)
def product(shape: tuple, other: tuple, dtype) -> tuple[Any, dict]:
    """``(primitive, params)`` of the elementwise product of a ``shape`` array and an ``other`` one of one rank and
    ``dtype`` (its size-1 axes broadcast), as the installed JAX writes it."""
    spec = [jax.ShapeDtypeStruct(s, dtype) for s in (shape, other)]
    (eqn,) = jax.make_jaxpr(jax.lax.mul)(*spec).eqns
    return eqn.primitive, dict(eqn.params)


def varying_axes(x) -> frozenset:
    """The manual mesh axes (inside ``jax.shard_map``) along which ``x`` differs between devices; empty outside.

    Read from the type's ``manual_axis_type.varying`` (JAX 0.10+; ``vma`` in older releases).
    """
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    return frozenset(manual.varying if manual is not None else getattr(aval, "vma", ()))


def is_row_lookup(params: dict, operand_ndim: int, slice_sizes_tail: tuple, out_ndim: int) -> bool:
    """Whether a ``gather`` with these params reads whole rows of its operand: ``table[ids]`` (an embedding
    lookup: axis 0 indexed and collapsed, every other axis taken whole and placed last)."""
    dn = params["dimension_numbers"]
    return (
        tuple(dn.collapsed_slice_dims) == (0,)
        and tuple(dn.start_index_map) == (0,)
        and tuple(params["slice_sizes"]) == (1, *slice_sizes_tail)
        and tuple(dn.offset_dims) == tuple(range(out_ndim - operand_ndim + 1, out_ndim))
    )


def cast_dtype(params: dict):
    """The dtype a ``convert_element_type`` casts to, from its params."""
    return np.dtype(params["new_dtype"])


def is_plain_matmul(params: dict) -> bool:
    """Whether a ``dot_general`` with these params is ``a @ b`` of two matrices: the last axis of ``a``
    contracted with the first of ``b``, no batch axes."""
    return contracts_last_with_first(params, 2)


def slice_box(prim_name: str, params: dict) -> tuple[tuple[int, int], ...] | None:
    """The ``(start, limit)`` per axis of a static unit-stride ``slice`` equation, else None."""
    if prim_name != "slice" or any(s not in (None, 1) for s in params.get("strides") or ()):
        return None
    return tuple(zip(params["start_indices"], params["limit_indices"], strict=True))


def first_axis_entries(prim_name: str, params: dict, n_outs: int) -> list[int | None]:
    """For each result of an equation that cuts its operand along the first axis, the one entry of that axis it
    holds (a layer of a leaf of stacked layers: ``ws[i]``, ``jnp.split(ws, n)``, ``for w in ws`` on JAX 0.12+);
    None where it holds none or several."""
    if prim_name == "slice":
        box = slice_box(prim_name, params)
        return [box[0][0] if box and box[0][1] - box[0][0] == 1 else None]
    if prim_name in ("split", "unstack") and params.get("axis") == 0:
        if all(size == 1 for size in params.get("sizes", (1,) * n_outs)):
            return list(range(n_outs))
    return [None] * n_outs


def contracts_last_with_first(params: dict, lhs_ndim: int) -> bool:
    """Whether a ``dot_general`` with these params contracts the last axis of its lhs (``lhs_ndim`` axes) with
    the first of its rhs and nothing else, with no batch axes: a dense layer ``x @ W``."""
    (lhs_c, rhs_c), (lhs_b, rhs_b) = params["dimension_numbers"]
    return tuple(lhs_c) == (lhs_ndim - 1,) and tuple(rhs_c) == (0,) and not tuple(lhs_b) and not tuple(rhs_b)


def plain_conv_specs(params: dict) -> tuple | None:
    """``(lhs_spec, rhs_spec, out_spec, window_strides, padding)`` of a ``conv_general_dilated`` that is a plain
    strided convolution (no dilation, one feature and batch group), else None. The specs are
    ``ConvDimensionNumbers``' axis orders: (batch, feature, spatial...) of the input and the output, and
    (out feature, in feature, spatial...) of the kernel; padding as (low, high) pairs."""
    if params["feature_group_count"] != 1 or params["batch_group_count"] != 1:
        return None
    if any(d != 1 for d in (*params["lhs_dilation"], *params["rhs_dilation"])):
        return None
    dn = params["dimension_numbers"]
    pads = tuple(tuple(int(p) for p in pair) for pair in params["padding"])
    return tuple(dn.lhs_spec), tuple(dn.rhs_spec), tuple(dn.out_spec), tuple(params["window_strides"]), pads


def at_top_level() -> bool:
    """Whether operations run eagerly where this is called: no ``jit``, ``vmap``, ``grad`` or other trace around
    it. Only there may a ``jax.jit`` given ``compiler_options`` be called (JAX refuses them on a nested one)."""
    from jax._src import core  # JAX exports no public equivalent

    return core.trace_state_clean()
