"""Golden fingerprints of the tracer's results: what `pj.trace` finds in every model of the test zoo, the Flax
examples and the trace benchmark's models, and what the library computes from it.

Run from the repository root::

    python tests/golden/record.py tests/golden/jax-<version>.json[.gz] [NAME_REGEX]

Per model (``zoo/<name>``: `tests/zoo.py` in float64; ``flax/<name>``: `tests/flax_examples.py` in float32, traced
and run as `tests/test_flax_examples.py` does; ``bench/<name>``: `benchmarks/bench_trace.py`'s MLP, CNN and RNN
with abstract params) it records

* ``fingerprint``: `PathSpace.fingerprint` computed the same way from the space's fields, but with source lines
  normalised (``zoo.py:412`` -> ``zoo.py:N``) in the pin reasons, so that an edit of a test file keeps it;
  ``space_fields``: a hash of the fields the fingerprint leaves out (the leaves' notes, ``stacked``, the group
  indices, ``positions_first``, ``skeleton_rule``, ``random_per_layer``); ``num_hidden``;
* ``describe``: ``pj.describe(space)`` and (concrete params) ``describe_params``: ``pj.describe(space, params)``;
* ``path_norm``, ``path_kappa``, ``ddp_kappa`` (α = 0.5, exact), and one update of ``path_sgd``, ``g_sgd`` and
  ``ddp_sgd`` (α = 0.5) on all-ones gradients (``steps``): numbers as per-leaf ``[sum, norm, first 16 entries]``;
* ``programs``: per quantity above, the hashes of every flat `Program` that `pathspace_jax.program.program`
  returned while it was computed (`program_hash`: invariant to renaming of value ids and to the order of
  independent equations);
* ``warnings``: the warnings raised.

Any exception is stored as ``"ExcType: message"`` (normalised, first 300 characters): a case that raises today
must raise the same way later. Everything is normalised by `norm`: file paths reduced to their base name, line
numbers to ``N``, memory addresses to ``0x?``; messages on one line (`one_line`); `describe`'s texts are compared
whatever their line breaks (`compare`).

`tests/test_golden.py` records again (`record_model`) and compares (`compare`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gzip
import hashlib
import json
import re
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
for _p in (ROOT / "benchmarks", ROOT / "tests", ROOT):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

NUM_ENTRIES = 16  # entries of each leaf stored as they are
MAX_MESSAGE = 300  # characters of an exception's or a warning's message stored
ALPHA = 0.5
LR = 0.1
RTOL = {"float64": 1e-6, "float32": 1e-5}  # numbers are compared with these (the model's "dtype")

# ------------------------------------------------------------------------------------------------ normalisation

_PY_LINE = re.compile(r"([^\s'\"(),:/\\]+\.py):\d+(?::\d+)?")
_PY_DIR = re.compile(r"[^\s'\"(),:]*/([^\s'\"(),:/]+\.py:N)")
_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")


def norm(text: str) -> str:
    """``text`` with what varies between runs and checkouts removed: ``.../tests/zoo.py:412`` -> ``zoo.py:N``,
    ``0x7f3a...`` -> ``0x?``."""
    text = _PY_LINE.sub(r"\1:N", str(text))
    text = _PY_DIR.sub(r"\1", text)
    return _ADDRESS.sub("0x?", text)


def _h(x: Any) -> str:
    return hashlib.sha256(repr(x).encode()).hexdigest()[:16]


def _short(x: Any) -> str:
    """A hash of ``str(x)``, normalised (a jaxpr in an equation's params, a function's repr)."""
    return _h(norm(str(x)))


def one_line(text: str) -> str:
    """``text`` with every run of whitespace one space (`describe` wraps its reasons at a width, and a path or line
    number of another length wraps them elsewhere)."""
    return " ".join(str(text).split())


def error(e: BaseException) -> str:
    return f"{type(e).__name__}: {one_line(norm(str(e)))[:MAX_MESSAGE]}"


def safe(f: Callable[[], Any]) -> Any:
    try:
        return f()
    except Exception as e:  # recorded: the same exception must come later
        return error(e)


# ------------------------------------------------------------------------------------------------ values


def value_hash(v: Any) -> str:
    """A hash of an array's dtype, shape and bytes (a PRNG key's data), else of its normalised repr."""
    import jax
    import numpy as np

    try:
        tag = "array"
        if jax.dtypes.issubdtype(getattr(v, "dtype", np.float32), jax.dtypes.prng_key):
            v, tag = jax.random.key_data(v), "key"
        a = np.ascontiguousarray(np.asarray(v))
        return _h((tag, str(a.dtype), a.shape, hashlib.sha256(a.tobytes()).hexdigest()))
    except Exception:  # (a tracer)
        return _h(("object", norm(repr(v))))


def leaves(tree) -> list:
    """Per leaf of ``tree``: ``[sum, norm, first NUM_ENTRIES entries]`` (float64)."""
    import jax
    import numpy as np

    out = []
    for a in jax.tree_util.tree_leaves(tree):
        a = np.asarray(a, np.float64)
        out.append([float(a.sum()), float(np.linalg.norm(a.ravel())), a.ravel()[:NUM_ENTRIES].tolist()])
    return out


# ------------------------------------------------------------------------------------------------ programs


def program_hash(p) -> str:
    """A hash of a flat `Program` (`pathspace_jax.ir`) that does not depend on its value ids nor on the order of
    its independent equations (Merkle style): the inputs are named by position, the constants by their values,
    each equation by a hash of its primitive, params (normalised), its operands' names and its flags, and its
    results by the equation's name and their position. The program is the hash of its sorted equation names, the
    names in each of its sets (sorted), its kinds, cuts and outputs (in order). Values that no equation computes
    (dead code dropped from the program, still in a set) are left out."""
    names: dict[int, str] = {i: f"in{k}" for k, i in enumerate(p.in_ids)}
    names.update({i: _h(("const", value_hash(c))) for i, c in p.consts.items() if i not in names})
    eqns = _eqns_hashes(p.eqns, names)

    def name(x):
        return _h(("lit", value_hash(x[1]))) if isinstance(x, tuple) else names.get(x)

    def named(ids):
        return sorted(n for n in map(name, ids) if n is not None)

    fields = {
        f: named(getattr(p, f))
        for f in ("nodes", "outputs", "pinned", "sinks", "bnd", "gates", "of_inputs", "masks", "lookups", "fixed",
                  "joins", "into_sinks")
    }  # fmt: skip
    kinds = sorted((n, k) for i, k in p.kinds.items() if (n := name(i)) is not None)
    cut = sorted((n, repr(c)) for i, c in p.cut.items() if (n := name(i)) is not None)
    return _h((sorted(eqns), fields, kinds, cut, [name(x) for x in p.out_ids], len(p.in_ids), p.n_params, p.who,
               getattr(p.err, "__name__", repr(p.err))))  # fmt: skip


def _eqns_hashes(eqns, names: dict) -> list[str]:
    """Each equation's hash, in order; ``names`` updated with the names of their results."""
    from pathspace_jax.ir import Program

    free: dict[int, str] = {}

    def name(x):
        if isinstance(x, tuple):
            return _h(("lit", value_hash(x[1])))
        if x in names:
            return names[x]
        return free.setdefault(x, f"free{len(free)}")  # (read before it is computed: named by first reading)

    out = []
    for e in eqns:
        if isinstance(e.body, Program):
            body = program_hash(e.body)
        else:
            body = None if e.body is None else _short(e.body)
        inner = None if e.inner is None else _eqns_hashes(e.inner, dict(names))  # (in order: a call's body)
        scan = None if e.scan is None else (*e.scan[:4], None if e.scan.body is None else _short(e.scan.body))
        params = sorted((k, _short(v)) for k, v in e.params.items())
        h = _h((e.prim.name, params, [name(x) for x in e.ins], len(e.outs), e.edge, e.coefficient, e.exclusive,
                e.layers, scan, body, inner))  # fmt: skip
        names.update({o: f"{h}:{j}" for j, o in enumerate(e.outs)})
        out.append(h)
    return out


