"""The flat program's form: equations on integer value ids (`Eqn`, `Program`), and the `Recorder` that the
abstract interpreter (`pathspace_jax.tracer`) writes them with as it runs a jaxpr.

The interpreter is the one walk over a traced function's equations: every equation it interprets is recorded
once, calls inlined (a ``custom_jvp``/``custom_vjp`` call also kept as one equation with its body's equations,
``inner``), a scan over layers once per layer (where: `LayerStack`), a recurrence as one ``scan`` equation whose
``body`` is a recording of its own. `pathspace_jax.program` turns the recording into the `Program` that the |·|^p
network, the forward executor and DDP-Normalization run.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import itertools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pathspace_jax import jaxpr as jx
from pathspace_jax import rules


class Role(enum.Enum):
    """What a finished program made of one equation (`pathspace_jax.program`, once per program): the executors
    dispatch on it, in this order of precedence."""

    SCAN = enum.auto()  # a recurrence or a stack of layers kept rolled: its ``body`` a program of its own
    CONST = enum.auto()  # its results are constants (they depend on no input and no parameter)
    PARAM = enum.auto()  # its results are computed from parameters alone (a view of one, or a coefficient)
    MASK = enum.auto()  # its result is an activation of degree 0 (`Program.masks`)
    BOUNDARY = enum.auto()  # its results are boundary values (`Program.bnd`)
    LOOKUP = enum.auto()  # an embedding lookup (`Program.lookups`)
    ACT = enum.auto()  # any other operation on activations


@dataclasses.dataclass
class Eqn:
    prim: Any
    params: dict
    ins: list  # value ids, or ("lit", value)
    outs: list[int]
    source: Any = None  # the jaxpr equation it was read from (its source line: `where`)
    callers: tuple = ()  # the call equations it was inlined from, outermost first (`where` where source has none)
    scan: jx.Scan | None = None  # for a scan: its operand split, length, direction
    body: Any = None  # for a scan: its body, a `Frame` as recorded, a `Program` once finished
    inner: list[Eqn] | None = None  # for a custom_jvp/custom_vjp call: its body's equations, as recorded
    edge: bool = False  # an elementwise product the trace made an edge (a learned per-unit scale, `rules_elementwise`)
    coefficient: bool = (
        False  # a product by a learned scalar, a coefficient on the paths (`rules_elementwise.rule_mul`)
    )
    # a maximum over entries that different weights feed (maxout by a reshape, max pooling after nn.ConvLocal)
    exclusive: bool = False
    layers: bool = False  # a scan over layers that the program keeps rolled (`pathspace_jax.rolled`): never unrolled
    # a custom_jvp/custom_vjp call that the finished program keeps whole (ReLU-like code: `program._kept_whole`)
    whole: bool = False
    role: Role | None = None  # what the finished program made of it (None while recorded)

    @property
    def rule(self) -> rules.Rule:
        """The primitive's entry in the rule table (`pathspace_jax.rules`)."""
        return rules.rule(self.prim.name)

    @property
    def where(self) -> str:
        """The user's source line of the equation, or of the innermost call it was inlined from that has one (the
        body of a helper that JAX traced once and caches, such as ``jnp.where``'s, names no user line)."""
        for source in (self.source, *reversed(self.callers)):
            if source is not None and (line := jx.where(source)) != jx.UNKNOWN_SOURCE:
                return line
        return jx.UNKNOWN_SOURCE


@dataclasses.dataclass
class LayerStack:
    """A scan over layers as the interpreter recorded it, its body once per layer (`rules_control._layer_stack`):
    where each layer's equations lie in the frame and what they read and give, so that `pathspace_jax.program` can
    keep it one ``scan`` where the layers' recordings are the same up to ids (`pathspace_jax.rolled`)."""

    eqn: Any  # the scan's jaxpr equation (its source line)
    callers: tuple
    scan: jx.Scan
    init: list  # the carry's initial ids
    xs: list  # the ids of the scanned operands (stacked over the layers)
    spans: list  # each layer's equations, (start, end) in the frame's, in the order they ran
    ins: list  # each layer's body inputs (ids): consts, carry, its slices of xs
    outs: list  # each layer's body outputs (ids): carry, ys
    ys: list  # the ids of the ys stacked over the layers
    plain: bool  # its xs are params leaves or activations sliced along the layers (no counter, no stacked leaves)


