#!/usr/bin/env bash
# One command for a GPU machine without internet (torch, triton, transformers installed; no
# vLLM), about 7 minutes on an H200, everything into $OUT/gpu_check.log when $OUT is set:
#   1. the CUDA tests, in parallel (kernels compiled in float32 and bfloat16; the Triton engine
#      end to end with its decode graphs captured; the equivalence grid's CUDA cases), while
#      random-weight models shaped like Qwen2.5-0.5B, Llama-3.2-1B and Llama-3.1-8B are built
#      with transformers from their configs (scripts/random_models.py) and the two jobs written
#      (scripts/gpu_workloads.py: a 4,096-row shared-prefix job; nano-vllm's 256 sequences of
#      100-1,024 random input and output tokens);
#   2. per model: batchllm against transformers in bfloat16 under the bfloat16 rule
#      (scripts/gpu_equivalence.py), then scripts/bench.py on both jobs: batchllm with CUDA
#      graphs on and off, prefix sharing on and off; transformers `generate` in static batches
#      and `generate_batch` (continuous batching) on the Qwen shape, on the first rows;
#   3. on a machine with two GPUs, tensor_parallel 2 (NCCL) on the Qwen shape against transformers;
#   4. one table (scripts/gpu_table.py), the goals, and every mismatch, loudly; per setting its
#      replayed/eager steps (rows are admitted in bursts where graphs replay: on the shared-prefix
#      job with graphs on, the goal is at least half the steps replayed).
# Stages run under a budget (GPU_CHECK_BUDGET seconds, 400): one that would not fit is skipped,
# and said so. Exit non-zero on any failed test, mismatch, timeout or skip.
# $OUT (the device tool's folder; a temp folder without it) gets three files, rewritten as each
# stage ends so that a timeout loses nothing: gpu_check.log, stages.json (each stage's rc,
# seconds and bench JSON) and gpu_check_logs.tar.gz (every stage's log and JSON). A preflight of
# 20 s (scripts/gpu_preflight.py) stops the run at once. A setting that crashed is a failure.
# Usage: bash scripts/gpu_check.sh                (from anywhere)
#   PYTHON=/path/python   the interpreter (default: python on PATH)
#   GPU_CHECK_SMOKE=1     a smoke run without a GPU: a tiny model and tiny jobs, the Triton
#                         kernels in the interpreter (BATCHLLM_BACKEND=triton), a few tests
set -u
cd "$(dirname "$0")/.."
LOG_DIR=${OUT:-$(mktemp -d)}
mkdir -p "$LOG_DIR"
LOG="$LOG_DIR/gpu_check.log"
rm -f "$LOG_DIR/stages.json"
PY=${PYTHON:-$(command -v python || command -v python3)}
# This tree's code, installed or not (the device gets a copy): the kernels/ folder is the package
# batchllm_kernels (pyproject's package-dir), reached through a link beside it on the path.
LINKS=$(mktemp -d) && ln -s "$PWD/kernels" "$LINKS/batchllm_kernels"
export PYTHONPATH="$PWD:$LINKS${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_DEFAULT_FP_FUSION=1  # today's default, stated to silence Triton's warning
WORK=${GPU_CHECK_WORK:-/tmp/batchllm-gpu-check}
BUDGET=${GPU_CHECK_BUDGET:-400}
SMOKE=${GPU_CHECK_SMOKE:-0}
STEPS=$(mktemp -d)
FAILED=0
SUMMARY=()
T0=$(date +%s)

start() {  # start NAME LIMIT CMD...: in the background, output to its own file
    local name=$1 limit=$2
    shift 2
    echo "--- start $name (timeout ${limit}s): $*"
    ( s=$(date +%s); timeout -k 10 "$limit" "$@" > "$STEPS/$name.log" 2>&1; rc=$?
      echo "$rc $(( $(date +%s) - s ))" > "$STEPS/$name.rc" ) &
}

