"""The rule table: what each JAX primitive means to pathspace_jax, in one place.

Every primitive the library understands has one `Rule`: how `pathspace_jax.trace` reads it when it finds the
path structure of a network (``structure``), and how the |·|^p network behind path norms, κ and DDP's
statistics treats it (the other fields, `pathspace_jax.squared`). A primitive with no entry is "not known to
be positively homogeneous": ``trace`` pins the activations it touches and the |·|^p network refuses it.

Adding support for a primitive is one entry, `register`; for example a custom primitive that copies its
operand (`docs/architecture.md` walks through it, and ``tests/test_trace.py`` checks that the entry takes
effect)::

    rules.register("my_copy", rules.Rule(structure="relabel", as_is=True, passes_node=True, keeps_ones=True))

The entries below are grouped by identical rules. Primitive names and parameters are JAX's jaxpr format,
read in `pathspace_jax.jaxpr`.
"""

from __future__ import annotations

import dataclasses
import enum

__all__ = ["Rule", "Op", "rule", "register", "names", "is_random", "draws", "STRUCTURES"]

STRUCTURES = ("method", "relabel", "nonlinear", "degree0", "compare", "source")


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

    ``structure``, how `pathspace_jax.trace` reads it:

    - ``"method"``: a rule of its own, the tracer's ``rule_<name>`` (products, sums, shapes, control flow);
    - ``"relabel"``: each output is its operand, same entries and axes (a dtype conversion, a copy, ``neg``);
    - ``"nonlinear"``: not positively homogeneous (``tanh``, ``exp``): the activations it reads are pinned;
    - ``"degree0"``: its output does not scale with its operands (``sign``): a constant of the structure;
    - ``"compare"``: as ``"degree0"``, and comparing an activation with a non-zero constant pins it;
    - ``"source"``: a fresh constant with no operands that matter (``iota``);
    - None: unknown; the activations it touches are pinned ("not known to be positively homogeneous").

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
        if self.structure is not None and self.structure not in STRUCTURES:
            raise ValueError(f"Rule.structure must be one of {STRUCTURES} or None, got {self.structure!r}")


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
    ``Dropout`` and ``make_rng``): for the structure, its results are constants, like an input (`Interpreter.apply`)."""
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

    A ``"method"`` structure needs a ``rule_<name>`` method on the tracer; the other structures need nothing
    else. Programs already traced keep the rules they were traced with (`pathspace_jax.trace` and the |·|^p
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
_group(Rule("method", **_SHAPE), "reshape", "squeeze", "broadcast_in_dim")
_group(Rule(None, **_SHAPE), "expand_dims")
_group(Rule("relabel", op=Op.CAST, **_SHAPE), "convert_element_type")
_group(Rule("relabel", as_is=True, passes_node=True, keeps_ones=True, view=True), "copy", "copy_p")
_group(Rule("relabel", as_is=True, passes_node=True, view=True), "reduce_precision")
_group(Rule("method", as_is=True, passes_node=True, view=True), "transpose")
_group(Rule("relabel", passes_node=True, op=Op.SIGN_FREE, view=True), "neg")
# stop_gradient of an activation: the same values (the network's function does not see it); the |·|^p network
# computes it as the identity, so that κ counts the paths through it, while DDP's forward pass keeps it, as the
# user's gradient does. Of a pinned value or parameters: a constant of the structure (`Interpreter.rule_stop_gradient`)
_group(Rule("method", passes_node=True, keeps_ones=True, same_entries=True, op=Op.SIGN_FREE), "stop_gradient")
_group(Rule("relabel", view=True), "device_put", "optimization_barrier", "pvary", "sharding_constraint")
_group(Rule("relabel"), "real")

_group(Rule("method", as_is=True, merges_node=True, sums=True, op=Op.ADD), "add", "add_any")
_group(Rule("method", merges_node=True, op=Op.SUB), "sub")
_group(Rule("method", merges_node=True, multiplicative=True, op=Op.MUL), "mul")
_group(Rule("method", merges_node=True, multiplicative=True, op=Op.DIV), "div")
_group(Rule("method", multiplicative=True, op=Op.DOT), "dot_general")
_group(Rule("method", multiplicative=True, op=Op.CONV), "conv_general_dilated")
_group(Rule("method", as_is=True, sums=True), "reduce_sum", "reduce_window_sum", "scatter-add", "cumsum")
_group(Rule("method", as_is=True, view=True), "stack", "tile", "dynamic_slice", "pad", "rev", "slice")
_group(Rule("method", as_is=True, view=True, op=Op.CONCAT), "concatenate")
_group(Rule("method", as_is=True, view=True, op=Op.GATHER), "gather")
_group(Rule("method", as_is=True, view=True, op=Op.SPLIT), "split")
_group(Rule("method", as_is=True, view=True, op=Op.UNSTACK), "unstack")
_group(Rule("method", as_is=True, passes_node=True, zero_only=True), "scatter")  # x.at[ids].set(0): entries set to 0

_CHOICE = dict(as_is=True, breaks_linearity=True)
_group(Rule("method", **_CHOICE, op=Op.MAX, relu=True, zero_only=True), "max")
_group(Rule("method", **_CHOICE), "reduce_max", "reduce_window_max", "cummax")
_group(Rule("method", **_CHOICE, fills_neg_inf=True), "scatter-max")
_group(Rule("method", **_CHOICE, op=Op.SELECT, view=True), "select_n")
_group(Rule("method", breaks_linearity=True), "argmax", "reduce_min")
_group(Rule("method", breaks_linearity=True, zero_only=True), "min")
_group(Rule(None, breaks_linearity=True), "sort")
_group(
    Rule("method"),
    "argmin", "clamp", "cummin", "dynamic_update_slice", "reduce_prod", "reduce_window_min",
)  # fmt: skip
_group(Rule("method", op=Op.SIGN_FREE, view=True), "abs")
_group(Rule("method", op=Op.SCAN), "scan")
_group(Rule("method", op=Op.WHILE), "while")
_group(Rule("method", op=Op.COND), "cond")

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
    "regularized_incomplete_beta",
)  # fmt: skip