@dataclasses.dataclass
class Frame:
    """What the interpreter records for one jaxpr: its input ids, equations, constants and output ids, and the
    scans over layers recorded in it."""

    in_ids: list[int] = dataclasses.field(default_factory=list)
    eqns: list[Eqn] = dataclasses.field(default_factory=list)
    consts: dict[int, Any] = dataclasses.field(default_factory=dict)
    out_ids: list = dataclasses.field(default_factory=list)
    stacks: list[LayerStack] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Program:
    eqns: list[Eqn]
    n_params: int
    in_ids: list[int]  # param ids then input ids
    out_ids: list  # var ids or ("lit", value)
    consts: dict[int, Any]
    kinds: dict[int, str]  # "act" | "param" | "const"
    nodes: list[int]  # var ids that are node pre-activations (in order of finalisation)
    outputs: list[int]  # var ids of the function's outputs that are nodes
    who: str = "path_kappa"  # the public function errors are reported for
    err: type = ValueError  # the error it raises
    pinned: set[int] = dataclasses.field(default_factory=set)  # act vars in a boundary group (from trace)
    sinks: list[int] = dataclasses.field(default_factory=list)  # pinned nodes: paths end here
    bnd: set[int] = dataclasses.field(default_factory=set)  # other boundary values: 1 in the |·|^p network
    gates: set[int] = dataclasses.field(default_factory=set)  # of those, gates computed from the inputs alone
    of_inputs: set[int] = dataclasses.field(default_factory=set)  # values of the inputs alone, no parameter: gates too
    masks: set[int] = dataclasses.field(default_factory=set)  # activations of degree 0 (``h > 0``): `program._masks`
    lookups: set[int] = dataclasses.field(default_factory=set)  # results of embedding lookups
    fixed: set[int] = dataclasses.field(default_factory=set)  # params combined into fixed coefficients (trace)
    # act values of groups pinned in part, by their `pathspace_jax.trace.Cut` (None: pieces joined back, rearranged)
    cut: dict[int, Any] = dataclasses.field(default_factory=dict)
    # of those, the pieces of a cut node concatenated back for a reader of the whole (`pathspace_jax.cut_nodes`)
    joins: set[int] = dataclasses.field(default_factory=set)
    into_sinks: set[int] = dataclasses.field(default_factory=set)  # sums a sink continues (`program._into_sinks`)
    # `uses` and `made` of the equations as they are now (the list itself: rebuilt when ``eqns`` is replaced)
    _index: tuple | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    @property
    def uses(self) -> dict[int, list[Eqn]]:
        """Each value's readers, in program order: one entry per operand that reads it (``x * x`` reads ``x``
        twice). Built once per list of equations."""
        return self._indexed()[0]

    @property
    def made(self) -> dict[int, Eqn]:
        """The equation that computes each value."""
        return self._indexed()[1]

    def _indexed(self) -> tuple[dict, dict]:
        if self._index is None or self._index[0] is not self.eqns:
            uses: dict[int, list[Eqn]] = {}
            for e in self.eqns:
                for x in e.ins:
                    if not isinstance(x, tuple):
                        uses.setdefault(x, []).append(e)
            self._index = (self.eqns, uses, {o: e for e in self.eqns for o in e.outs})
        return self._index[1:]

    def edge_param(self, x) -> bool:
        """Whether operand ``x`` is a parameter as an edge tensor: a view of one params leaf, not a
        combination of leaves into fixed coefficients (a kernel concatenated from two, ``fixed``)."""
        return not isinstance(x, tuple) and self.kinds[x] == "param" and x not in self.fixed

    def is_edge(self, e) -> bool:
        """Whether equation ``e`` is an edge product: a dot or convolution with an edge parameter operand, or a
        per-unit scale (``e.edge``)."""
        edges = e.edge or e.rule.linear_map
        return edges and any(map(self.edge_param, e.ins))