@contextlib.contextmanager
def collecting(into: list):
    """Append every `Program` that ``pathspace_jax.program.program`` returns to ``into`` (the library's modules
    call it as ``flat.program``: patched on the module)."""
    from pathspace_jax import program as flat

    original = flat.program

    @functools.wraps(original)
    def program(*args, **kwargs):
        prog = original(*args, **kwargs)
        into.append(prog)
        return prog

    flat.program = program
    try:
        yield
    finally:
        flat.program = original


# ------------------------------------------------------------------------------------------------ spaces


def space_fingerprint(space) -> str:
    """`PathSpace.fingerprint`, computed as it is but from the groups with their reasons normalised (`norm`), and
    the treedef's repr normalised. A copy on purpose: the goldens hash with code of their own, so that a change to
    the library's hashing cannot make them follow it."""
    import jax

    from pathspace_jax.graph import reduced

    h = hashlib.sha256()
    specs = [(tuple(s.shape), str(s.dtype)) for s in jax.tree_util.tree_leaves(space.arg_specs)]
    groups = tuple(dataclasses.replace(g, reasons=tuple(map(norm, g.reasons))) for g in space.groups)
    h.update(norm(repr((space.treedef, groups, space.num_nodes, specs))).encode())
    for leaf in space.leaves:
        h.update(repr((leaf.path, leaf.shape, leaf.dtype, leaf.kind)).encode())
        for nodes in (leaf.src, leaf.dst):
            small, _ = reduced(nodes)
            h.update(repr(small.shape).encode() + small.tobytes())
    for edges in space.skeleton_edges or ():
        h.update(edges.tobytes())
    return h.hexdigest()


