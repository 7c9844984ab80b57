"""Test configuration: x64 for the tests that ask for float64, and the fast default run.

The default ``python -m pytest`` (``-m "not slow"`` in pyproject's addopts) runs every test function
with its first parametrisation, except the tests marked ``slow`` (training runs, 8-device sharding,
statistical checks). The other parametrisations (the rest of the model zoo, dtypes, rescaling
exponents, α and moments) are marked ``slow`` here: nothing is skipped, only grouped. ``-m slow`` runs
them alone and ``-m "slow or not slow"`` runs everything (what CI runs).
"""

import gc

import jax
import pytest

jax.config.update("jax_enable_x64", True)


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m selection
def pytest_collection_modifyitems(config, items):
    seen = set()
    for item in items:
        function = item.nodeid.split("[")[0]
        if hasattr(item, "callspec") and function in seen:
            item.add_marker(pytest.mark.slow)
        seen.add(function)


@pytest.fixture(scope="module", autouse=True)
def _free_compiled_programs():
    """Drop JAX's compiled programs after each test module.

    A worker that runs many modules otherwise keeps every executable it compiled: 2.6 GB at the end of the
    default run, 1.1 GB with this (modules share little worth keeping; the default run takes the same time).
    """
    yield
    jax.clear_caches()
    gc.collect()
