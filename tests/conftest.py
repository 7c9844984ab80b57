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
# inherit the environment): every program compiled twice in a run (the same model in several tests, again after
# the per-module clearing below) is compiled once. The full run took 14.6 minutes with it from an empty cache,
# 16.9 without (2026-11-23); on 2026-11-25, 11.0 minutes from an empty cache and 3.4 with a warm one (a second
# run on the same machine); 9.4 minutes from an empty cache after the fused G-SGD chart (commit d1118d1), then
# 8.3 (387 tests) and 7.4 minutes (390 tests) in two later CI dry runs on a clean clone; 9.0 minutes (399 tests,
# another machine) on 2026-11-25 after the exact powers of two (c4dd808), 9.3 minutes (403 tests) later that day;
# then 9.9, 13.2 and 12.7 minutes in three runs on that machine within two hours, the same tests taking 1.2-1.35x
# longer in the later runs whatever the code (checked against a checkout of the earlier commit); 9.3 minutes
# (403 tests) on 2026-11-25 after the unrolled scans of commit e98cb23; 9.5 and 9.8 minutes (413 tests) in two CI
# dry runs on 2026-11-26 (the second after 571a47b took 13 s of worker time out); 12.3-12.5 minutes (502 tests)
# on 2026-11-27, and 13.6 (546 tests: six more zoo models) later that day; 14.1 minutes (549 tests, user 26.5)
# on 2026-11-27 (twenty-second session), then 12.4 (554 tests, user 23.4) with TEST_XLA_FLAGS below; 12.4 (590
# tests, user 23.4) and 8.9 (user 16.4) with XLA:CPU's older fusion emitters (LEGACY_FUSION_EMITTERS below); 9.8
# (655 tests, user 18.0) at the end of that session; 9.1 (657 tests) on 2026-11-28; 9.25 (702 tests) that
# day after the normalisation, attention and gate rules (their zoo and by-hand cases); 9.97 (720 tests) after the
# mixed-precision and stacked-leaf tests of the next session, 9.6 (719 tests) once the mixed-precision test
# computed its float32 reference once; 10.6 (725 tests, user 19.8) on another machine on 2026-11-28, its slowest
# tests the stacked-Transformer comparisons (31 s, 24 s), the FSDP RNN (25 s) and the examples' quick runs; 10.0
# (743 tests, user 18.6) later that day, once the nn.remat variants of the stacked comparison stopped after κ.
# The same machine drifts: that commit took 9.7 minutes (user 18.1) at noon and 11.6 (user 21.5) two hours later;
# between the two, 758 tests (coefficients from parameters, mixtures, gates; the FSDP RNN, the stacked Transformer
# and the stacked LM trimmed) took 10.8 (user 20.1): compare runs made side by side. On 2026-11-28 (thirtieth
# session) 10.7 (760 tests, user 19.9) at the start, 10.0-10.1 (702 tests, user 18.5-18.8) after the zoo-wide
# G-SGD step, DDP and ordinary-model tests ran fewer compiled programs (the unchanged tests within 3 % of each other),
# and 9.0 (user 16.7) half an hour later, the same tests 11 % faster: the machine's faster state; 9.2 (715 tests,
# user 17.1) in the thirty-first session, after its tests of hand-written ReLUs, stack/tile, Python-loop RNNs; 10.0
# (740 tests, user 18.5) and 10.3 (742 tests, user 19.2) in the thirty-second, whose fused-kernel, routed-mixture
# and cut-output tests take ~40 s of worker time from an empty cache (trimmed after: the suite is at its budget);
# 11.4 (742 tests, user 21.3) at the thirty-third session's start, the same commit, the machine slower that day,
# and 11.4 (748 tests, user 20.4) at its end. Of the CPU time, 70 % is XLA compilation (9078 programs). On
# 2026-11-29, 10.6 (748 tests, user 19.9) at the start, 8.0 (user 14.6) once the tests compiled at -O0 (below).
# PJ_TEST_CACHE=0 turns it off.
if os.environ.get("PJ_TEST_CACHE", "1") != "0":
    _CACHE = {
        "jax_compilation_cache_dir": os.path.join(tempfile.gettempdir(), f"pathspace_jax_test_cache_{os.getuid()}"),
        "jax_persistent_cache_min_compile_time_secs": 0.0,
        "jax_persistent_cache_min_entry_size_bytes": 0,
    }
    for _name, _value in _CACHE.items():
        jax.config.update(_name, _value)
        os.environ[_name.upper()] = str(_value)


