#!/usr/bin/env bash
# The GPU checks of a short lease, within a fixed number of seconds, from the repository root:
#
#   sh benchmarks/gpu_check.sh bench [SECONDS] [LOGDIR]   # step benchmarks on an idle GPU, then report.py
#   sh benchmarks/gpu_check.sh suite [SECONDS] [LOGDIR]   # the whole test suite, 14 workers
#   sh benchmarks/gpu_check.sh ab CHANGE [SECONDS] [LOGDIR] # bench_path_sgd without and with CHANGE, twice
#   sh benchmarks/gpu_check.sh profile [SECONDS] [LOGDIR] # gpu_profile.py: kernels and device time per step
#   sh benchmarks/gpu_check.sh variants "PATCH ..." "CASE ..." [SECONDS] [LOGDIR] # gpu_profile.py per variant
#
# `variants` profiles gpu_profile.py's CASEs (e.g. "mlp512:g_sgd cnn:g_sgd") as things are and with each PATCH
# of the library (applied with `git apply`, reverted after its run), in rounds (base, each patch; again while
# time is left), printing each run's device µs, wall µs and kernels per step; the runs' logs, JSON and HLO as
# LOGDIR/variants.tgz. The fifth lease's three path-norm variants with two rounds took about 110 s per call.
# `ab` times a candidate change in one call: bench_path_sgd.py as things are and with CHANGE, alternating, twice
# each, each run's JSON kept as {base,changed}{1,2}.json in LOGDIR/ab.tgz. CHANGE is a patch of the library (applied
# with `git apply`, reverted after each run) or an environment setting VAR=VALUE for the changed runs (e.g.
# XLA_FLAGS=--xla_gpu_enable_command_buffer=). The results folder's path_sgd.json is restored at the end. Chain
# it with `bench` in one call (`ab P 240 $OUT; bench 330 $OUT`). On 2 CPU cores the four runs took 200 s.
# SECONDS (default 560) bounds the run; LOGDIR (default /tmp/gpu_check) gets one log (bench.log or suite.log), and
# `bench` its results folder (JSON and figures) as LOGDIR/results.tgz, `ab` its runs as LOGDIR/ab.tgz: one file
# each, `profile` its JSON and HLO as LOGDIR/profile.tgz: one file each, since a lent machine sends back only a few
# files per call (the third lease lost its JSON that way). Needs jax with CUDA, flax, optax, chex, pytest and
# pytest-xdist, with the checkout on PYTHONPATH or installed. On one H200 (JAX 0.11.2) the whole suite took 414 s
# from a cold compilation cache (2026-11-27), then more than 425 s (all 555 results in, cut off before pytest's
# summary), then 413 s with 655 tests (2026-11-28): give it 490. bench_path_sgd, bench_gsgd and bench_kernels took
# 154 s; `profile`'s ten cases under 130 s.
set -u
mode=${1:?usage: gpu_check.sh bench|suite|profile [SECONDS] [LOGDIR], ab CHANGE [SECONDS] [LOGDIR], or variants PATCHES CASES [SECONDS] [LOGDIR]}
if [ "$mode" = ab ]; then
    change=${2:?usage: gpu_check.sh ab PATCH|VAR=VALUE [SECONDS] [LOGDIR]}
    shift
elif [ "$mode" = variants ]; then
    patches=${2:?usage: gpu_check.sh variants "PATCH ..." "CASE ..." [SECONDS] [LOGDIR]}
    cases=${3:?usage: gpu_check.sh variants "PATCH ..." "CASE ..." [SECONDS] [LOGDIR]}
    shift 2