def space_fields(space) -> str:
    """A hash of the space's fields that `PathSpace.fingerprint` leaves out."""
    per_leaf = [(norm(leaf.note), leaf.stacked, leaf.src_groups, leaf.dst_groups) for leaf in space.leaves]
    return _h((per_leaf, space.positions_first, space.skeleton_rule, space.random_per_layer))


# ------------------------------------------------------------------------------------------------ recording


def _clear_caches() -> None:
    """JAX's compiled programs and the library's caches: each model is recorded as in a fresh process (a cache hit
    would skip building a program that a first call builds)."""
    import jax

    jax.clear_caches()
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("pathspace_jax"):
            for obj in list(vars(module).values()):
                if callable(getattr(obj, "cache_clear", None)) and getattr(obj, "__module__", "") == module.__name__:
                    obj.cache_clear()


def record_model(fn, params, inputs: tuple, batch_axes=0, *, abstract: bool = False) -> dict:
    """The golden record of one model (see the module docstring). ``abstract``: params are ``ShapeDtypeStruct``s;
    the fingerprint, `describe` and the programs of path_norm, path_kappa and ddp_kappa (traced with
    ``jax.eval_shape``) only."""
    import jax
    import jax.numpy as jnp

    import pathspace_jax as pj

    _clear_caches()
    out: dict[str, Any] = {}
    programs: dict[str, list] = {}

    def run(what: str, f: Callable[[], Any]) -> Any:
        got: list = []
        with collecting(got):
            result = safe(f)
        programs[what] = sorted({program_hash(p) for p in got})
        return result

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        space = run("trace", lambda: pj.trace(fn, params, *inputs))
        if isinstance(space, str):
            out["trace"] = space
        else:
            out["fingerprint"] = space_fingerprint(space)
            out["space_fields"] = space_fields(space)
            out["num_hidden"] = space.num_hidden
            out["describe"] = safe(lambda: norm(pj.describe(space)))
            key = jax.random.key(0)
            x = inputs[0] if len(inputs) == 1 else tuple(inputs)  # ddp_kappa's inputs: one as it is, several a tuple
            if abstract:
                run("path_norm", lambda: jax.eval_shape(lambda p: pj.path_norm(space, p), params))
                run("path_kappa", lambda: jax.eval_shape(lambda p: pj.path_kappa(space, p), params))
                ddp = lambda p: pj.ddp_kappa(space, p, x, alpha=ALPHA, key=key, batch_axes=batch_axes)  # noqa: E731
                run("ddp_kappa", lambda: jax.eval_shape(ddp, params))
            else:
                out["describe_params"] = run("describe_params", lambda: norm(pj.describe(space, params)))
                out["path_norm"] = run("path_norm", lambda: float(pj.path_norm(space, params)))
                out["path_kappa"] = run("path_kappa", lambda: leaves(pj.path_kappa(space, params)))
                out["ddp_kappa"] = run("ddp_kappa", lambda: leaves(
                    pj.ddp_kappa(space, params, x, alpha=ALPHA, key=key, batch_axes=batch_axes)))  # fmt: skip
                ones = jax.tree_util.tree_map(jnp.ones_like, params)
                optimisers = {
                    "path_sgd": (lambda: pj.path_sgd(space, LR), {}),
                    "g_sgd": (lambda: pj.g_sgd(space, LR), {}),
                    "ddp_sgd": (lambda: pj.ddp_sgd(space, LR, alpha=ALPHA, batch_axes=batch_axes),
                                {"inputs": tuple(inputs), "key": key}),
                }  # fmt: skip

                def step(make, kw):
                    tx = make()
                    return leaves(tx.update(ones, tx.init(params), params, **kw)[0])

                out["steps"] = {n: run(n, lambda m=m, kw=kw: step(m, kw)) for n, (m, kw) in optimisers.items()}
    out["programs"] = programs
    out["warnings"] = sorted({f"{w.category.__name__}: {one_line(norm(str(w.message)))[:MAX_MESSAGE]}" for w in caught})
    return out


