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
    # MathJax 3 bundled into _static/mathjax (its setup points mathjax_path there): the maths renders offline,
    # where sphinx.ext.mathjax alone loads MathJax from a CDN.
    "sphinx-mathjax-offline",
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

# doctest: the {doctest} / {testcode} blocks of the pages, and the ">>>" examples of the library's docstrings
# (the API reference), are run. The docstrings' examples share the names defined here: a small linen MLP
# (model, params, x, y, key), its space, a gradient (grads) and un-normalised weights (w_tilde, x_calib).
doctest_test_doctest_blocks = "default"
doctest_default_flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE | doctest.DONT_ACCEPT_TRUE_FOR_1
doctest_global_setup = """
import numpy as np
np.set_printoptions(precision=4, suppress=True)
import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training.train_state import TrainState
import pathspace_jax as pj


class _MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(8)(x))
        x = nn.relu(nn.Dense(8)(x))
        return nn.Dense(3)(x)


model = _MLP()
key = jax.random.key(0)
x = jax.random.normal(jax.random.key(1), (16, 4))
y = jax.random.normal(jax.random.key(2), (16, 3))
params = model.init(key, x)["params"]
fn = lambda p, x: model.apply({"params": p}, x)
space = pj.trace(fn, params, x)
grads = jax.grad(lambda p: jnp.mean((fn(p, x) - y) ** 2))(params)
w_tilde, x_calib = params, x
i, j = 1, 2
"""

# The theme of optax's and flax's documentation. Its assets (fonts and icons included) are bundled with it.
html_theme = "sphinx_book_theme"
html_title = "pathspace_jax"
html_static_path = ["_static"]
html_css_files = ["custom.css"]  # code blocks wrap their long lines within the column
html_theme_options = {
    "home_page_in_toc": True,
    "show_toc_level": 2,
    "use_download_button": False,
    "use_fullscreen_button": False,
}


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
