"""The tracer's abstract values: axis labels ("atoms") in a union-find, and the values that carry them.

Every array axis of a traced value carries a list of atoms (an axis flattened from several axes carries
several, in row-major order). Unifying two atoms says that two axes index the same nodes; pinning one says
its nodes are not part of the homogeneous network. `pathspace_jax.tracer` runs the rules that unify and pin.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

# ---------------------------------------------------------------------------
# Atoms: a union-find over axis labels.
# ---------------------------------------------------------------------------


class Atoms:
    def __init__(self):
        self.parent: list[int] = []
        self.size: list[int] = []
        self.expand: list[list[int] | None] = []  # product structure (row-major)
        self.alias: list[list[int] | None] = []  # concatenation of whole atoms
        # an alias's entries in this many blocks, each the children's blocks side by side (a layer's output whose
        # pieces interleave: GPT-NeoX's ``qkv.reshape(b, t, heads, 3 * d)`` split on its last axis); 1: side by side
        self.blocks: list[int] = []
        self.position: list[bool] = []
        self.input: list[bool] = []
        self.output: list[bool] = []
        self.reasons: list[list[str]] = []

    def new(self, size: int, *, position=False, input=False) -> int:
        i = len(self.parent)
        self.parent.append(i)
        self.size.append(int(size))
        self.expand.append(None)
        self.alias.append(None)
        self.blocks.append(1)
        self.position.append(position)
        self.input.append(input)
        self.output.append(False)
        self.reasons.append([])
        return i

    def find(self, a: int) -> int:
        root = a
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[a] != root:
            self.parent[a], a = root, self.parent[a]
        return root

    def factors(self, atoms: Sequence[int]) -> list[int]:
        """Fully expanded roots of a list of atoms."""
        out: list[int] = []
        for a in atoms:
            r = self.find(a)
            if self.expand[r] is None:
                out.append(r)
            else:
                out.extend(self.factors(self.expand[r]))
        return out

    def segments(self, axis: Sequence[int]) -> list[list[int]]:
        """The groups side by side in an axis (a concatenation's, or a fused layer's output cut into pieces), in
        order, each as its factor roots (a piece reshaped into heads: two; a feature map flattened with its positions:
        those and its channels); ``[factors]`` where the axis is one group."""
        fs = self.factors(axis)
        if len(fs) != 1 or self.alias[fs[0]] is None:
            return [fs]
        return [seg for s in self.alias[fs[0]] for seg in self.segments([s])]

    def resolve(self, atoms: Sequence[int]) -> list[int]:
        """`factors`, the groups side by side in a concatenation's axis in its place."""
        out: list[int] = []
        for r in self.factors(atoms):
            out.extend([r] if self.alias[r] is None else self.resolve(self.alias[r]))
        return out

    def pin(self, atoms: Sequence[int], reason: str) -> None:
        """Pin the factors of ``atoms``, and the groups side by side in any of them (a concatenation's)."""
        for r in self.factors(atoms):
            if reason not in self.reasons[r]:
                self.reasons[r].append(reason)
            if self.alias[r] is not None:
                self.pin(self.alias[r], reason)

    def make_positions(self, atoms: Sequence[int]) -> None:
        """Mark the factors of ``atoms`` as positions (time, space, a shared batch axis): shared by the nodes."""
        for r in self.factors(atoms):
            self.position[r] = True

    def set_expand(self, r: int, children: list[int]) -> None:
        self.expand[r] = list(children)
        for c in self.factors(children):
            self.position[c] |= self.position[r]
            self.input[c] |= self.input[r]
            self.output[c] |= self.output[r]
            self.reasons[c].extend(x for x in self.reasons[r] if x not in self.reasons[c])

    def set_alias(self, r: int, children: list[int], blocks: int = 1) -> None:
        """Make ``r`` the groups ``children`` side by side (it was cut into them), each with ``r``'s marks; with
        ``blocks`` > 1, in that many blocks, each the children's blocks side by side (their entries interleave)."""
        self.alias[r], self.blocks[r] = list(children), blocks
        for c in children:
            self.input[c] |= self.input[r]
            self.output[c] |= self.output[r]
            self.reasons[c].extend(x for x in self.reasons[r] if x not in self.reasons[c])

    def union(self, a: int, b: int, reason: str) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return
        if ra > rb:
            ra, rb = rb, ra
        assert self.size[ra] == self.size[rb], "union of atoms of different sizes"
        self.parent[rb] = ra
        self.position[ra] |= self.position[rb]
        self.input[ra] |= self.input[rb]
        self.output[ra] |= self.output[rb]
        self.reasons[ra].extend(x for x in self.reasons[rb] if x not in self.reasons[ra])
        ea, eb = self.expand[ra], self.expand[rb]
        if ea is None and eb is not None:
            self.expand[ra] = eb
        elif ea is not None and eb is not None:
            self.unify(ea, eb, reason)
        la, lb = self.alias[ra], self.alias[rb]
        if la is None:
            self.alias[ra], self.blocks[ra] = lb, self.blocks[rb]
        elif lb is not None and (la, self.blocks[ra]) != (lb, self.blocks[rb]):
            self.pin([ra], reason + " (two different concatenations tied together)")

    def unify(self, xs: Sequence[int], ys: Sequence[int], reason: str) -> None:
        """Make two axes (atom lists of equal total size) the same, factor by factor."""
        fa, fb = self.factors(xs), self.factors(ys)
        i = j = 0
        while i < len(fa) and j < len(fb):
            a, b = self.find(fa[i]), self.find(fb[j])
            sa, sb = self.size[a], self.size[b]
            if sa == sb:
                self.union(a, b, reason)
                i, j = i + 1, j + 1
                continue
            # split the larger atom into the run of smaller ones that makes it up
            small, big, k0, swap = (fa, b, i, False) if sa < sb else (fb, a, j, True)
            k, p = k0, 1
            while k < len(small) and p < self.size[big]:
                p *= self.size[self.find(small[k])]
                k += 1
            if p != self.size[big] or self.alias[big] is not None:
                self.pin(list(fa) + list(fb), reason + " (axes reshaped incompatibly)")
                return
            self.set_expand(big, [self.find(s) for s in small[k0:k]])
            if swap:
                i, j = i + 1, k
            else:
                i, j = k, j + 1