# ------------------------------------------------------------------------------------------------ the models


@dataclasses.dataclass(frozen=True)
class Model:
    """How to build one model's arguments for `record_model`: ``build() -> (fn, params, inputs, batch_axes)``."""

    build: Callable[[], tuple]
    dtype: str  # what its numbers are compared in (`RTOL`)
    abstract: bool = False


def _zoo_model(case) -> tuple:
    import jax
    import jax.numpy as jnp

    params = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64), case.params)
    return case.fn, params, (case.inputs(),), 0


def _flax_model(make) -> tuple:
    case = make()
    return case.fn, case.params, tuple(case.inputs), case.batch_axes()


def _bench_model(name: str) -> tuple:
    import bench_trace
    import jax
    import jax.numpy as jnp
    from common import MLP

    model, x = {
        "mlp_784_1024_512_10": (MLP(widths=(1024, 512)), jnp.ones((128, 784), jnp.float32)),
        "cnn_64_128_128": (bench_trace.CNN(), jnp.ones((8, 32, 32, 3), jnp.float32)),
        "stacked_relu_rnn_512": (bench_trace.RNN(), jnp.ones((8, 28, 28), jnp.float32)),
    }[name]
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), x)["params"])
    return (lambda p, x: model.apply({"params": p}, x)), params, (x,), 0


BENCH = ("mlp_784_1024_512_10", "cnn_64_128_128", "stacked_relu_rnn_512")


def models() -> dict[str, Model]:
    """Every model recorded, by name (``zoo/``, ``flax/``, ``bench/``), built on demand."""
    from flax_examples import CASES
    from zoo import _build

    out = {f"zoo/{n}": Model(functools.partial(_zoo_model, c), "float64") for n, c in _build().items()}
    out |= {f"flax/{n}": Model(functools.partial(_flax_model, mk), "float32") for n, mk in CASES.items()}
    out |= {f"bench/{n}": Model(functools.partial(_bench_model, n), "float32", abstract=True) for n in BENCH}
    return out


def record(model: Model) -> dict:
    """The golden record of ``model``, its ``dtype`` included (or ``build``: the exception building it raised)."""
    try:
        fn, params, inputs, batch_axes = model.build()
    except Exception as e:
        return {"dtype": model.dtype, "build": error(e)}
    return {"dtype": model.dtype, **record_model(fn, params, inputs, batch_axes, abstract=model.abstract)}


def golden_path(version: str | None = None) -> Path | None:
    """The golden file of this JAX version (``jax-<version>.json`` or ``.json.gz``), or None."""
    import jax

    for suffix in (".json", ".json.gz"):
        path = Path(__file__).parent / f"jax-{version or jax.__version__}{suffix}"
        if path.exists():
            return path
    return None


def load(path: Path) -> dict:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


_LIST = re.compile(r"\[\n[^\[\]{}\"]*\]")  # a list of numbers
_LEAF = re.compile(r"\[\n(?:[^\[\]{}\"]|\[[^\[\]{}\"\n]*\])*\]")  # one of numbers and a list of numbers on one line


def dump(data: dict, path: Path) -> None:
    text = json.dumps(data, indent=1, sort_keys=True) + "\n"
    # lists of numbers (a leaf's entries) on one line each (a raw newline is never inside a JSON string)
    for pattern in (_LIST, _LEAF):  # ([sum, norm, [entries]] a line each)
        text = pattern.sub(lambda m: re.sub(r",(?! )", ", ", re.sub(r"\n\s*", "", m.group())), text)
    if str(path).endswith(".gz"):
        with gzip.GzipFile(path, "wb", mtime=0) as f:  # (mtime 0: the same records give the same bytes)
            f.write(text.encode())
    else:
        path.write_text(text)


