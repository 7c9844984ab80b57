"""The flat program of a traced function: its jaxpr flattened once, shared by the |·|^p network, DDP's forward
pass and DDP-Normalization.

`program` re-traces ``space.fn`` at given shapes and flattens its jaxpr (read through
`pathspace_jax.jaxpr`, calls inlined) into a list of equations on integer variable ids, each variable of
kind ``"param"`` (a view of the parameters), ``"act"`` (depends on the inputs) or ``"const"``. A ``scan`` is
kept as one equation with its flattened body (its carry kinds iterated to a fixed point). It also marks the
*node* pre-activations that DDP's recursion mixes statistics into: a value produced by a parameterised linear
map (possibly plus biases, residual branches and constant factors) that is used by anything else (a ReLU,
the next layer, two consumers, the function's output); every output of the function is a node.
Values in node groups that `pathspace_jax.trace` pins (found by running its interpreter on the same
jaxpr, `pathspace_jax.trace.boundary_sites`) make the boundary: pinned nodes are *sinks* and what is
computed from them *boundary values* (`_find_boundary`). Integer inputs are token ids, and a gather of
a parameter by them an embedding lookup (the |·|^p network looks it up: `pathspace_jax.squared`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pathspace_jax import jaxpr as jx
from pathspace_jax.graph import PathSpace
from pathspace_jax.rules import rule
from pathspace_jax.trace import boundary_sites

# The scans that κ and γ² add run a recurrence step by step, often at a tiny size (Path-SGD's |·|^p network on
# one all-ones example), where a GPU spends most of a loop iteration launching it: they are unrolled by up to
# SCAN_UNROLL steps, and by no more than keep the unrolled steps' carries within UNROLL_BYTES. On an H100
# (JAX 0.11.2) Path-SGD κ⁽¹⁾ of a ReLU RNN (hidden 100, 28 steps) went from 1.49× to 1.03× SGD's step, the
# exact κ⁽²⁾ from 1.90× to 1.37×. A long sequence keeps a loop of ⌈length / SCAN_UNROLL⌉ iterations (compile
# time); a large carry (DDP's batch, κ⁽²⁾'s n × n lag sum) means enough work per step to hide the loop, and
# unrolled it multiplied the compiled step's temporaries (the language model's exact κ⁽²⁾: 154 -> 444 MB).
SCAN_UNROLL = 32
UNROLL_BYTES = 1 << 20


def scan_unroll(length: int, carry_bytes: int) -> int:
    """The ``unroll`` of a scan of ``length`` steps that κ or γ² adds (`SCAN_UNROLL`, `UNROLL_BYTES`)."""
    return max(1, min(int(length), SCAN_UNROLL, UNROLL_BYTES // max(int(carry_bytes), 1)))


def nbytes(tree) -> int:
    """The bytes of the arrays in ``tree``."""
    return sum(int(np.prod(jnp.shape(a), dtype=np.int64)) * jnp.result_type(a).itemsize for a in jax.tree.leaves(tree))


@dataclasses.dataclass
class Eqn:
    prim: Any
    params: dict
    ins: list  # var ids, or ("lit", value)
    outs: list[int]
    where: str
    scan: jx.Scan | None = None  # for a scan: its operand split, length, direction
    body: Program | None = None  # for a scan: its flattened body (in_ids: consts, carry, xs)


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
    sinks: list[int] = dataclasses.field(default_factory=list)  # pinned nodes: paths end here (`_find_boundary`)
    bnd: set[int] = dataclasses.field(default_factory=set)  # other boundary values: 1 in the |·|^p network
    lookups: set[int] = dataclasses.field(default_factory=set)  # results of embedding lookups (`_lookup`)
    fixed: set[int] = dataclasses.field(default_factory=set)  # params combined into fixed coefficients (trace)

    def edge_param(self, x) -> bool:
        """Whether operand ``x`` is a parameter as an edge tensor: a view of one params leaf, not a
        combination of leaves into fixed coefficients (a kernel concatenated from two, ``fixed``)."""
        return not isinstance(x, tuple) and self.kinds[x] == "param" and x not in self.fixed

    def is_edge(self, e) -> bool:
        """Whether equation ``e`` is an edge product: a dot or convolution with an edge parameter operand."""
        return e.prim.name in ("dot_general", "conv_general_dilated") and any(map(self.edge_param, e.ins))


def _join(a: str, b: str) -> str:
    order = {"const": 0, "param": 1, "act": 2}
    return a if order[a] >= order[b] else b


def _flatten(
    closed: jx.ClosedJaxpr,
    n_params: int,
    *,
    who: str,
    err: type,
    allow_scan: bool = False,
    inline_custom: bool = False,
    in_kinds: Sequence[str] | None = None,
    sites: dict | None = None,
    prefix: tuple = (),
    in_pinned: Sequence[bool] | None = None,
) -> Program:
    """Flatten ``closed`` (calls inlined, layer stacks unrolled: `_unroll_layers`) into a `Program`. ``allow_scan``
    keeps each other ``scan`` as one equation whose ``body`` is the flattened body (its in_ids: consts, carry, xs;
    carry kinds joined with the body's carry outputs); otherwise scan, while and cond raise ``err``.
    ``inline_custom`` enters every ``custom_jvp``/``custom_vjp`` call (``jax.nn.relu`` becomes a plain ``max``).
    ``in_kinds`` overrides the kinds of the inputs. ``sites`` (`pathspace_jax.trace.boundary_sites` of ``closed``;
    ``prefix``: this jaxpr's key there) flags the values in boundary groups, ``in_pinned`` a scan body's inputs."""
    counter = iter(range(10**9))
    eqns: list[Eqn] = []
    consts: dict[int, Any] = {}
    kinds: dict[int, str] = {}
    pinned: set[int] = set()
    tokens: set[int] = set()  # integer values computed from integer inputs (token ids), of kind "const"
    lookups: set[int] = set()
    fixed: set[int] = set()
    sites = sites or {}

    def kind_of(x):
        return "const" if isinstance(x, tuple) else kinds[x]

    def as_var(x):  # a literal as a constant variable (a call's operand or result)
        if isinstance(x, tuple):
            i = next(counter)
            consts[i], kinds[i] = x[1], "const"
            return i
        return x

    def walk(jaxpr, const_vals, in_ids, prefix):
        env = {}
        for v, c in zip(jaxpr.constvars, const_vals, strict=False):
            i = next(counter)
            consts[i], kinds[i], env[v] = c, "const", i
        for v, i in zip(jaxpr.invars, in_ids, strict=False):
            env[v] = i

        def read(x):
            return ("lit", jx.literal_value(x)) if jx.is_literal(x) else env[x]

        for idx, e in enumerate(jaxpr.eqns):
            key = prefix + (idx,)
            flags = sites.get(key, ())
            ins = [read(x) for x in e.invars]
            ks = [kind_of(x) for x in ins]
            sub = jx.call_body(e)
            name = e.primitive.name
            if name == "scan" and sites.get(key + ("layers",)):
                for v, o in zip(e.outvars, _unroll_layers(e, [as_var(x) for x in ins], key, walk, as_var), strict=True):
                    env[v] = as_var(o)
                continue
            if name == "scan" and allow_scan:
                ins_pinned = [not isinstance(x, tuple) and x in pinned for x in ins]
                outs, scan_eqn = _flatten_scan(e, ins, ks, kinds, counter, who, err, inline_custom, sites, key,
                                               ins_pinned)  # fmt: skip
                eqns.append(scan_eqn)
                for j, (v, o) in enumerate(zip(e.outvars, outs, strict=True)):
                    env[v] = o
                    if _flag(flags, j) is True:
                        pinned.add(o)
                continue
            if name in ("scan", "while", "cond"):
                raise err(
                    f"{who}: {name} at {jx.where(e)} is not supported: DDP-SGD's closed-form κ holds for "
                    "feed-forward networks, where every path uses a parameter at most once (a recurrent kernel "
                    "is used at every time step, so γ²_net is not quadratic in it)."
                )
            if sub is not None and not (not inline_custom and _kept_whole(name, sub, ks)):
                outs = walk(sub.jaxpr, sub.consts, [as_var(x) for x in ins], key)
                for v, o in zip(e.outvars, outs, strict=False):
                    env[v] = as_var(o)
                continue
            outs = []
            k = "act" if "act" in ks else "param" if "param" in ks else "const"
            from_tokens = any(not isinstance(x, tuple) and x in tokens for x in ins)
            lookup = from_tokens and name == "gather" and ks[0] == "param"
            if lookup:
                k = "act"  # an embedding lookup: the one-hot input times the table (`_lookup`)
            for j, v in enumerate(e.outvars):
                i = next(counter)
                env[v], kinds[i] = i, k
                outs.append(i)
                if _flag(flags, j) is True and k == "act":
                    pinned.add(i)
                elif _flag(flags, j) == "const" and k == "param":
                    fixed.add(i)  # parameters combined into fixed coefficients (not an edge)
                if lookup:
                    lookups.add(i)
                elif from_tokens and k == "const":
                    tokens.add(i)
            eqns.append(Eqn(e.primitive, dict(e.params), ins, outs, jx.where(e)))
        return [read(x) for x in jaxpr.outvars]

    top = closed.jaxpr
    in_ids = [next(counter) for _ in top.invars]
    for j, i in enumerate(in_ids):
        kinds[i] = in_kinds[j] if in_kinds is not None else "param" if j < n_params else "act"
    if in_kinds is None:  # integer inputs are token ids: constants that select embedding rows
        for i, aval in zip(in_ids[n_params:], jx.in_avals(closed)[n_params:], strict=True):
            if jnp.issubdtype(aval.dtype, jnp.integer):
                kinds[i] = "const"
                tokens.add(i)
    in_flags = in_pinned if in_pinned is not None else [False] * n_params + list(sites.get(("in",), ()))
    pinned.update(i for i, f in zip(in_ids, in_flags, strict=False) if f is True and kinds[i] == "act")
    out_ids = walk(top, closed.consts, in_ids, prefix)
    prog = Program(eqns, n_params, in_ids, out_ids, consts, kinds, [], [], who, err, pinned, lookups=lookups,
                   fixed=fixed)  # fmt: skip
    _find_boundary(prog, _find_nodes(prog, body=in_kinds is not None))
    return prog


def _unroll_layers(e, ins, key, walk, as_var) -> list:
    """A scan that slices params along its axis (`trace` marks these layer stacks), for `_flatten`: its body
    inlined once per layer (``walk``, `_flatten`'s walker; ``as_var`` its literal-to-constant), layer i reading
    slice i of every ``xs`` and flagged on its own (``key + (i,)``); the ``ys`` stacked back. Each layer's nodes
    and boundaries are then those of the network written as a loop."""
    sc = jx.scan(e)
    nc, nk = sc.num_consts, sc.num_carry
    carry, xs = ins[nc : nc + nk], ins[nc + nk :]
    avals = jx.in_avals(sc.body)[nc + nk :]
    ys: dict[int, list] = {}
    for layer in reversed(range(sc.length)) if sc.reverse else range(sc.length):
        sliced = []
        for k, (x, a) in enumerate(zip(xs, avals, strict=True)):
            part = jax.make_jaxpr(lambda v, i=layer: v[i])(jax.ShapeDtypeStruct((sc.length, *a.shape), a.dtype))
            sliced += walk(part.jaxpr, part.consts, [x], key + ("slice", layer, k))
        outs = walk(sc.body.jaxpr, sc.body.consts, ins[:nc] + carry + [as_var(x) for x in sliced], key + (layer,))
        carry, ys[layer] = [as_var(o) for o in outs[:nk]], [as_var(o) for o in outs[nk:]]
    stacked = []
    for j, a in enumerate(jx.out_avals(sc.body)[nk:]):
        spec = jax.ShapeDtypeStruct(a.shape, a.dtype)
        stack = jax.make_jaxpr(lambda *v: jnp.concatenate([x[None] for x in v]))(*[spec] * sc.length)
        stacked += walk(stack.jaxpr, stack.consts, [ys[layer][j] for layer in range(sc.length)], key + ("y", j))
    return carry + stacked


def _flag(flags, j):
    """The `pathspace_jax.trace.boundary_sites` flag of output ``j`` (False where there is none)."""
    return flags[j] if j < len(flags) else False


def _kept_whole(name: str, sub, ks) -> bool:
    """Whether a custom_jvp/custom_vjp call is kept as one equation (not entered): ReLU-like code (``jax.nn.relu``)
    whose primitives the |·|^p network evaluates as they are, without sums and without parameters."""
    return (
        name.startswith("custom_")
        and "param" not in ks
        and all(rule(n).as_is and not rule(n).sums for n in jx.primitive_names(sub))
    )


def _flatten_scan(e, ins, ks, kinds, counter, who, err, inline_custom, sites, key, ins_pinned):
    """One ``scan`` equation: flatten its body (carry kinds iterated to a fixed point), append it."""
    sc = jx.scan(e)
    nc, ncar = sc.num_consts, sc.num_carry
    in_k = list(ks)
    flags = sites.get(key, ())
    in_p = list(ins_pinned)  # a carry is pinned where its result is (trace ties their atoms)
    for j in range(ncar):
        in_p[nc + j] = _flag(flags, j) is True
    for _ in range(len(in_k) + 2):
        bp = _flatten(sc.body, 0, who=who, err=err, allow_scan=True, inline_custom=inline_custom, in_kinds=in_k,
                      sites=sites, prefix=key, in_pinned=in_p)  # fmt: skip
        out_k = [("const" if isinstance(x, tuple) else bp.kinds[x]) for x in bp.out_ids]
        new_k = list(in_k)
        for j in range(ncar):
            new_k[nc + j] = _join(in_k[nc + j], out_k[j])
        if new_k == in_k:
            break
        in_k = new_k
    outs = []
    for j, _v in enumerate(e.outvars):
        i = next(counter)
        kinds[i] = in_k[nc + j] if j < ncar else out_k[j]
        outs.append(i)
    return outs, Eqn(e.primitive, dict(e.params), ins, outs, jx.where(e), scan=sc, body=bp)


def _find_nodes(prog: Program, body: bool = False) -> set[int]:
    """Mark the node pre-activations (see the module docstring); returns the linear accumulations. In a
    scan ``body``, the nodes are its pre-activations at one step of the unrolled network."""
    kinds = prog.kinds
    uses: dict[int, list[Eqn]] = {}
    for e in prog.eqns:
        for x in e.ins:
            if not isinstance(x, tuple):
                uses.setdefault(x, []).append(e)
    fresh: set[int] = set()
    for e in prog.eqns:
        name = e.prim.name
        if kinds[e.outs[0]] != "act":
            continue
        if prog.is_edge(e) or e.outs[0] in prog.lookups:
            fresh.add(e.outs[0])
        elif rule(name).continues_node:
            if any((not isinstance(x, tuple)) and x in fresh for x in e.ins):
                fresh.add(e.outs[0])
    outs = [x for x in prog.out_ids if not isinstance(x, tuple) and kinds[x] == "act"]
    nodes = []
    for e in prog.eqns:
        for v in e.outs:
            if kinds[v] != "act":
                continue
            us = uses.get(v, [])
            if v in outs and (not body or v in fresh):  # a body's outputs (carry, ys) are not nodes as such
                nodes.append(v)
                continue
            if v not in fresh:
                continue
            merged = len(us) == 1 and rule(us[0].prim.name).continues_node
            if merged and us[0].prim.name in ("mul", "div"):
                other = [x for x in us[0].ins if x != v]
                merged = all(isinstance(x, tuple) or kinds[x] == "const" for x in other)
            if not merged:
                nodes.append(v)
    for i in prog.in_ids[prog.n_params :]:  # an input returned as it is
        if i in outs and not body:
            nodes.append(i)
    prog.nodes = nodes
    prog.outputs = list(dict.fromkeys(outs))
    return fresh


def _find_boundary(prog: Program, fresh: set[int]) -> None:
    """Pinned groups as boundaries: the pinned nodes are *sinks* (the paths that reach them end there, and
    their |·|^p values are added to the total) and, for everything downstream, *sources* of value 1, like
    inputs. Values computed from boundary values without a parameter edge (a LayerNorm, a tanh head) are
    boundary values too (`prog.bnd`): they are 1 in the |·|^p network, and parameter edges leaving them
    start new paths. A bias added to a boundary value (a LayerNorm's offset) ends at a sink of its own.
    """
    if not prog.pinned:
        return
    kinds, pinned, node_set = prog.kinds, prog.pinned, set(prog.nodes)
    sinks: list[int] = []
    bnd = {i for i in prog.in_ids if i in pinned}
    for e in prog.eqns:
        if e.prim.name == "scan":
            body_bnd = e.body.bnd | set(e.body.sinks)
            for j, o in enumerate(e.outs):
                x = e.body.out_ids[j]
                if o in pinned or (not isinstance(x, tuple) and x in body_bnd):
                    bnd.add(o)
            continue
        act_ins = [x for x in e.ins if not isinstance(x, tuple) and kinds[x] == "act"]
        edge = prog.is_edge(e)
        for o in e.outs:
            if kinds[o] != "act":
                continue
            if act_ins and not edge and all(x in bnd for x in act_ins):
                bnd.add(o)  # computed from boundary values only
                if e.prim.name in ("add", "add_any", "sub") and any(map(prog.edge_param, e.ins)):
                    sinks.append(o)  # a bias edge enters a boundary node (a LayerNorm's offset)
            elif o in pinned and o in node_set:
                sinks.append(o)  # the paths of the homogeneous part end here
                bnd.add(o)
            elif o in pinned and o not in fresh:
                bnd.add(o)
    prog.sinks = sinks
    prog.bnd = bnd - set(sinks)
    keep = (node_set - prog.bnd) | set(sinks)
    prog.nodes = [o for e in prog.eqns for o in e.outs if o in keep]
    prog.nodes += [i for i in prog.in_ids if i in keep]
    prog.outputs = [v for v in prog.outputs if v not in bnd]


@functools.lru_cache(maxsize=64)
def program(space: PathSpace, param_key: tuple, input_key: tuple, **flatten_options) -> Program:
    """The flat program of ``space.fn`` at these (shape, dtype) keys (cached: a `PathSpace` is hashable).

    ``flatten_options``: ``who`` and ``err`` (the public function and the error it raises), ``allow_scan``,
    ``inline_custom`` (see `_flatten`).
    """
    param_specs = [jax.ShapeDtypeStruct(s, d) for s, d in param_key]
    input_specs = [jax.ShapeDtypeStruct(s, d) for s, d in input_key]
    args_def = jax.tree_util.tree_structure(space.arg_specs)

    def f(ps, xs):
        return space.fn(jax.tree_util.tree_unflatten(space.treedef, ps), *jax.tree_util.tree_unflatten(args_def, xs))

    closed = jax.make_jaxpr(f)(param_specs, input_specs)
    sites = boundary_sites(closed, len(param_specs), [leaf.path for leaf in space.leaves])
    return _flatten(closed, len(param_specs), sites=sites, **flatten_options)


def bind(e: Eqn, vals) -> list:
    """Apply the equation's primitive to ``vals``."""
    return jx.bind(e.prim, e.params, vals)


def refuse_random(space: PathSpace, who: str, err: type) -> None:
    """Path sums and DDP's statistics are defined for one deterministic network: a group pinned because
    random numbers reach it (dropout in the traced function) is an error, not a boundary."""
    for g in space.groups:
        if g.random:
            raise err(f"{who}: node group {g.name} (size {g.size}) {'; '.join(g.reasons)}")