report() {  # report NAME: its output's tail and its result
    local name=$1 rc secs
    read -r rc secs < "$STEPS/$name.rc"
    echo "=== $name: rc=$rc in ${secs}s$([ "$rc" = 124 ] && echo ' (TIMED OUT)')"
    grep -v -e nanobind -e leaked -e refleaks -e 'Loading weights' -e 'Writing model' \
        "$STEPS/$name.log" | tail -n 40
    [ "$rc" = 0 ] || FAILED=1
    SUMMARY+=("$name rc=$rc ${secs}s")
    save "$name" "$rc" "$secs"
}

save() {  # save NAME RC SECS: the stage's result (and its bench JSON) into $LOG_DIR/stages.json,
    # every log and JSON so far into $LOG_DIR/gpu_check_logs.tar.gz, so that a timeout loses none
    "$PY" - "$LOG_DIR/stages.json" "$1" "$2" "$3" "$WORK/results/${1#bench_}.json" <<'PYEOF'
import json, sys
from pathlib import Path
path, name, rc, secs, result = Path(sys.argv[1]), *sys.argv[2:]
stages = json.loads(path.read_text()) if path.is_file() else {}
stages[name] = {"rc": int(rc), "seconds": int(secs)}
if Path(result).is_file():
    stages[name]["results"] = json.loads(Path(result).read_text())
path.write_text(json.dumps(stages, indent=1))
PYEOF
    cp -f "$WORK"/results/*.json "$STEPS"/ 2>/dev/null
    tar -czf "$LOG_DIR/gpu_check_logs.tar.gz" -C "$STEPS" . 2>/dev/null
}

stage() {  # stage NAME LIMIT CMD...: run now if it fits the budget, else skip it, loudly
    local name=$1 limit=$2 left
    left=$(( BUDGET - ($(date +%s) - T0) ))
    if [ "$left" -lt 20 ]; then
        echo "=== $name: SKIPPED (${left}s of the budget left)"
        SUMMARY+=("$name SKIPPED (time)")
        FAILED=1
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    start "$name" "$limit" "${@:3}"
    wait
    report "$name"
}

bench() {  # bench MODEL JOB LIMIT SUFFIX ARGS...: scripts/bench.py on one job, to JSON
    local model=$1 job=$2 limit=$3 run="${1}_${2}$4"
    shift 4
    stage "bench_$run" "$limit" "$PY" scripts/bench.py --model "$WORK/models/$model" \
        --workload "$WORK/jobs/$job.parquet" --device "$DEVICE" --dtype bfloat16 \
        --json "$WORK/results/$run.json" "$@"
    TABLE+=("$model:$job:$WORK/results/$run.json")
}

main() {
    local tests=() models vocab=128256 jobs_args=()
    echo "=== gpu_check $(date -u +%FT%TZ) in $PWD, log $LOG, work $WORK, budget ${BUDGET}s"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
    # 0. preflight, 20 s: versions, the packages, a Triton kernel, one CUDA graph; stop at once
    if ! timeout -k 5 20 "$PY" scripts/gpu_preflight.py --device "$([ "$SMOKE" = 1 ] && echo cpu || echo cuda)"; then
        echo "=== PREFLIGHT FAILED: nothing else runs"
        return 2
    fi
    SUMMARY+=("preflight rc=0")
    mkdir -p "$WORK/results"
    rm -f "$WORK"/results/*.json
    if [ "$SMOKE" = 1 ]; then
        export BATCHLLM_BACKEND=triton
        DEVICE=cpu models=tiny vocab=4096 jobs_args=(--tiny)
        tests=(tests/test_triton_step_kernels.py -k "silu or merge")
    else
        DEVICE=cuda models=qwen2.5-0.5b,llama-3.2-1b,llama-3.1-8b
        tests=(tests/test_kernels.py tests/test_triton_step_kernels.py
               tests/test_triton_engine.py tests/test_block_table.py
               tests/test_admission_bursts.py::test_bursts_and_greedy_graphs_on_the_triton_path)
    fi

    # 1. tests, models and jobs at once (the tests are bound by compiles, the models by disk)
    # in parallel, each test under its own limit, where pytest-xdist and pytest-timeout exist
    local pytest=("$PY" -m pytest -q -rfE -p no:cacheprovider --durations=5)
    "$PY" -c 'import xdist' 2>/dev/null && pytest+=(-n "$([ "$SMOKE" = 1 ] && echo 2 || echo 12)")
    "$PY" -c 'import pytest_timeout' 2>/dev/null && pytest+=(--timeout 120)
    start tests 200 env OMP_NUM_THREADS=4 "${pytest[@]}" "${tests[@]}"
    local names=(tests)
    if [ "$SMOKE" != 1 ] && [ -f tests/test_engine_equivalence.py ]; then
        start equivalence_grid 200 env OMP_NUM_THREADS=4 "${pytest[@]}" \
            tests/test_engine_equivalence.py -k cuda
        names+=(equivalence_grid)
    fi
    start models 200 "$PY" scripts/random_models.py "$WORK/models" --models "$models" \
        --device "$DEVICE"
    start jobs 60 "$PY" scripts/gpu_workloads.py "$WORK/jobs" --vocab "$vocab" "${jobs_args[@]}"
    wait
    for name in "${names[@]}" models jobs; do report "$name"; done

    # 2. per model: correctness first, then the speed runs (sharing on and off; graphs on/off)
    TABLE=()
    if [ "$SMOKE" = 1 ]; then
        stage equivalence_tiny 120 "$PY" scripts/gpu_equivalence.py "$WORK/models/tiny" \
            --device cpu --prompts 4 --tokens 8 --kv-cache-memory 67108864
        bench tiny no_sharing 200 "" --sharing off --graphs both --hf-rows 4 --batch-size 4 \
            --in-process
        bench tiny shared_prefix 200 "" --graphs on --hf-rows 4 --batch-size 4 --in-process
    else
        stage equivalence_qwen 60 "$PY" scripts/gpu_equivalence.py "$WORK/models/qwen2.5-0.5b" --kv-cache-memory 0.3
        # no-sharing job: sharing on would find nothing to share; graphs on and off
        bench qwen2.5-0.5b no_sharing 110 "" --sharing off --graphs both --hf-rows 32 \
            --batch-size 32
        # shared-prefix job: sharing on and off, transformers on the first 256 rows (4 documents)
        bench qwen2.5-0.5b shared_prefix 110 "" --graphs on --hf-rows 256 --batch-size 64
        bench qwen2.5-0.5b shared_prefix 40 _nographs --graphs off --sharing on --skip-hf
        stage equivalence_llama1b 45 "$PY" scripts/gpu_equivalence.py \
            "$WORK/models/llama-3.2-1b" --prompts 4 --kv-cache-memory 0.3
        bench llama-3.2-1b no_sharing 40 "" --sharing off --skip-hf
        bench llama-3.2-1b shared_prefix 40 "" --sharing on --skip-hf
        stage equivalence_llama8b 60 "$PY" scripts/gpu_equivalence.py \
            "$WORK/models/llama-3.1-8b" --prompts 4 --tokens 16 --kv-cache-memory 0.3
        bench llama-3.1-8b no_sharing 70 "" --sharing off --skip-hf
    fi
    # tensor_parallel 2 (NCCL) against transformers, where the machine has two GPUs
    if [ "$SMOKE" != 1 ] && [ "$("$PY" -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
        stage equivalence_qwen_tp2 60 "$PY" scripts/gpu_equivalence.py \
            "$WORK/models/qwen2.5-0.5b" --tensor-parallel 2 --kv-cache-memory 0.3
    else
        echo "=== equivalence_qwen_tp2: not run (tensor_parallel 2 needs two CUDA devices)"
        SUMMARY+=("equivalence_qwen_tp2 not run (one device or smoke)")
    fi

    # 4. the table, the goals, the mismatches
    stage table 30 "$PY" scripts/gpu_table.py "${TABLE[@]}"
    echo "=== summary ($(( $(date +%s) - T0 ))s in all)"
    printf '  %s\n' "${SUMMARY[@]}"
    if [ "$FAILED" = 0 ]; then echo "=== ALL PASSED"; else echo "=== SOME STEPS FAILED"; fi
    return "$FAILED"
}

main 2>&1 | tee -a "$LOG"
exit "${PIPESTATUS[0]}"