# ---------------------------------------------------------------------------
# Abstract values.
# ---------------------------------------------------------------------------

ACT, PARAM, CONST = "act", "param", "const"


class Pieces(NamedTuple):
    """A layer's output seen in pieces along ``axis`` and read piece by piece (`pathspace_jax.pieces`): each piece's
    axes, indexed by the entry of ``axis`` it starts at (``per``); the layer's node atom (``node``) and the axis its
    node axes begin at (``first``), None where a bias can no longer be added along them (transposed, or pieces of a
    kernel's slices)."""

    axis: int
    per: list
    node: int | None = None
    first: int | None = None


@dataclasses.dataclass
class Val:
    """kind: 'act' (depends on inputs and is rescaled with its nodes), 'param'
    (a view of one parameter leaf) or 'const' (fixed, or scale invariant: literals,
    integer inputs, predicates, masks). ``axes`` is one atom list per array axis
    ``scalars`` keeps the atoms of size-1 axes that were squeezed away (a single
    output unit read as ``y[:, 0]`` is still an output node)."""

    kind: str
    axes: list[list[int]]
    leaf: int | None = None
    zero: bool = False
    scalars: list[int] = dataclasses.field(default_factory=list)  # atoms of squeezed size-1 axes
    scaled: bool = False  # a parameter's view times fixed coefficients (BatchNorm's scale over its running deviation)
    # a fully pinned value times a per-unit parameter, (value, parameter), read once, by a product (`rule_mul`); or
    # coefficients computed from parameters times one (a gain per output unit), read once, as a kernel, in the making
    # (`idioms.kernel_scale`)
    factors: tuple | None = None
    # a constant computed from parameters (weight normalisation's v/‖v‖, a power iteration's vectors): a coefficient,
    # not a fixed input of the network
    from_params: bool = False
    # whole params leaves stacked along a new first axis, read only as a scan's xs (layers scanned over): the leaves'
    # values, one per layer (`rules_shape.rule_stack`)
    layers: tuple | None = None
    # a layer's output seen in pieces and read piece by piece (`pathspace_jax.pieces`)
    pieces: Pieces | None = None
    id: Any = None  # the value's id in the recorded program (`pathspace_jax.ir`), or ("lit", value)

    def with_id(self, i) -> Val:
        """A copy with id ``i`` (a shallow copy: cheaper than `dataclasses.replace`, run for every equation)."""
        out = copy.copy(self)
        out.id = i
        return out