fi
budget=${2:-560}
logs=${3:-/tmp/gpu_check}
mkdir -p "$logs"
start=$(date +%s)
left() { echo $((budget - $(date +%s) + start)); }
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-/tmp/pathspace_jax_gpu_cache}"
nvidia-smi -L
python3 -c "import sys, jax, flax, optax; print(sys.version.split()[0], jax.__version__, flax.__version__, \
optax.__version__, jax.devices()[0].device_kind)"
case "$mode" in
bench)
    folder=$(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import common; print(common.results_folder())")
    : > "$logs/bench.log"
    for name in path_sgd gsgd kernels buffers ddp scale; do
        [ "$(left)" -gt 60 ] || { echo "bench_$name: not run, $(left) s left"; continue; }
        timeout "$(left)" python3 "benchmarks/bench_$name.py" >> "$logs/bench.log" 2>&1
        echo "bench_$name rc=$? at $(($(date +%s) - start)) s" | tee -a "$logs/bench.log"
    done
    tail -60 "$logs/bench.log"
    python3 benchmarks/report.py && tar czf "$logs/results.tgz" -C "$folder" .
    ;;
suite)
    timeout "$(left)" python3 -m pytest -o addopts= -n 14 -m "slow or not slow" -p no:warnings -p no:benchmark \
        -q -rfEx --durations=30 > "$logs/suite.log" 2>&1
    echo "suite rc=$? at $(($(date +%s) - start)) s"
    tail -60 "$logs/suite.log"
    ;;
profile)
    timeout "$(left)" python3 benchmarks/gpu_profile.py "$logs/profile" > "$logs/profile.log" 2>&1
    echo "profile rc=$? at $(($(date +%s) - start)) s"
    cut -c1-300 "$logs/profile.log" | tail -20
    tar czf "$logs/profile.tgz" -C "$logs" profile && rm -r "$logs/profile"
    ;;
ab)
    folder=$(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import common; print(common.results_folder())")
    if [ -f "$change" ]; then
        git apply --check "$change" || exit 2
        env=""
    else
        case "$change" in *=*) env="$change" ;; *) echo "ab: $change is neither a patch file nor VAR=VALUE" >&2; exit 2 ;; esac
    fi
    mkdir -p "$logs/ab"
    [ -f "$folder/path_sgd.json" ] && cp "$folder/path_sgd.json" "$logs/ab/kept.json"
    for i in 1 2; do
        for v in base changed; do
            [ "$(left)" -gt 60 ] || { echo "$v$i: not run, $(left) s left"; continue; }
            vars=""
            [ $v = changed ] && vars="$env"
            if [ $v = changed ] && [ -z "$env" ]; then git apply "$change"; fi
            timeout "$(left)" env ${vars:+"$vars"} python3 benchmarks/bench_path_sgd.py > "$logs/ab/$v$i.log" 2>&1
            echo "$v$i rc=$? at $(($(date +%s) - start)) s"
            cp "$folder/path_sgd.json" "$logs/ab/$v$i.json"
            if [ $v = changed ] && [ -z "$env" ]; then git apply -R "$change"; fi
            grep "x optax" "$logs/ab/$v$i.log"
        done
    done
    # the results folder keeps no candidate's figures
    if [ -f "$logs/ab/kept.json" ]; then cp "$logs/ab/kept.json" "$folder/path_sgd.json"; else rm -f "$folder/path_sgd.json"; fi
    tar czf "$logs/ab.tgz" -C "$logs" ab && rm -r "$logs/ab"
    ;;
variants)
    for p in $patches; do git apply --check "$p" || exit 2; done
    mkdir -p "$logs/variants"
    for round in 1 2; do
        for v in base $patches; do
            [ "$(left)" -gt 40 ] || { echo "$v round $round: not run, $(left) s left"; continue; }
            name=$(basename "$v" .patch)$round
            [ "$v" = base ] || git apply "$v"
            timeout "$(left)" python3 benchmarks/gpu_profile.py "$logs/variants/$name" $cases \
                > "$logs/variants/$name.log" 2>&1
            echo "$name rc=$? at $(($(date +%s) - start)) s"
            [ "$v" = base ] || git apply -R "$v"
            rm -rf "$logs/variants/$name/trace"
            python3 -c "import json, sys
for line in open(sys.argv[1]):
    if line.startswith('{'):
        (case, r), = json.loads(line).items()
        print('   ', case, 'device us', r.get('device_us_per_step'), 'wall us', r.get('wall_us_per_step'),
              'kernels', r.get('device_events_per_step'))" "$logs/variants/$name.log"
        done
    done
    tar czf "$logs/variants.tgz" -C "$logs" variants && rm -r "$logs/variants"
    ;;
*)
    echo "unknown mode $mode: bench, suite, profile, ab or variants" >&2
    exit 2
    ;;
esac
