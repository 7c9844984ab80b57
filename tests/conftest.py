"""Test configuration: x64 for the tests that ask for float64, and the fast default run.

The default ``python -m pytest`` (``-m "not slow"`` in pyproject's addopts) runs every test function
with its first parametrisation, except the tests marked ``slow`` (training runs, 4-device sharding,
statistical checks). The other parametrisations (the rest of the model zoo, dtypes, rescaling
exponents, α and moments) are marked ``slow`` here: nothing is skipped, only grouped. ``-m slow`` runs
them alone and ``-m "slow or not slow"`` runs everything (what CI runs).
"""

import gc
import os
import subprocess
import sys
import tempfile

import jax
import pytest

jax.config.update("jax_enable_x64", True)
# JAX's persistent compilation cache, shared by the pytest workers and the subprocesses some tests start (they
# inherit the environment): a program compiled twice in a run (the same model in several tests, again after the
# per-module clearing below) is compiled once, and a second run on the same machine compiles little. It lives in
# the temporary folder. PJ_TEST_CACHE=0 turns it off.
if os.environ.get("PJ_TEST_CACHE", "1") != "0":
    _CACHE = {
        "jax_compilation_cache_dir": os.path.join(tempfile.gettempdir(), f"pathspace_jax_test_cache_{os.getuid()}"),
        "jax_persistent_cache_min_compile_time_secs": 0.0,
        "jax_persistent_cache_min_entry_size_bytes": 0,
    }
    for _name, _value in _CACHE.items():
        jax.config.update(_name, _value)
        os.environ[_name.upper()] = str(_value)


# Compilation is most of the suite's CPU time, and most tests run each program a few times on small arrays. So
# the tests compile at XLA:CPU's -O0 (JAX's documented jax_disable_most_optimizations, "useful if the cost of
# optimization is greater than that of running a less-optimized program"); the tests whose programs run long
# (training loops, a CNN's Jacobian) are marked ``optimised`` and compile at -O1 without LLVM's expensive passes,
# which compiles faster than the default and runs as fast (at -O0 a convolution is not vectorised). Where jaxlib
# still has them, XLA:CPU's older (LLVM IR) fusion emitters compile faster again than its MLIR ones; jaxlib 0.12
# has no switch for them, and XLA aborts the process on a flag it does not know, so a subprocess tries it first
# (once per run: the pytest workers and the tests' subprocesses inherit the environment). Set before JAX starts
# its backend; tests that set XLA_FLAGS for their subprocesses append to it. PJ_TEST_FAST_COMPILE=0 compiles as
# users do. docs/contributing.md says what each of these saves.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=1 --xla_llvm_disable_expensive_passes=true"
LEGACY_FUSION_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def _xla_accepts(flags: str) -> bool:
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True)
    return run.returncode == 0


if os.environ.get("PJ_TEST_FAST_COMPILE", "1") != "0" and "PJ_TEST_XLA_FLAGS" not in os.environ:
    _flags = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()
    if _xla_accepts(f"{_flags} {LEGACY_FUSION_EMITTERS}"):
        _flags = f"{_flags} {LEGACY_FUSION_EMITTERS}"
    os.environ["XLA_FLAGS"] = os.environ["PJ_TEST_XLA_FLAGS"] = _flags
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
    jax.config.update("jax_disable_most_optimizations", True)


# XLA:CPU of jaxlib 0.10 and 0.11 runs reductions as YNNPACK fusions that race when the process has more than one
# thread: a compiled program can return different values from one call to the next on the same buffers (an open
# JAX issue: "[CPU] One compiled module returns different results across calls when the process has more than one
# thread", jax-ml/jax#39741; jaxlib 0.12 fixed it; on one core it does not happen). The library's own programs
# compile without those fusions there (pathspace_jax.frames.eager_jit; its test runs on every core, in a
# subprocess), but the tests' own jitted steps are compiled as a user's are. Each pytest worker therefore runs on
# one core of its own (xdist starts one worker per core), set before JAX starts its backend; the tests'
# subprocesses inherit it. Pinning does not slow the suite down. PJ_TEST_ONE_CORE=0 leaves the workers on every
# core. A worker that xdist starts in place of a crashed one (gwN with N >= the worker count, below) is left on
# every core: pinned by its number it would share a core with another worker and leave one idle.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
_FIRST = _WORKER.startswith("gw") and int(_WORKER[2:]) < int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _FIRST and os.environ.get("PJ_TEST_ONE_CORE", "1") != "0" and hasattr(os, "sched_setaffinity"):
    _cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {_cores[int(_WORKER[2:]) % len(_cores)]})


# A pytest worker now and then dies of a segmentation fault (or an abort) inside XLA:CPU's native code while it
# compiles or loads a program (`backend_compile_and_load`, or `deserialize_executable` from the cache above), a
# different test each time (jaxlib 0.10.2; with and without the persistent cache, -O0, the older emitters, and on
# one core, so not the thread race above). A crashed test run again in a fresh process passes. A core dump showed
# libgcc's unwinder faulting in `_Unwind_Find_FDE` while LLVM's JIT threw its error ("Failed to materialize
# symbols"); a likely cause is the unwinding tables of compiled programs already freed but still registered.
# Nothing of this library's code is on that stack. A test whose worker crashed is run once more on a fresh worker
# (xdist starts one) and reported as a rerun ("R", listed at the end); a second crash fails it. Without xdist
# (-p no:xdist) a crash ends the run.
_CRASHED: set[str] = set()


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
    if crashitem not in _CRASHED:
        _CRASHED.add(crashitem)
        sched.mark_test_pending(crashitem)
        report.outcome = "rerun"


def pytest_report_teststatus(report):
    if report.outcome == "rerun":
        return "rerun", "R", ("RERUN", {"yellow": True})


def pytest_terminal_summary(terminalreporter):
    for report in terminalreporter.stats.get("rerun", []):
        line = f"RERUN {report.nodeid}: {report.longrepr}; run once more on a fresh worker"
        terminalreporter.write_line(line, yellow=True)


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m selection
def pytest_collection_modifyitems(config, items):
    seen = set()
    for item in items:
        function = item.nodeid.split("[")[0]
        if hasattr(item, "callspec") and function in seen:
            item.add_marker(pytest.mark.slow)
        seen.add(function)


@pytest.fixture(autouse=True)
def _optimised(request):
    """A test marked ``optimised`` compiles its programs with XLA's optimisations (see above)."""
    if request.node.get_closest_marker("optimised") is None or not jax.config.values["jax_disable_most_optimizations"]:
        yield
        return
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", True)


@pytest.fixture(scope="module", autouse=True)
def _free_compiled_programs():
    """Drop JAX's compiled programs after each test module.

    A worker that runs many modules otherwise keeps every executable it compiled, over twice the memory at the
    end of the default run (modules share little worth keeping; the run takes the same time).
    """
    yield
    jax.clear_caches()
    gc.collect()
