"""The rule table: what each JAX primitive means to pathspace_jax, in one place.

Every primitive the library understands has one `Rule`: how `pathspace_jax.trace` reads it when it finds the
path structure of a network (its tracing function, ``trace``), and how the |·|^p network behind path norms, κ and
DDP's statistics treats it (the other fields, `pathspace_jax.squared`). A primitive with no entry is "not known to
be positively homogeneous": ``trace`` pins the activations it touches and the |·|^p network refuses it.

Adding support for a primitive is one entry, `register`; for example a custom primitive that copies its
operand (`docs/architecture.md` walks through it, and ``tests/test_trace.py`` checks that the entry takes
effect)::

    rules.register("my_copy", rules.Rule(structure="relabel", as_is=True, passes_node=True, keeps_ones=True))

The tracing functions are grouped by concern in `pathspace_jax.rules_elementwise`, `rules_linear`, `rules_reduce`,
`rules_shape`, `rules_index`, `rules_control` and `pieces`; each is ``trace(walker, eqn, ins) -> outs``, on the
walker's abstract values (`pathspace_jax.tracer.Walker`). Primitive names and parameters are JAX's jaxpr format,
read in `pathspace_jax.jaxpr`.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable

from pathspace_jax import pieces
from pathspace_jax import rules_control as control
from pathspace_jax import rules_elementwise as elementwise
from pathspace_jax import rules_index as index
from pathspace_jax import rules_linear as linear
from pathspace_jax import rules_reduce as reduce
from pathspace_jax import rules_shape as shape

__all__ = ["Rule", "Op", "rule", "register", "names", "is_random", "draws", "STRUCTURES"]

# the families of primitives whose tracing function is one of these (``Rule(structure=...)``)
_FAMILIES = {
    "relabel": elementwise.relabel,
    "nonlinear": elementwise.nonlinear,
    "degree0": elementwise.degree0,
    "compare": elementwise.compare,
    "source": elementwise.source,
}
STRUCTURES = tuple(_FAMILIES)


class Op(enum.Enum):
    """The family of a primitive, for the code that tells operations apart by what their operands are (a dot's
    kernel, a quotient's numerator, a choice's condition), never by their names: `Rule.op`."""

    PLAIN = enum.auto()  # none that the library tells apart
    DOT = enum.auto()  # ``dot_general``: a linear map, its kernel an operand
    CONV = enum.auto()  # ``conv_general_dilated``: a linear map, its kernel an operand
    MUL = enum.auto()  # an elementwise product
    DIV = enum.auto()  # an elementwise quotient (the numerator first)
    ADD = enum.auto()  # an elementwise sum (``add``, ``add_any``)
    SUB = enum.auto()  # an elementwise difference
    SIGN_FREE = enum.auto()  # at most its operand's sign changed (``neg``, ``abs``; ``stop_gradient``)
    MAX = enum.auto()  # an elementwise maximum of its operands
    SELECT = enum.auto()  # ``select_n``: its first operand chooses among the others, entry by entry
    CAST = enum.auto()  # a dtype conversion
    BROADCAST = enum.auto()  # its operand copied along new axes (``broadcast_in_dim``)
    TRANSPOSE = enum.auto()  # its operand's axes permuted
    GATHER = enum.auto()  # entries gathered by indices (an embedding lookup by token ids)
    SPLIT = enum.auto()  # its operand cut into pieces along an axis
    UNSTACK = enum.auto()  # its operand cut into its slices along an axis
    CONCAT = enum.auto()  # its operands side by side along an axis
    SCAN = enum.auto()  # a loop over a fixed number of steps, or over layers
    WHILE = enum.auto()  # a loop whose number of steps is decided at run time
    COND = enum.auto()  # a choice between branches at run time


@dataclasses.dataclass(frozen=True)
class Rule:
    """What one primitive means to the library.

    How `pathspace_jax.trace` reads it: ``trace``, its tracing function, ``trace(walker, eqn, ins) -> outs`` (the
    walker, `pathspace_jax.tracer.Walker`; the equation; its operands' abstract values, `pathspace_jax.atoms.Val`;
    one value per result), which unifies and pins the atoms of its operands' axes; or ``structure``, the family
    it belongs to, whose function is then ``trace``:

    - ``"relabel"``: each output is its operand, same entries and axes (a dtype conversion, a copy, ``neg``);
    - ``"nonlinear"``: not positively homogeneous (``tanh``, ``exp``): the activations it reads are pinned;
    - ``"degree0"``: its output does not scale with its operands (``sign``): a constant of the structure;
    - ``"compare"``: as ``"degree0"``, and comparing an activation with a non-zero constant pins it;
    - ``"source"``: a fresh constant with no operands that matter (``iota``);
    - neither: unknown; the activations it touches are pinned ("not known to be positively homogeneous").

    The |·|^p network (`pathspace_jax.squared`; all False for a primitive it refuses):

    - ``as_is``: evaluated as it is on the network's non-negative values (shapes, ReLU's ``max``, sums);
    - ``passes_node``: a pre-activation passes through it without becoming a node of its own (its entries are
      its operand's: the |·|^p network does not renormalise after it);
    - ``merges_node``: it combines a pre-activation with other values (a bias add, a scale), the node goes on
      (without ``multiplicative``, an elementwise sum: no renormalisation after it either);
    - ``multiplicative``: a product whose constant factor is raised to the power p;
    - ``sums``: it adds values (a custom call made of ``as_is`` primitives without sums is kept whole);
    - ``keeps_ones``: maps an all-ones operand to all ones (the all-ones input's shortcuts);
    - ``same_entries``: a relabelling of the same entries (a bias reshaped to (1, m)), for DDP's outer products;
    - ``breaks_linearity``: makes a scan body non-linear in its carry (κ⁽²⁾ needs it linear; a ``relu`` is
      allowed);
    - ``view``: moves, copies or negates its operands' entries without combining them (a reshape, a slice, a
      concatenation): |·|^p of its result computed from parameters is the same operation on their |·|^p (its
      constant operands zero), where anything else computed from parameters alone is a coefficient computed
      from them as they are (`pathspace_jax.squared`);
    - ``relu``: the identity on non-negative values, a ReLU: a one-operand primitive always, a ``max`` where its
      other operand is a zero constant (``max(x, 0)``); the |·|^p network passes its operand on, a scan body
      stays linear through it, and DDP's forward pass differentiates ``max(x, 0)`` as ``jax.nn.relu``;
    - ``zero_only``: positively homogeneous only where its constant operands are zero (``max``, ``min``, a
      scatter of zeros): the |·|^p network refuses a non-zero one;
    - ``fills_neg_inf``: fills the entries it writes nothing into with −∞ (a segment max that no message
      reaches): no path there, 0 in the |·|^p network and in DDP's statistics.

    ``op`` (`Op`): the family the executors tell it apart by (a dot, a product, a sum, a choice, a loop).
    Derived from these: ``continues_node``, ``evaluated``, ``linear_map``, ``scales``, ``elementwise_sum``.
    """

    structure: str | None = None
    as_is: bool = False
    passes_node: bool = False
    merges_node: bool = False
    multiplicative: bool = False
    sums: bool = False
    keeps_ones: bool = False
    same_entries: bool = False
    breaks_linearity: bool = False
    op: Op = Op.PLAIN
    view: bool = False
    relu: bool = False
    zero_only: bool = False
    fills_neg_inf: bool = False
    trace: Callable | None = None

    @property
    def continues_node(self) -> bool:
        """A pre-activation's expression goes on through it (``passes_node`` or ``merges_node``)."""
        return self.passes_node or self.merges_node

    @property
    def evaluated(self) -> bool:
        """The |·|^p network computes it: as it is (``as_is``), or rewritten (a product with its constant factors
        raised, a difference as a sum, a sign dropped, a loop step by step)."""
        return self.as_is or self.op in _REWRITTEN

    @property
    def linear_map(self) -> bool:
        """A dot or a convolution: a linear map whose kernel is one of its operands."""
        return self.op in (Op.DOT, Op.CONV)

    @property
    def scales(self) -> bool:
        """An elementwise product or quotient."""
        return self.op in (Op.MUL, Op.DIV)

    @property
    def elementwise_sum(self) -> bool:
        """An elementwise sum or difference: a constant operand is an offset."""
        return self.op in (Op.ADD, Op.SUB)

    def __post_init__(self):
        if self.structure is None:
            return
        if self.structure not in _FAMILIES:
            raise ValueError(
                f"Rule.structure must be one of {STRUCTURES} or None, got {self.structure!r}; a primitive with a "
                "rule of its own gives its tracing function instead: Rule(trace=f), f(walker, eqn, ins) -> outs "
                "(see pathspace_jax.rules_elementwise for examples)"
            )
        if self.trace is not None and self.trace is not _FAMILIES[self.structure]:
            raise ValueError(f"Rule: give structure={self.structure!r} or trace=, not both")
        object.__setattr__(self, "trace", _FAMILIES[self.structure])


# the families the |·|^p network evaluates rewritten (`Rule.evaluated`)
_REWRITTEN = frozenset({Op.MUL, Op.DIV, Op.SUB, Op.SIGN_FREE, Op.DOT, Op.CONV, Op.SCAN})
_TABLE: dict[str, Rule] = {}
_UNKNOWN = Rule()
_RANDOM_PREFIXES = ("random_", "threefry", "rng_")
_DRAWS = frozenset({"random_bits"})


def rule(name: str) -> Rule:
    """The `Rule` of the primitive ``name`` (an empty rule, structure None, for a primitive with no entry)."""
    return _TABLE.get(name, _UNKNOWN)


def is_random(name: str) -> bool:
    """Whether the primitive ``name`` makes PRNG keys or draws random numbers from them (``jax.random``, Flax's
    ``Dropout`` and ``make_rng``): for the structure, its results are constants, like an input
    (`pathspace_jax.tracer.Walker.apply`)."""
    return name.startswith(_RANDOM_PREFIXES)


def draws(name: str) -> bool:
    """Whether the primitive ``name`` returns random numbers rather than keys (``random_bits``, what every
    ``jax.random`` sampler starts from): values of the traced function's inputs alone, as its keys are, which κ's
    |·|^p network takes as gates of value 1 and DDP's forward pass computes (`pathspace_jax.program._input_gates`)."""
    return name in _DRAWS


def names() -> frozenset[str]:
    """The primitives that have an entry."""
    return frozenset(_TABLE)


def register(name: str, entry: Rule, *, replace: bool = False) -> None:
    """Add the rule of the primitive ``name`` (``replace=True`` to change an existing entry).

    Programs already traced keep the rules they were traced with (`pathspace_jax.trace` and the |·|^p
    programs are cached per function and shapes).
    """
    if not isinstance(entry, Rule):
        raise TypeError(f"register: entry must be a pathspace_jax.rules.Rule, got {type(entry).__name__}")
    if name in _TABLE and not replace:
        raise ValueError(f"register: primitive {name!r} already has a rule; pass replace=True to change it")
    _TABLE[name] = entry


def _group(entry: Rule, *names: str) -> None:
    for name in names:
        register(name, entry)


# ---------------------------------------------------------------------------- the table

_SHAPE = dict(as_is=True, passes_node=True, keeps_ones=True, same_entries=True, view=True)
_group(Rule(trace=shape.rule_reshape, **_SHAPE), "reshape")
_group(Rule(trace=shape.rule_squeeze, **_SHAPE), "squeeze")
_group(Rule(trace=shape.rule_broadcast_in_dim, op=Op.BROADCAST, **_SHAPE), "broadcast_in_dim")
_group(Rule(None, **_SHAPE), "expand_dims")
_group(Rule("relabel", op=Op.CAST, **_SHAPE), "convert_element_type")
_group(Rule("relabel", as_is=True, passes_node=True, keeps_ones=True, view=True), "copy", "copy_p")
_group(Rule("relabel", as_is=True, passes_node=True, view=True), "reduce_precision")
_group(Rule(trace=shape.rule_transpose, as_is=True, passes_node=True, view=True, op=Op.TRANSPOSE), "transpose")
_group(Rule("relabel", passes_node=True, op=Op.SIGN_FREE, view=True), "neg")
# stop_gradient of an activation: the same values (the network's function does not see it); the |·|^p network
# computes it as the identity, so that κ counts the paths through it, while DDP's forward pass keeps it, as the
# user's gradient does. Of a pinned value or parameters: a constant of the structure (`rule_stop_gradient`)
_group(Rule(trace=elementwise.rule_stop_gradient, passes_node=True, keeps_ones=True, same_entries=True,
            op=Op.SIGN_FREE), "stop_gradient")  # fmt: skip
_group(Rule("relabel", view=True), "device_put", "optimization_barrier", "pvary", "sharding_constraint")
_group(Rule("relabel"), "real")

_group(Rule(trace=elementwise.rule_add, as_is=True, merges_node=True, sums=True, op=Op.ADD), "add", "add_any")
_group(Rule(trace=elementwise.rule_add, merges_node=True, op=Op.SUB), "sub")
_group(Rule(trace=elementwise.rule_mul, merges_node=True, multiplicative=True, op=Op.MUL), "mul")
_group(Rule(trace=elementwise.rule_div, merges_node=True, multiplicative=True, op=Op.DIV), "div")
_group(Rule(trace=linear.rule_dot_general, multiplicative=True, op=Op.DOT), "dot_general")
_group(Rule(trace=linear.rule_conv_general_dilated, multiplicative=True, op=Op.CONV), "conv_general_dilated")
_group(Rule(trace=reduce.rule_reduce_sum, as_is=True, sums=True), "reduce_sum")
_group(Rule(trace=reduce.rule_pool_sum, as_is=True, sums=True), "reduce_window_sum")
_group(Rule(trace=index.rule_scatter_add, as_is=True, sums=True), "scatter-add")
_group(Rule(trace=reduce.rule_cumulative, as_is=True, sums=True), "cumsum")
_group(Rule(trace=shape.rule_stack, as_is=True, view=True), "stack")
_group(Rule(trace=shape.rule_tile, as_is=True, view=True), "tile")
_group(Rule(trace=shape.rule_dynamic_slice, as_is=True, view=True), "dynamic_slice")
_group(Rule(trace=shape.rule_pad, as_is=True, view=True), "pad")
_group(Rule(trace=shape.rule_rev, as_is=True, view=True), "rev")
_group(Rule(trace=shape.rule_slice, as_is=True, view=True), "slice")
_group(Rule(trace=shape.rule_concatenate, as_is=True, view=True, op=Op.CONCAT), "concatenate")
_group(Rule(trace=index.rule_gather, as_is=True, view=True, op=Op.GATHER), "gather")
_group(Rule(trace=pieces.rule_split, as_is=True, view=True, op=Op.SPLIT), "split")
_group(Rule(trace=pieces.rule_unstack, as_is=True, view=True, op=Op.UNSTACK), "unstack")
_group(Rule(trace=index.rule_scatter, as_is=True, passes_node=True, zero_only=True), "scatter")  # x.at[ids].set(0)

_CHOICE = dict(as_is=True, breaks_linearity=True)
_group(Rule(trace=elementwise.rule_max, **_CHOICE, op=Op.MAX, relu=True, zero_only=True), "max")
_group(Rule(trace=reduce.rule_reduce_max, **_CHOICE), "reduce_max")
_group(Rule(trace=reduce.rule_pool_max, **_CHOICE), "reduce_window_max")
_group(Rule(trace=reduce.rule_cumulative, **_CHOICE), "cummax")
_group(Rule(trace=index.rule_scatter_max, **_CHOICE, fills_neg_inf=True), "scatter-max")
_group(Rule(trace=elementwise.rule_select_n, **_CHOICE, op=Op.SELECT, view=True), "select_n")
_group(Rule(trace=reduce.rule_argmax, breaks_linearity=True), "argmax")
_group(Rule(trace=reduce.rule_reduce_max, breaks_linearity=True), "reduce_min")
_group(Rule(trace=elementwise.rule_max, breaks_linearity=True, zero_only=True), "min")
_group(Rule(None, breaks_linearity=True), "sort")
_group(Rule(trace=reduce.rule_argmax), "argmin")
_group(Rule(trace=reduce.rule_cumulative), "cummin")
_group(Rule(trace=shape.rule_dynamic_update_slice), "dynamic_update_slice")
_group(Rule(trace=reduce.rule_pool_max), "reduce_window_min")
_group(Rule(trace=elementwise.rule_abs, op=Op.SIGN_FREE, view=True), "abs")
_group(Rule(trace=control.rule_scan, op=Op.SCAN), "scan")
_group(Rule(trace=control.rule_while, op=Op.WHILE), "while")
_group(Rule(trace=control.rule_cond, op=Op.COND), "cond")

_group(Rule("compare", as_is=True), "eq", "ne", "lt", "le", "gt", "ge")
_group(Rule("degree0", as_is=True), "not")
_group(Rule("degree0"), "sign", "is_finite")
_group(Rule(None, as_is=True), "and", "or")
_group(Rule("source"), "iota", "empty")
_group(
    Rule("nonlinear"),
    "tanh", "exp", "exp2", "log", "log1p", "expm1", "logistic", "sqrt", "rsqrt", "cbrt", "integer_pow", "square",
    "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "erf", "erfc",
    "erf_inv", "lgamma", "digamma", "pow", "atan2", "rem", "floor", "ceil", "round", "logaddexp", "reciprocal",
    "log2", "cumprod", "cumlogsumexp", "bessel_i0e", "bessel_i1e", "igamma", "igammac", "polygamma", "zeta",
    "regularized_incomplete_beta", "clamp", "reduce_prod",
)  # fmt: skip