# ------------------------------------------------------------------------------------------------ comparing


def _close(a: float, b: float, rtol: float, atol: float) -> bool:
    if a == b or (a != a and b != b):  # (equal infinities; NaN where NaN was)
        return True
    return abs(a - b) <= atol + rtol * max(abs(a), abs(b))


def _compare_leaves(want, got, rtol: float, where: str) -> list[str]:
    if isinstance(want, str) or isinstance(got, str):
        return [] if want == got else [f"{where}: {want!r} -> {got!r}"]
    if len(want) != len(got):
        return [f"{where}: {len(want)} leaves -> {len(got)}"]
    out = []
    for i, (w, g) in enumerate(zip(want, got)):
        (ws, wn, we), (gs, gn, ge) = w, g
        atol = rtol * max(wn, gn)  # (sums and entries are compared to the leaf's scale: a sum that cancels)
        bad = [] if _close(wn, gn, rtol, 0.0) else [f"norm {wn!r} -> {gn!r}"]
        bad += [] if _close(ws, gs, rtol, atol) else [f"sum {ws!r} -> {gs!r}"]
        if len(we) != len(ge) or not all(_close(a, b, rtol, atol) for a, b in zip(we, ge)):
            bad.append(f"entries {we[:4]}... -> {ge[:4]}...")
        if bad:
            out.append(f"{where}[leaf {i}]: " + "; ".join(bad))
    return out


EXACT = ("build", "trace", "fingerprint", "space_fields", "num_hidden", "describe", "describe_params", "programs",
         "warnings")  # fmt: skip
NUMBERS = ("path_kappa", "ddp_kappa")


def compare(want: dict, got: dict) -> list[str]:
    """Every difference between two records of one model (empty: the same), one line each."""
    rtol = RTOL[want.get("dtype", "float32")]
    out = []
    keys = sorted(set(want) | set(got))
    for k in keys:
        w, g = want.get(k), got.get(k)
        if k == "programs" and isinstance(w, dict) and isinstance(g, dict):
            for q in sorted(set(w) | set(g)):
                if w.get(q) != g.get(q):
                    out.append(f"programs[{q}]: {w.get(q)} -> {g.get(q)}")
        elif k in NUMBERS:
            out += _compare_leaves(w, g, rtol, k)
        elif k == "steps" and isinstance(w, dict) and isinstance(g, dict):
            for q in sorted(set(w) | set(g)):
                out += _compare_leaves(w.get(q), g.get(q), rtol, f"steps[{q}]")
        elif k == "path_norm" and isinstance(w, float) and isinstance(g, float):
            if not _close(w, g, rtol, 0.0):
                out.append(f"path_norm: {w!r} -> {g!r}")
        elif w != g:
            if isinstance(w, str) and isinstance(g, str) and one_line(w) == one_line(g):
                continue  # (`describe`'s texts wrapped elsewhere)
            if isinstance(w, str) and isinstance(g, str) and "\n" in w + g:
                import difflib

                diff = difflib.unified_diff(w.splitlines(), g.splitlines(), "golden", "now", lineterm="", n=0)
                out.append(f"{k}:\n    " + "\n    ".join(list(diff)[2:40]))
            else:
                out.append(f"{k}: {w!r} -> {g!r}")
    return out


# ------------------------------------------------------------------------------------------------ main


def main(argv: list[str]) -> None:
    if len(argv) not in (2, 3):
        sys.exit(f"usage: python {argv[0]} OUT.json[.gz] [NAME_REGEX]")
    import conftest  # noqa: F401  (the tests' settings: x64, XLA's flags, the compilation cache) before JAX starts
    import jax

    jax.config.update("jax_enable_x64", True)
    pattern = re.compile(argv[2] if len(argv) == 3 else "")
    records, start = {}, time.perf_counter()
    for name, model in models().items():
        if not pattern.search(name):
            continue
        t0 = time.perf_counter()
        records[name] = record(model)
        print(f"{name:60s} {time.perf_counter() - t0:7.1f}s", file=sys.stderr, flush=True)
    print(f"{len(records)} models in {time.perf_counter() - start:.0f}s", file=sys.stderr)
    dump({"jax": jax.__version__, "models": records}, Path(argv[1]))


if __name__ == "__main__":
    main(sys.argv)
