#!/usr/bin/env bash
# One short check on a lent GPU (written for an H200; no internet needed), about 5 minutes:
#   1. in parallel (Triton compiles dominate; one CPU core per stream):
#      tests/test_kernels.py on CUDA in float32 and bfloat16 (four streams),
#      tests/test_reference_attention.py, and tests/test_engine_equivalence.py if present;
#   2. then scripts/bench_kernels.py alone on the GPU.
# Every step has a timeout; everything goes to $OUT/gpu_check.log when $OUT is set.
# Usage: bash scripts/gpu_check.sh        (from anywhere; exits non-zero if a step failed)
#   PYTHON=/work/venv/bin/python BENCH_ARGS="--device cpu --interpret" bash scripts/gpu_check.sh
#       (a smoke run without a GPU: the kernel tests run in the Triton interpreter)
set -u
cd "$(dirname "$0")/.."
LOG_DIR=${OUT:-$(mktemp -d)}
mkdir -p "$LOG_DIR"
LOG="$LOG_DIR/gpu_check.log"
PY=${PYTHON:-$(command -v python || command -v python3)}  # PYTHON=... to choose
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # instead of pip install -e .
export TRITON_DEFAULT_FP_FUSION=1  # today's default, stated to silence Triton's warning
STEPS=$(mktemp -d)
FAILED=0
SUMMARY=()

start() {  # start NAME LIMIT CMD...: run in the background, output to its own file
    local name=$1 limit=$2
    shift 2
    echo "--- start $name (timeout ${limit}s): $*"
    ( s=$(date +%s); timeout -k 10 "$limit" "$@" > "$STEPS/$name.log" 2>&1; rc=$?
      echo "$rc $(( $(date +%s) - s ))" > "$STEPS/$name.rc" ) &
}

report() {  # report NAME: its output (less Triton's exit noise) and result
    local name=$1 rc secs
    read -r rc secs < "$STEPS/$name.rc"
    echo "=== $name: rc=$rc in ${secs}s$([ "$rc" = 124 ] && echo ' (TIMED OUT)')"
    grep -v -e nanobind -e leaked -e refleaks "$STEPS/$name.log" | tail -n 60
    [ "$rc" = 0 ] || FAILED=1
    SUMMARY+=("$name rc=$rc ${secs}s")
}

main() {
    local t0 names=()
    t0=$(date +%s)
    echo "=== gpu_check $(date -u +%FT%TZ) in $PWD, log $LOG"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
    timeout 60 "$PY" -c 'import sys, torch, triton
print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__,
      "cuda", torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available()
      else "NO CUDA DEVICE")'

    if timeout 60 "$PY" -m pytest --version; then
        # One CPU thread per kernel stream: their torch work is on the GPU or tiny, and six
        # processes with a thread per core each would fight over the cores.
        local pytest=("$PY" -m pytest -q -rfE -p no:cacheprovider --durations=5)
        local kernels=(env OMP_NUM_THREADS=1 "${pytest[@]}" tests/test_kernels.py -k)
        start kernels_f32_paged 210 "${kernels[@]}" "float32 and paged"
        start kernels_f32_rest 210 "${kernels[@]}" "float32 and not paged"
        start kernels_bf16_paged 210 "${kernels[@]}" "not float32 and paged"
        start kernels_bf16_rest 210 "${kernels[@]}" "not float32 and not paged"
        start reference 120 env OMP_NUM_THREADS=1 "${pytest[@]}" tests/test_reference_attention.py
        names+=(kernels_f32_paged kernels_f32_rest kernels_bf16_paged kernels_bf16_rest reference)
        if [ -f tests/test_engine_equivalence.py ]; then
            start engine 210 env OMP_NUM_THREADS=4 \
                "${pytest[@]}" -x tests/test_engine_equivalence.py
            names+=(engine)
        else
            echo "--- tests/test_engine_equivalence.py not found: skipped"
        fi
        wait
        for name in "${names[@]}"; do report "$name"; done
    else
        echo "--- pytest missing: tests skipped"
        FAILED=1
    fi

    # shellcheck disable=SC2086  # BENCH_ARGS is a list of words
    start bench 150 "$PY" scripts/bench_kernels.py ${BENCH_ARGS:-}
    wait
    report bench

    echo "=== summary ($(( $(date +%s) - t0 ))s in all)"
    printf '  %s\n' "${SUMMARY[@]}"
    if [ "$FAILED" = 0 ]; then echo "=== ALL PASSED"; else echo "=== SOME STEPS FAILED"; fi
    return "$FAILED"
}

main 2>&1 | tee -a "$LOG"
exit "${PIPESTATUS[0]}"
