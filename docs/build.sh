#!/usr/bin/env bash
# Build the documentation with warnings as errors and run every example in it.
#
#   pip install -e ".[docs]" && sh docs/build.sh
#
# 1. docs/check_docs.py: every name of pathspace_jax.__all__ has an API entry, and every Python
#    example in the pages is a {doctest}/{testcode} block (so step 3 runs it);
# 2. the HTML pages (docs/_build/html), warnings as errors;
# 3. the doctest builder: every {doctest}/{testcode} block of every page, outputs compared.
# The figures are not rebuilt here (they need a few training runs): python docs/make_figures.py.
set -eu
cd "$(dirname "$0")/.."
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
python docs/check_docs.py
sphinx-build -W --keep-going -q -b html docs docs/_build/html
sphinx-build -W --keep-going -q -b doctest docs docs/_build/doctest
echo "docs: HTML in docs/_build/html, doctests passed ($(grep -E '^ +[0-9]+ tests$' docs/_build/doctest/output.txt | tr -s ' '))"