class Recorded(list):
    """A rule's results that are recorded already (a call's body inlined, a scan): the walker
    (`pathspace_jax.tracer.Walker.run`) keeps their ids and records nothing more for the equation."""


class Recorder:
    """Where the interpreter writes the equations it runs: a stack of `Frame`s (the function's, then a scan
    body's while it runs), fresh ids, and each recorded value's atoms (``notes``: its atoms if it is an
    activation, ``"const"`` if it depends on no input, else None) for the flags `pathspace_jax.trace.record`
    derives from them once every atom is settled."""

    def __init__(self):
        self._ids = itertools.count()
        self.frames = [Frame()]
        self.notes: dict[int, Any] = {}

    @property
    def top(self) -> Frame:
        return self.frames[0]

    def new(self) -> int:
        return next(self._ids)

    def const(self, value) -> int:
        """A constant of the current frame (a closed jaxpr's consts)."""
        i = self.new()
        self.frames[-1].consts[i] = value
        return i

    def emit(self, eqn: Eqn) -> None:
        self.frames[-1].eqns.append(eqn)

    def value(self, x, max_size: int = 1 << 22):
        """The concrete value of a recorded constant ``x`` (an id, or ``("lit", value)``) computed in the current
        frame from literals and the frame's constants alone (a selection kernel built from ``iota``), or None:
        where it reads anything else, or any value on its way has more than ``max_size`` entries."""
        frame = self.frames[-1]
        made = {o: e for e in frame.eqns for o in e.outs}
        memo: dict[int, Any] = {}

        def ev(v):
            if isinstance(v, tuple):
                return np.asarray(v[1])
            if v in frame.consts:
                c = frame.consts[v]
                return None if isinstance(c, jax.core.Tracer) or np.size(c) > max_size else np.asarray(c)
            if v not in memo:
                e = made.get(v)
                ins = None if e is None or e.body is not None or e.inner is not None else [ev(u) for u in e.ins]
                memo[v] = None
                if ins is not None and all(a is not None for a in ins):
                    outs = jax.eval_shape(lambda *a, e=e: jx.bind(e.prim, e.params, a), *ins)
                    if all(np.prod(o.shape, dtype=np.int64) <= max_size for o in outs):
                        with jax.ensure_compile_time_eval():
                            res = jx.bind(e.prim, e.params, ins)
                        memo.update((o, np.asarray(r)) for o, r in zip(e.outs, res, strict=True))
            return memo[v]

        return ev(x)

    def push(self, *, consts_of_caller: bool = False) -> Frame:
        """Record into a new frame (a scan body; with ``consts_of_caller``, a call's body whose constants
        belong to the frame that calls it)."""
        frame = Frame(consts=self.frames[-1].consts if consts_of_caller else {})
        self.frames.append(frame)
        return frame

    def pop(self) -> Frame:
        return self.frames.pop()

    def layers(self, x, shape, dtype) -> list:
        """Record the slices ``x[0], x[1], ...`` of a value stacked over layers (leading axis); their ids."""
        return self._inline(_layers_of(tuple(shape), dtype), [x])  # (a PRNG key dtype too: not a numpy one)

    def stack(self, xs: list, shape, dtype) -> int:
        """Record the values ``xs`` (one per layer, each of ``shape``) stacked along a new leading axis; its id."""
        return self._inline(_stacked(tuple(shape), dtype, len(xs)), xs)[0]

    def _inline(self, closed, ins: list) -> list:
        eqns, outs = jx.equations(closed, ins, self.new)
        for prim, params, e_ins, e_outs, source in eqns:
            self.emit(Eqn(prim, params, e_ins, e_outs, source))
        return outs


# The library's own small functions that a scan over layers adds to a program, traced once per shape.
@functools.lru_cache(maxsize=256)
def _layers_of(shape: tuple, dtype):
    return jax.make_jaxpr(lambda x: [x[i] for i in range(shape[0])])(jax.ShapeDtypeStruct(shape, dtype))


@functools.lru_cache(maxsize=256)
def _stacked(shape: tuple, dtype, n: int):
    spec = jax.ShapeDtypeStruct(shape, dtype)
    return jax.make_jaxpr(lambda *v: jnp.concatenate([x[None] for x in v]))(*[spec] * n)
