"""The static IR of a traced network: node groups, edge tensors and the `PathSpace`.

A `PathSpace` is what `pathspace_jax.trace` finds in a forward function: the
*reduction graph* of its ReLU part ("Path Space for Recurrent Neural Networks with ReLU
Activations"; Meng et al., ICLR 2019). Nodes are numbered globally:

* node 0 is the **bias node** (its output is the constant 1);
* every other node belongs to exactly one **node group** — the input features, a
  hidden layer's units (or a conv layer's channels), the outputs, or a group that
  was **pinned** because something that is not positively homogeneous per node
  touches it (tanh, a normalisation, a product of activations, ...).

Every parameter entry is an edge ``src -> dst`` between two nodes: a Dense
kernel entry ``W[i, j]`` goes from node i of its input group to node j of its
output group, a conv kernel tap ``K[kh, kw, i, j]`` from channel i to channel j
(each tap its own edge), a bias entry from the bias node, an embedding row from a
one-hot input node, and a recurrent kernel entry from a group to itself.

Node-wise rescaling T_α multiplies every edge ``u -> v`` by ``α_v / α_u``, with
α = 1 on the bias, input, output and pinned nodes. Only the **hidden** nodes carry
free factors; their number is ``num_hidden`` (H).

The object is frozen and hashable and holds no JAX arrays (only Python values and
read-only numpy index arrays), so it can be closed over by ``jit``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import warnings
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from pathspace_jax.errors import user_stacklevel

GroupKind = Literal["input", "hidden", "output", "pinned"]
LeafKind = Literal["weight", "bias", "other"]

BIAS_NODE = 0


def node_view(small: np.ndarray, sizes, shape) -> np.ndarray:
    """A read-only int32 array of ``shape``: ``small`` broadcast to ``sizes`` (the leaf's axes split into atoms,
    in order), reshaped. A view holding no entry per parameter: where atoms split a leaf's axis, only the axes
    along which ``small`` varies are materialised, at their own length."""
    small, sizes, shape = np.asarray(small, np.int32), tuple(sizes), tuple(shape)
    small = small.reshape((1,) * (len(sizes) - small.ndim) + small.shape)
    if sizes != shape:
        groups, k = [], 0  # the atoms of each leaf axis: a reshape merges consecutive ones
        for n in shape:
            group, size = [], 1
            while k < len(sizes) and size * sizes[k] <= n and (size < n or sizes[k] == 1):
                size *= sizes[k]
                group.append(k)
                k += 1
            groups.append(group)
        if k == len(sizes) and all(np.prod([sizes[j] for j in g]) == n for g, n in zip(groups, shape)):
            varies = [any(small.shape[j] > 1 for j in g) for g in groups]
            keep = [sizes[j] if v else 1 for g, v in zip(groups, varies) for j in g]
            merged = [n if v else 1 for n, v in zip(shape, varies)]
            small, sizes = np.broadcast_to(small, keep).reshape(merged), shape
        else:  # a shape the atoms do not tile in order (not produced by trace): materialise
            small, sizes = np.broadcast_to(small, sizes).reshape(shape), shape
    out = np.broadcast_to(small, shape)
    out.setflags(write=False)
    return out


def reduced(a: np.ndarray) -> tuple[np.ndarray, tuple[int, ...]]:
    """The smallest array broadcasting back to ``a`` (size 1 on the axes along which ``a`` is constant), and those
    axes. O(size of the result) on a broadcast view (`node_view`): its axes of stride 0 are dropped without
    reading; the remaining ones are compared value by value, so the result is the same for a copy."""
    a = np.asarray(a)
    a = a[tuple(slice(0, 1) if n > 1 and st == 0 else slice(None) for n, st in zip(a.shape, a.strides))]
    for k in range(a.ndim):
        if a.shape[k] > 1:
            first = a[(slice(None),) * k + (slice(0, 1),)]
            if np.array_equal(np.broadcast_to(first, a.shape), a):
                a = first
    out = np.ascontiguousarray(a)
    out.setflags(write=False)
    return out, tuple(k for k in range(a.ndim) if a.shape[k] == 1)


def compute_dtype(leaves) -> np.dtype:
    """The dtype path-space arithmetic runs in: float32 for half-precision leaves, else the widest float."""
    floats = [jnp.result_type(x) for x in leaves if jnp.issubdtype(jnp.result_type(x), jnp.floating)]
    return jnp.promote_types(jnp.result_type(*floats) if floats else jnp.float32, jnp.float32)


def leaf_path_strings(tree) -> list[str]:
    """Key paths of the leaves of ``tree`` as ``"Dense_0/kernel"`` strings (nnx ``.value`` dropped)."""
    out = []
    for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        parts = []
        for k in path:
            if isinstance(k, jax.tree_util.DictKey):
                parts.append(str(k.key))
            elif isinstance(k, jax.tree_util.SequenceKey):
                parts.append(str(k.idx))
            elif isinstance(k, jax.tree_util.GetAttrKey):
                parts.append(k.name)
            else:
                parts.append(str(k))
        if len(parts) > 1 and parts[-1] == "value":
            parts.pop()
        out.append("/".join(parts) or "<root>")
    return out


def check_path_space(space, who: str) -> None:
    """TypeError unless ``space`` is a `PathSpace` (every public function that takes one calls this)."""
    if not isinstance(space, PathSpace):
        raise TypeError(f"{who}: space must be a PathSpace from pathspace_jax.trace(fn, params, *args), got {space!r}")


# the note of a leaf that ``stop_gradient`` holds fixed (`pathspace_jax.tracer`): no gradient reaches it, so passing
# it to the plain update changes nothing (`warn_if_plain` does not count it)
FROZEN = "held fixed (a frozen layer)"


def warn_if_plain(space: PathSpace, who: str) -> None:
    """A ``UserWarning`` (at the user's line) where ``space`` has no hidden node: a path-space optimiser there is its
    plain form (G-SGD is SGD, Path-SGD a per-leaf rescaled SGD), which a user would otherwise not notice; and where
    most parameters are in leaves that are no edge (kind ``"other"``, not frozen), which every optimiser passes
    through to its plain update."""
    other = [leaf for leaf in space.leaves if leaf.kind == "other" and FROZEN not in leaf.note]
    other.sort(key=lambda leaf: -leaf.size)
    n_other = sum(leaf.size for leaf in other)
    if space.num_hidden and 2 * n_other > space.num_params:
        named = "; ".join(f"{leaf.path}: {leaf.note}" for leaf in other[:3]) + ("; ..." if len(other) > 3 else "")
        warnings.warn(
            f"{who}: {n_other} of the network's {space.num_params} parameters are in leaves that are no edge of the "
            f"traced network ({named}); this optimiser passes their gradients to its plain update, so most of the "
            "network is not optimised in path space. See pathspace_jax.describe(space) for why.",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
    if space.num_hidden == 0:
        warnings.warn(
            f"{who}: the traced network has no hidden node that can be rescaled (every group is an input, an output "
            "or pinned; see pathspace_jax.describe(space) for why), so this optimiser reduces to its plain form. "
            "Common causes: BatchNorm with running statistics between layers (fold it into the convolution for "
            "inference, or train with DDP-Normalization instead), or a non-ReLU activation everywhere.",
            UserWarning,
            stacklevel=user_stacklevel(),
        )


# what a user can do about a pinned group, by a phrase one of its reasons holds (the tracer's wording), most
# specific first (a reason that says it already, like dropout's, has none)
PIN_HINTS = (
    ("its pieces interleaved", "read the reshaped output only in whole pieces of one width along one axis (q, k, "
     "v = jnp.split(qkv.reshape(b, t, heads, 3 * d), 3, -1), or slices of it), and nothing else of it: each piece "
     "is then a group of its own"),
    ("cut into groups along an output axis", "read the kernel's output (plus its bias) only in whole pieces along one "
     "output axis (qkv[:, :, :, i] of nn.DenseGeneral((heads, 3, d))), and nothing else of it: each piece is then "
     "a group of its own"),
    ("sums over the nodes", "a normalisation or softmax over units: its units stay fixed; for BatchNorm, fold it "
     "into the layer before for inference, or train with pj.ddp_normalize instead"),
    ("not positively homogeneous", "expected for tanh, sigmoid, GELU or a normalisation: these units stay fixed and "
     "the rest is still optimised in path space; use relu or leaky_relu where units should be rescalable"),
    ("accumulates along the nodes", "a cumulative sum over units: its units stay fixed (expected)"),
    ("product of activations", "a gate, attention or normalisation multiplies activations: those units stay "
     "fixed (expected); a float mask among the inputs is an activation too: pass it as booleans and apply it "
     "with jnp.where(mask, x, 0)"),
    ("product of a parameter and an activation", "a learned scale combined with fixed coefficients (BatchNorm's "
     "running statistics) or read by several products: train it as an 'other' leaf (optax.partition with "
     "pj.path_labels)"),
    ("product with a parameter", "a learned scale combined with fixed coefficients (BatchNorm's running "
     "statistics) or read by several products: train it as an 'other' leaf (optax.partition with pj.path_labels)"),
    ("constant offset", "a constant added to an activation: make it a learned bias, or remove it"),
    ("non-zero constant", "clip at 0 (relu) rather than at another constant (relu6 -> relu), or start from zeros"),
    ("selects on an activation", "a jnp.where on activations: write it as relu or leaky_relu if it is one"),
    ("mixes nodes with fixed coefficients", "a fixed, non-parameter matrix mixes units: make it a parameter if it "
     "should be learned; otherwise these units stay fixed"),
    ("coefficients computed from parameters", "a kernel computed from parameters (concatenated, as "
     "nn.OptimizedLSTMCell's gates; normalised, as nn.WeightNorm's v/|v| or nn.SpectralNorm's W/sigma(W)) mixes "
     "units: rescaling them would change it, so they stay fixed (expected); a learned per-unit scale of its output "
     "(nn.WeightNorm's) is an edge into units of their own"),
    ("two roles", "one parameter read on both sides of layers (a tied embedding, a kernel and its transpose): "
     "it is an 'other' leaf and the units it touches stay fixed; expected for a tied embedding"),
    ("no parameter edge enters", "a reshape made a node axis that no kernel writes: reshape after the ReLU, or "
     "accept fixed units"),
    ("no parameter edge leaves", "units that nothing reads: make the layer narrower, or accept fixed units"),
    ("slices part of an axis", "a layer's output cut along an axis that a reshape made (qkv.reshape(b, t, 3, d)[:, "
     ":, 0]) or with strides: cut its last axis with jnp.split or slices first, each piece a group of its own"),
    ("splits an axis", "a layer's output cut along an axis that a reshape made: cut its last axis with jnp.split "
     "first, each piece a group of its own"),
    ("not an edge tensor", "this parameter is no kernel or bias of the homogeneous part: it is an 'other' leaf "
     "(optax.partition with pj.path_labels trains it) and the units it touches stay fixed"),
)  # fmt: skip


def pin_hint(reasons) -> str | None:
    """What a user can do about a group pinned for ``reasons`` (`PIN_HINTS`), or None."""
    for phrase, hint in PIN_HINTS:
        if any(phrase in reason for reason in reasons):
            return hint
    return None


@dataclasses.dataclass(frozen=True)
class NodeGroup:
    """A set of nodes that one rescaling vector acts on.

    Attributes:
      name: short label used by `describe` (``g0``, ``g1``, ...).
      size: number of nodes.
      kind: ``"input"``, ``"hidden"`` (rescalable), ``"output"`` or ``"pinned"``.
      offset: global index of the group's first node (node 0 is the bias node).
      reasons: why the group is pinned (primitive and source line), if it is.
    """

    name: str
    size: int
    kind: GroupKind
    offset: int
    reasons: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True, eq=False)
class EdgeLeaf:
    """How one parameter leaf sits in the graph.

    Attributes:
      path: the leaf's key path, e.g. ``"Dense_1/kernel"``.
      shape, dtype: the leaf's shape and dtype name.
      kind: ``"weight"`` (edges between node groups), ``"bias"`` (edges from the
        bias node) or ``"other"`` (not an edge of the homogeneous part: left
        unchanged by rescaling, e.g. a LayerNorm scale).
      src_groups, dst_groups: indices of the groups its edges leave / enter
        (empty for the bias node or for ``"other"`` leaves).
      src, dst: read-only int32 arrays of ``shape`` with the global node index of every
        entry's source and destination node (``BIAS_NODE`` for biases, -1 for
        ``"other"`` leaves); broadcast views (`node_view`) that hold one entry per node, not per
        parameter: `reduced` gives the small array behind one.
      note: why the leaf is ``"other"``.
      stacked: for a leaf that a scan slices along its first axis (layers stacked with ``nn.scan``), whether
        some layer's edges leave and enter the same group (each layer's slice is its own edge bundle, so the
        union of ``src_groups`` and ``dst_groups`` over the layers does not say); None for other leaves.
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    kind: LeafKind
    src_groups: tuple[int, ...]
    dst_groups: tuple[int, ...]
    src: np.ndarray
    dst: np.ndarray
    note: str = ""
    stacked: bool | None = None

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def recurrent(self) -> bool:
        """True when some edge of the leaf leaves and enters the same group."""
        if self.stacked is not None:
            return self.stacked
        return bool(set(self.src_groups) & set(self.dst_groups))


