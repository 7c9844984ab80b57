"""The package's layout rules, checked on its sources (`docs/contributing.md`): primitive names are read in
`pathspace_jax.rules` and `pathspace_jax.jaxpr` alone (everything else dispatches on `Rule` fields and on the
program's `pathspace_jax.ir.Role`s), JAX's equations by the jaxpr reader and the walker alone, no file is over 600
lines and no function over 100."""

from __future__ import annotations

import ast
import pathlib

from pathspace_jax import rules

_PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "pathspace_jax"

# The modules that read primitive names: the rule table and the one reader of JAX's jaxpr format.
_NAME_READERS = {"rules.py", "jaxpr.py"}


# Primitives that `pathspace_jax.jaxpr` enters or handles by name besides those of the rule table: calls
# (entered as if inlined) and control flow.
_CALL_NAMES = {
    "pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr",
    "remat2", "checkpoint", "scan", "while", "cond",
}  # fmt: skip

# String constants equal to a primitive's name that are no primitive there: (module, the string, why).
_NOT_PRIMITIVES = {
    ("transforms.py", "floor"),  # the hyperparameter ``floor`` named in `_check_every_eps`'s message
}

_MAX_FILE_LINES = 600
_MAX_FUNCTION_LINES = 100


def _sources() -> list[pathlib.Path]:
    return sorted(_PACKAGE.glob("*.py"))


def _docstrings(tree: ast.Module) -> set[int]:
    """The ids of the docstring constants of a module, its classes and functions (prose, not code)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def primitive_names_in(source: str, names: set[str]) -> list[tuple[int, str]]:
    """``(line, string)`` of every string constant in ``source``, docstrings aside, that is one of ``names``."""
    tree = ast.parse(source)
    prose = _docstrings(tree)
    return sorted(
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose
        and node.value in names
    )  # fmt: skip


def test_primitive_names_are_read_in_the_rule_table_and_the_jaxpr_reader_alone():
    names = set(rules.names()) | _CALL_NAMES
    found = []
    for path in _sources():
        if path.name in _NAME_READERS:
            continue
        for line, name in primitive_names_in(path.read_text(), names):
            if (path.name, name) not in _NOT_PRIMITIVES:
                found.append(f"{path.name}:{line}: {name!r}")
    assert not found, (
        "primitive names compared or tabled outside rules.py and jaxpr.py (dispatch on a Rule field, "
        f"rules.Op, or the program's ir.Role instead): {found}"
    )


def test_the_scan_finds_a_name_compared_or_tabled():
    names = set(rules.names())
    source = 'def f(e):\n    """max: docstrings are prose."""\n'
    source += '    return e.prim.name == "max" or e in {"dot_general"}\n'
    assert primitive_names_in(source, names) == [(3, "dot_general"), (3, "max")]


# The modules that read JAX's equations: the jaxpr reader and the walker with its rules; everything else reads the
# recorded program (`pathspace_jax.ir`).
_EQUATION_READERS = {
    "jaxpr.py", "tracer.py", "rewrites.py", "idioms.py", "pieces.py", "rules_elementwise.py", "rules_linear.py",
    "rules_reduce.py", "rules_shape.py", "rules_index.py", "rules_control.py",
}  # fmt: skip
_EQUATION_FIELDS = {"primitive", "invars", "outvars", "constvars"}


def test_jax_equations_are_read_by_the_jaxpr_reader_and_the_walker_alone():
    found = []
    for path in _sources():
        if path.name in _EQUATION_READERS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in _EQUATION_FIELDS:
                found.append(f"{path.name}:{node.lineno}: .{node.attr}")
    assert not found, f"JAX's equations read outside jaxpr.py and the walker (read the recorded ir.Eqn): {found}"


def _too_long(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            if node.end_lineno - first + 1 > _MAX_FUNCTION_LINES:
                out.append(f"{path.name}:{node.lineno} {node.name} ({node.end_lineno - first + 1} lines)")
    return out


def test_no_file_is_over_600_lines_and_no_function_over_100():
    files, functions = [], []
    for path in _sources():
        if (n := len(path.read_text().splitlines())) > _MAX_FILE_LINES:
            files.append(f"{path.name} ({n} lines)")
        functions += _too_long(path)
    assert not files, f"files over {_MAX_FILE_LINES} lines: {files}"
    assert not functions, f"functions over {_MAX_FUNCTION_LINES} lines: {functions}"