# The tests compile many small programs and run each a few times: XLA:CPU's LLVM backend at -O1 without its
# expensive passes compiles them faster (test_kappa and test_trace from an empty cache: 157 s -> 123 s on 2
# cores) and runs them as fast (the digits CNN's training test: 13.1 s -> 11.0 s; at -O0 it took 17 times
# longer, its convolutions unvectorised). Where jaxlib still has them, XLA:CPU's older (LLVM IR) fusion emitters
# compile faster again than its MLIR ones: seven of the slowest tests from an empty cache, in one process, 56.7 s
# -> 35.0 s of XLA compilation, 82 s -> 58 s in all (2026-11-27, jaxlib 0.10.2); jaxlib 0.12 has no switch for
# them, and XLA aborts the process on a flag it does not know, so a subprocess tries it first (once per run: the
# pytest workers and the tests' subprocesses inherit the environment). Set before JAX starts its backend; tests
# that set XLA_FLAGS for their subprocesses append to it. PJ_TEST_FAST_COMPILE=0 compiles as users do.
#
# Most tests run each program a few times on small arrays: for them XLA:CPU at -O0 (JAX's documented
# jax_disable_most_optimizations, "useful if the cost of optimization is greater than that of running a
# less-optimized program") halves the compilation again: 533 programs harvested from the suite compiled in 60.5 s
# with the flags above, 29.1 s at -O0 (2026-11-29, jaxlib 0.10.2; 52 % of the suite's CPU time is XLA:CPU
# compiling, 2/3 of it in LLVM's passes and code generation). The tests whose programs run long (training
# loops, a CNN's Jacobian) are marked ``optimised`` and compile at -O1 with the flags above: at -O0 the digits
# CNN's training test took 207 s instead of 15. The tests' subprocesses inherit -O0 through the environment.
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
# thread", jax-ml/jax#39741; jaxlib 0.12 fixed it). Measured on 2026-11-29, 2 cores: ddp_kappa at alpha 1 (exact)
# of a four-block Transformer in float64, outside jit, its one executable called again and again, gave a query
# bias's kappa 1.2-1.8 instead of 1.0 in 4-5 % of the calls with jaxlib 0.10.2 (1 in 421 with the flags above) and
# 0.11.2; 0 of 578 on one core (taskset); 0 of 1204 with jaxlib 0.12.0.1 on two. The library's own programs now
# compile without those fusions there (pathspace_jax.frames.eager_jit; its test runs on every core, in a
# subprocess), but the tests' own jitted steps are compiled as a user's are. Each pytest worker therefore runs on
# one core of its own (xdist starts one worker per core), set before JAX starts its backend; the tests'
# subprocesses inherit it. The whole suite took as long (2 workers, 2 cores; runs in pairs, side by side): 9:22
# pinned (the first run after a change, cache misses) then 8:23 not; 8:38 not then 7:56 pinned.
# PJ_TEST_ONE_CORE=0 leaves the workers on every core.
# A worker that xdist starts in place of a crashed one (gwN with N >= the worker count, below) is left on every core:
# pinned by its number it would share a core with another worker and leave one idle (whole runs with a crash took
# 12:35 and 12:41, user 17 minutes, against 7:22-7:54 without one).
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
_FIRST = _WORKER.startswith("gw") and int(_WORKER[2:]) < int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _FIRST and os.environ.get("PJ_TEST_ONE_CORE", "1") != "0" and hasattr(os, "sched_setaffinity"):
    _cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {_cores[int(_WORKER[2:]) % len(_cores)]})


# A pytest worker now and then dies of a segmentation fault (or an abort) inside XLA:CPU's native code while it
# compiles or loads a program (`backend_compile_and_load`, or `deserialize_executable` from the cache above): a
# different test each time, in 4 of 8 runs of the whole suite on 2026-11-29 (jaxlib 0.10.2), with the persistent
# cache and without it (which took 14.8 minutes instead of 6.4). test_kappa.py alone in one process crashed in 3 of
# 3 runs: with the flags above, without -O0, without the older emitters, and in a fourth on one core (taskset, so
# not the thread race above); its crashed tests repeated 30 times in fresh processes never did. A core dump (gdb)
# showed libgcc's unwinder faulting in
# `_Unwind_Find_FDE` while the loader threw its error (`xla::ValueOrThrow`: "Failed to materialize symbols: {
# (<xla_jit_dylib_0>, { select_n.1_kernel }) }", LLVM's JIT); a likely cause of the fault is the unwinding tables
# of compiled programs already freed but still registered. Nothing of this library's code is on that stack. A
# test whose worker crashed is run once more on a fresh worker (xdist starts one) and reported as a rerun ("R",
# listed at the end); a second crash fails it. Without xdist (-p no:xdist) a crash ends the run as before.
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

    A worker that runs many modules otherwise keeps every executable it compiled: 2.6 GB at the end of the
    default run, 1.1 GB with this (modules share little worth keeping; the default run takes the same time).
    """
    yield
    jax.clear_caches()
    gc.collect()
