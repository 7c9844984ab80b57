"""Sphinx configuration of the pathspace_jax documentation.

Why Sphinx: the libraries pathspace_jax builds on (optax, flax, chex) document themselves with Sphinx, so
users find the same layout, the same autodoc API pages from Google-style docstrings (napoleon), and
intersphinx-style cross references. Pages are Markdown (MyST); every Python example in them is a
``{doctest}`` or ``{testcode}``/``{testoutput}`` block that ``sphinx-build -b doctest`` executes
(docs/build.sh), so the outputs shown are the outputs the library gives.
"""

import doctest
import os
import sys

sys.path.insert(0, os.path.abspath(".."))

import pathspace_jax  # noqa: E402

project = "pathspace_jax"
author = "pathspace_jax contributors"
copyright = "2026, pathspace_jax contributors"
release = pathspace_jax.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.doctest",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "README.md", ".venv"]

# MyST: $...$ and $$...$$ maths (rendered by MathJax), ::: fences for admonitions.
myst_enable_extensions = ["dollarmath", "colon_fence"]
myst_heading_anchors = 3

# autodoc / napoleon: the docstrings are Google style; single backticks name objects.
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
default_role = "py:obj"

# doctest: only the explicit {doctest} / {testcode} blocks of the pages are run. The ">>>" lines of the
# library's docstrings (shown in the API reference) are fragments that use names defined elsewhere (space,
# params, grads), so plain doctest blocks are not collected.
doctest_test_doctest_blocks = ""
doctest_default_flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE | doctest.DONT_ACCEPT_TRUE_FOR_1
doctest_global_setup = """
import numpy as np
np.set_printoptions(precision=4, suppress=True)
"""

html_theme = "alabaster"
html_static_path = ["_static"]
html_theme_options = {"description": "Path-space optimisation of ReLU networks in JAX"}


# The docstrings write absolute values as |x| (e.g. "|p_e|^p" in path_norm), which reST would read as
# substitution references. Escape "|" outside ``literals`` and literal blocks when rendering them; the
# docstrings themselves are left as they are.
def _escape_bars(app, what, name, obj, options, lines):
    literal_indent = None
    for i, line in enumerate(lines):
        indent = len(line) - len(line.lstrip())
        if literal_indent is not None:
            if line.strip() and indent <= literal_indent:
                literal_indent = None
            else:
                continue
        parts = line.split("``")
        lines[i] = "``".join(p if k % 2 else p.replace("|", "\\|") for k, p in enumerate(parts))
        if line.rstrip().endswith("::"):
            literal_indent = indent


def setup(app):
    app.connect("autodoc-process-docstring", _escape_bars)
