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
from collections.abc import Callable

from pathspace_jax import pieces
from pathspace_jax import rules_control as control
from pathspace_jax import rules_elementwise as elementwise
from pathspace_jax import rules_index as index
from pathspace_jax import rules_linear as linear
from pathspace_jax import rules_reduce as reduce
from pathspace_jax import rules_shape as shape

__all__ = ["Rule", "rule", "register", "is_random", "draws", "STRUCTURES"]

# the families of primitives whose tracing function is one of these (``Rule(structure=...)``)
_FAMILIES = {
    "relabel": elementwise.relabel,
    "nonlinear": elementwise.nonlinear,
    "degree0": elementwise.degree0,
    "compare": elementwise.compare,
    "source": elementwise.source,
}
STRUCTURES = tuple(_FAMILIES)


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
    - ``breaks_linearity``: makes a scan body non-linear in its carry (κ⁽²⁾ needs it linear; ReLU's
      ``max(x, 0)`` is allowed).
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
    trace: Callable | None = None

    @property
    def continues_node(self) -> bool:
        """A pre-activation's expression goes on through it (``passes_node`` or ``merges_node``)."""
        return self.passes_node or self.merges_node

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

_SHAPE = dict(as_is=True, passes_node=True, keeps_ones=True, same_entries=True)
_group(Rule(trace=shape.rule_reshape, **_SHAPE), "reshape")
_group(Rule(trace=shape.rule_squeeze, **_SHAPE), "squeeze")
_group(Rule(trace=shape.rule_broadcast_in_dim, **_SHAPE), "broadcast_in_dim")
_group(Rule(None, **_SHAPE), "expand_dims")
_group(Rule("relabel", **_SHAPE), "convert_element_type")
_group(Rule("relabel", as_is=True, passes_node=True, keeps_ones=True), "copy", "copy_p")
_group(Rule("relabel", as_is=True, passes_node=True), "reduce_precision")
_group(Rule(trace=shape.rule_transpose, as_is=True, passes_node=True), "transpose")
_group(Rule("relabel", passes_node=True), "neg")
# stop_gradient of an activation: the same values (the network's function does not see it); the |·|^p network
# computes it as the identity, so that κ counts the paths through it, while DDP's forward pass keeps it, as the
# user's gradient does. Of a pinned value or parameters: a constant of the structure (`elementwise.rule_stop_gradient`)
_group(
    Rule(trace=elementwise.rule_stop_gradient, passes_node=True, keeps_ones=True, same_entries=True), "stop_gradient"
)
_group(Rule("relabel"), "device_put", "optimization_barrier", "pvary", "real", "sharding_constraint")

_group(Rule(trace=elementwise.rule_add, as_is=True, merges_node=True, sums=True), "add", "add_any")
_group(Rule(trace=elementwise.rule_add, merges_node=True), "sub")
_group(Rule(trace=elementwise.rule_mul, merges_node=True, multiplicative=True), "mul")
_group(Rule(trace=elementwise.rule_div, merges_node=True, multiplicative=True), "div")
_group(Rule(trace=linear.rule_dot_general, multiplicative=True), "dot_general")
_group(Rule(trace=linear.rule_conv_general_dilated, multiplicative=True), "conv_general_dilated")
_group(Rule(trace=reduce.rule_reduce_sum, as_is=True, sums=True), "reduce_sum")
_group(Rule(trace=reduce.rule_pool_sum, as_is=True, sums=True), "reduce_window_sum")
_group(Rule(trace=index.rule_scatter_add, as_is=True, sums=True), "scatter-add")
_group(Rule(trace=reduce.rule_cumulative, as_is=True, sums=True), "cumsum")
_group(Rule(trace=shape.rule_concatenate, as_is=True), "concatenate")
_group(Rule(trace=shape.rule_stack, as_is=True), "stack")
_group(Rule(trace=shape.rule_tile, as_is=True), "tile")
_group(Rule(trace=shape.rule_dynamic_slice, as_is=True), "dynamic_slice")
_group(Rule(trace=index.rule_gather, as_is=True), "gather")
_group(Rule(trace=shape.rule_pad, as_is=True), "pad")
_group(Rule(trace=shape.rule_rev, as_is=True), "rev")
_group(Rule(trace=shape.rule_slice, as_is=True), "slice")
_group(Rule(trace=pieces.rule_split, as_is=True), "split")
_group(Rule(trace=pieces.rule_unstack, as_is=True), "unstack")
_group(Rule(trace=index.rule_scatter, as_is=True, passes_node=True), "scatter")  # x.at[ids].set(0): set to zero

_group(Rule(trace=elementwise.rule_max, as_is=True, breaks_linearity=True), "max")
_group(Rule(trace=reduce.rule_reduce_max, as_is=True, breaks_linearity=True), "reduce_max")
_group(Rule(trace=reduce.rule_pool_max, as_is=True, breaks_linearity=True), "reduce_window_max")
_group(Rule(trace=index.rule_scatter_max, as_is=True, breaks_linearity=True), "scatter-max")
_group(Rule(trace=elementwise.rule_select_n, as_is=True, breaks_linearity=True), "select_n")
_group(Rule(trace=reduce.rule_cumulative, as_is=True, breaks_linearity=True), "cummax")
_group(Rule(trace=reduce.rule_argmax, breaks_linearity=True), "argmax")
_group(Rule(trace=elementwise.rule_max, breaks_linearity=True), "min")
_group(Rule(trace=reduce.rule_reduce_max, breaks_linearity=True), "reduce_min")
_group(Rule(None, breaks_linearity=True), "sort")
_group(Rule(trace=elementwise.rule_abs), "abs")
_group(Rule(trace=reduce.rule_argmax), "argmin")
_group(Rule(trace=reduce.rule_cumulative), "cummin")
_group(Rule(trace=shape.rule_dynamic_update_slice), "dynamic_update_slice")
_group(Rule(trace=reduce.rule_pool_max), "reduce_window_min")
_group(Rule(trace=control.rule_scan), "scan")
_group(Rule(trace=control.rule_while), "while")
_group(Rule(trace=control.rule_cond), "cond")

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
