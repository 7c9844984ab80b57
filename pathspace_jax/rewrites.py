"""Idioms the tracer reads whole, declared as patterns on how a value is used.

A rule sees one equation; an idiom spans several (weight normalisation's ``v / ‖v‖ * g`` read as a kernel, a
normalisation's scale multiplied into its reciprocal, leaves stacked for a scan, a fused kernel's output read in
pieces). Whether a value takes part in one is a question about its readers, which no rule asks itself: each
idiom's syntactic side is one `Pattern` here, and `Matches` answers them for a jaxpr, from its uses map built once
per jaxpr (a layer stack's body, run once per layer, is matched once), each answer computed once. A rule asks
``walker.matched(PATTERN, var)`` and decides the rest from the abstract values it holds (`pathspace_jax.idioms`,
`pathspace_jax.pieces`, `pathspace_jax.rules_shape.rule_stack`).

Patterns name primitives by their rules' families (`pathspace_jax.rules.Op`), never by name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from pathspace_jax import jaxpr as jx
from pathspace_jax import rules

__all__ = ["Pattern", "Matches", "PATTERNS", "READ_ONCE_BY_A_PRODUCT", "READ_AS_A_KERNEL", "SCANNED_OVER",
           "THROUGH_A_BIAS", "READS_THROUGH_TRANSPOSES"]  # fmt: skip


class Uses:
    """The readers of each variable of a jaxpr's live equations (None: an output of the jaxpr)."""

    def __init__(self, eqns, outvars):
        self._readers: dict[Any, list] = {}
        for eqn, var in [(e, v) for e in eqns for v in e.invars] + [(None, v) for v in outvars]:
            if not jx.is_literal(var):
                self._readers.setdefault(var, []).append(eqn)

    def __call__(self, var) -> list:
        return self._readers.get(var, [])

    def only(self, var):
        """The one equation that reads ``var``, or None (several readers, none, or an output)."""
        readers = self(var)
        return readers[0] if len(readers) == 1 else None


@dataclasses.dataclass(frozen=True)
class Pattern:
    """An idiom's syntactic side: ``find(uses, var)``, a fact about how the jaxpr variable ``var`` is used (None or
    False where the idiom does not apply); ``doc`` says which rule reads it."""

    name: str
    find: Callable[[Uses, Any], Any]
    doc: str = ""


def _rule(eqn) -> rules.Rule:
    return rules.rule(eqn.primitive.name)


def _read_once_by_a_product(uses: Uses, var) -> bool:
    u = uses.only(var)
    return u is not None and _rule(u).op is rules.Op.MUL


def _read_as_a_kernel(uses: Uses, var) -> bool:
    u = uses.only(var)
    if u is None:
        return False
    op, ops = _rule(u).op, rules.Op
    if op in (ops.CAST, ops.BROADCAST, ops.MUL) or op is ops.DIV and u.invars[0] is var:
        return _read_as_a_kernel(uses, u.outvars[0])
    return op in (ops.DOT, ops.CONV)


def _scanned_over(uses: Uses, var) -> bool:
    readers = uses(var)
    for u in readers:
        if u is None or _rule(u).op is not rules.Op.SCAN:
            return False
        sc = jx.scan(u)
        if any(x is var for x in u.invars[: sc.num_consts + sc.num_carry]):
            return False
    return bool(readers)


def _through_a_bias(uses: Uses, var):
    u = uses.only(var)
    return u.outvars[0] if u is not None and _rule(u).op is rules.Op.ADD else None


def _reads_through_transposes(uses: Uses, var, perm: tuple | None = None) -> tuple:
    out = []
    for u in uses(var) or [None]:
        if u is not None and _rule(u).op is rules.Op.TRANSPOSE:
            p = tuple(jx.param(u, "permutation"))
            composed = p if perm is None else tuple(perm[j] for j in p)
            out += _reads_through_transposes(uses, u.outvars[0], composed)
        else:
            out.append((perm, u, None if u is None else _rule(u).trace))
    return tuple(out)


READ_ONCE_BY_A_PRODUCT = Pattern(
    "read once by a product", _read_once_by_a_product,
    "`idioms.normalised_scale`: a normalised value times a per-unit scale, ``n * (s * p)``",
)  # fmt: skip
READ_AS_A_KERNEL = Pattern(
    "read as a kernel", _read_as_a_kernel,
    "`idioms.kernel_scale`: read once, by a dot_general or a convolution, or first cast (a kernel in a layer's "
    "compute dtype), broadcast, multiplied or divided",
)  # fmt: skip
SCANNED_OVER = Pattern(
    "scanned over", _scanned_over,
    "`rules_shape.rule_stack`: read only as the scanned operand (xs) of scans (leaves stacked for a scan)",
)  # fmt: skip
THROUGH_A_BIAS = Pattern(
    "through a bias", _through_a_bias,
    "`pieces.kernel_pieces`: the sum that is the value's only reader, where one adds to it (its bias)",
)  # fmt: skip
READS_THROUGH_TRANSPOSES = Pattern(
    "reads through transposes", _reads_through_transposes,
    "`pieces`: each reader (None: an output) after any transposes, as (the composed permutation, the reader, its "
    "tracing function); the reader's operand axis j is the value's axis perm[j] (perm None: no transpose)",
)  # fmt: skip
PATTERNS = (READ_ONCE_BY_A_PRODUCT, READ_AS_A_KERNEL, SCANNED_OVER, THROUGH_A_BIAS, READS_THROUGH_TRANSPOSES)


class Matches:
    """The patterns' answers for one jaxpr: the live equations, their uses map, and each pattern's fact about a
    variable, computed the first time a rule asks and kept."""

    def __init__(self, jaxpr: jx.Jaxpr, eqns: list):
        self.eqns, self.uses, self._facts = eqns, Uses(eqns, jaxpr.outvars), {}

    def __call__(self, pattern: Pattern, var):
        key = (pattern.name, var)
        if key not in self._facts:
            self._facts[key] = pattern.find(self.uses, var)
        return self._facts[key]