@dataclasses.dataclass(frozen=True, eq=False)
class PathSpace:
    """The reduction graph of a traced function (see the module docstring).

    Attributes:
      treedef: tree structure of the params it was traced with.
      leaves: one `EdgeLeaf` per parameter leaf, in ``jax.tree_util`` order.
      groups: the node groups.
      num_nodes: total number of nodes, the bias node included.
      fn: the traced function (keyword arguments bound), kept so that later
        computations (κ, path norms) can re-trace it.
      arg_specs: ``jax.ShapeDtypeStruct`` pytree of the positional arguments
        after ``params`` it was traced with.
      skeleton_edges: ``(incoming, outgoing)``, per node the index into ``ravel_pytree(params)[0]`` of
        the skeleton edge chosen from the params' values (`pathspace_jax.skeleton`), -1 where the
        index rule decides; None: the index rule everywhere.
      skeleton_rule: how they were chosen: ``"index"`` (from the graph alone), ``"values"`` (``trace(...,
        skeleton="values")``) or ``"index, off zeros"`` (the index rule, except at the nodes where it would take a
        weight that is exactly 0 in the traced params: a zero-initialised scale).
      positions_first: the inputs (indices into ``jax.tree_util.tree_leaves(arg_specs)``) whose first axis the
        function scans or convolves over (time-major sequences), not a batch of examples.
      random_per_layer: the inputs that are random state alone (PRNG keys, an nnx stream's counter) whose first
        axis a scan over layers reads per layer (``nnx.scan`` over blocks with a dropout stream): no batch of
        examples; Path-SGD's all-ones example takes them as traced.
    """

    treedef: Any
    leaves: tuple[EdgeLeaf, ...]
    groups: tuple[NodeGroup, ...]
    num_nodes: int
    fn: Callable[..., Any] = dataclasses.field(repr=False)
    arg_specs: Any = dataclasses.field(repr=False)
    skeleton_edges: tuple[np.ndarray, np.ndarray] | None = dataclasses.field(default=None, repr=False)
    positions_first: tuple[int, ...] = dataclasses.field(default=(), repr=False)
    skeleton_rule: str = dataclasses.field(default="index", repr=False)
    random_per_layer: tuple[int, ...] = dataclasses.field(default=(), repr=False)

    # -- sizes --------------------------------------------------------------
    @property
    def num_params(self) -> int:
        """m: the number of parameter entries."""
        return sum(leaf.size for leaf in self.leaves)

    @property
    def hidden_groups(self) -> tuple[int, ...]:
        """Indices of the hidden groups, in the order `rescale` expects its alphas."""
        return tuple(i for i, g in enumerate(self.groups) if g.kind == "hidden")

    @property
    def num_hidden(self) -> int:
        """H: the number of independent rescaling factors."""
        return sum(self.groups[i].size for i in self.hidden_groups)

    @property
    def num_coords(self) -> int:
        """m − H: the dimension of path space."""
        return self.num_params - self.num_hidden

    def node_kinds(self) -> np.ndarray:
        """Array of length `num_nodes`: 0 bias, 1 input, 2 hidden, 3 output, 4 pinned."""
        code = {"input": 1, "hidden": 2, "output": 3, "pinned": 4}
        kinds = np.zeros(self.num_nodes, np.int8)
        for g in self.groups:
            kinds[g.offset : g.offset + g.size] = code[g.kind]
        return kinds

    def leaves_of(self, tree, what: str = "params") -> list[Any]:
        """The leaves of ``tree``, checked against the traced params' structure and shapes.

        A tree with the traced structure is accepted, and so is one with other containers but the same
        leaf paths: nnx ``Variable`` wrappers dropped (``nnx.Optimizer`` passes ``nnx.as_pure`` states),
        or a dict for a ``FrozenDict``. Results built from it take its structure (`unflatten_like`).
        """
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        if treedef != self.treedef:
            got, expected = leaf_path_strings(tree), [leaf.path for leaf in self.leaves]
            if got != expected:
                missing = [p for p in expected if p not in got]
                extra = [p for p in got if p not in expected]
                detail = "; ".join(
                    part
                    for part in (
                        f"missing {missing}" if missing else "",
                        f"not in the traced params {extra}" if extra else "",
                        "" if missing or extra else f"leaves in another order: {got}",
                    )
                    if part
                )
                raise ValueError(
                    f"{what} does not have the leaves of the params this PathSpace was traced with: {detail}. "
                    "Pass the same parameter pytree (trace again if the model changed)."
                )
        for spec, leaf in zip(self.leaves, leaves):
            shape = tuple(getattr(leaf, "shape", ()))
            if shape != spec.shape:
                raise ValueError(f"{what} leaf {spec.path!r} has shape {shape}, expected {spec.shape}")
            dtype = getattr(leaf, "dtype", None)
            if dtype is not None and not jnp.issubdtype(dtype, jnp.inexact):
                raise TypeError(
                    f"{what} leaf {spec.path!r} has dtype {dtype}; path-space transformations need floating point "
                    f"params and gradients (it was traced as {spec.dtype})"
                )
        return leaves

    @staticmethod
    def unflatten_like(tree, leaves):
        """``leaves`` in the structure of ``tree`` (a tree accepted by `leaves_of`)."""
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(tree), leaves)

    # -- hashing ------------------------------------------------------------
    @property
    def fingerprint(self) -> str:
        fp = self.__dict__.get("_fingerprint")
        if fp is None:
            h = hashlib.sha256()
            # the argument shapes too: one fn traced at two sequence lengths or image sizes has one graph but
            # other path sums, and κ / path-norm programs are cached on the space
            specs = [(tuple(s.shape), str(s.dtype)) for s in jax.tree_util.tree_leaves(self.arg_specs)]
            h.update(repr((self.treedef, self.groups, self.num_nodes, specs)).encode())
            for leaf in self.leaves:
                h.update(repr((leaf.path, leaf.shape, leaf.dtype, leaf.kind)).encode())
                for nodes in (leaf.src, leaf.dst):
                    small, _ = reduced(nodes)
                    h.update(repr(small.shape).encode() + small.tobytes())
            for edges in self.skeleton_edges or ():
                h.update(edges.tobytes())
            fp = h.hexdigest()
            object.__setattr__(self, "_fingerprint", fp)
        return fp

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    def __eq__(self, other: object) -> bool:
        # The traced function is part of the identity: two functions can share a graph (an RNN read
        # out at the last step or at every step) while κ, path norms and caches keyed on the space
        # must tell them apart.
        if not isinstance(other, PathSpace):
            return NotImplemented
        return self.fingerprint == other.fingerprint and (self.fn is other.fn or self.fn == other.fn)

    def __repr__(self) -> str:
        return (
            f"PathSpace(num_params={self.num_params}, num_hidden={self.num_hidden}, "
            f"num_coords={self.num_coords}, groups={len(self.groups)}, "
            f"leaves={len(self.leaves)})"
        )
