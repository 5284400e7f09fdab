"""Host memory per row of a job: the peak resident set of `run_job` in a fresh child process, at
two sizes, and the growth per extra row (the difference cancels the model, torch and everything
else a job holds whatever its size).

Each child first runs a warm-up job of the same shape (WARM_ROWS rows: torch imported, the model
loaded once, the allocator's arenas made), then resets its peak (/proc/self/clear_refs 5, which
getrusage's ru_maxrss follows; the warm-up's objects, frozen by batchllm.collector, unfrozen and
collected, so that the job reuses their memory) and runs the measured job: without it the start-up's transient
peak (~600 MiB, varying by tens of MiB from run to run) hides the rows' share.

    python scripts/measure_row_memory.py [--rows 4000,24000] [--max-tokens 16] [--logprobs 5]
                                         [--out DIR]

From 2026-12-03 (engine commit de025b1) to 2026-12-04 (41fddc0) a step's log-probabilities were
kept as small tensors until its last row finished: a 64-row job's heap grew ~400 MiB in its first
steps and stayed there (fragmentation: gone after malloc_trim), which a peak here could hide. Now
turned into lists when the step's ids are read: 64 rows, logprobs 5, VmRSS after the job 1,038 ->
763 MiB. Per-phase figures (tracemalloc, or /proc/self/status VmHWM around a phase in a process of
its own) are the sharper tool for a single change.

The job (issue 27): short templated prompts on a tiny random Llama (tests/hf_reference.py) on the
CPU, sampled, each row `--max-tokens` tokens with `--logprobs` alternatives. Prints one JSON line
per size (rows, peak_mib: ru_maxrss of the child, wall_s) and then the growth in bytes per extra
row between the first and the last size. `child JOB` is the measuring child itself.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def prompts(n: int) -> list[str]:
    """n short templated prompts (a few distinct templates, the numbers varying)."""
    return [f"Order {i}: ship {i % 7} boxes to city {i % 13} by day {i % 31}. Confirm?"
            for i in range(n)]


def write_job(folder: Path, rows: int, max_tokens: int, logprobs: int) -> Path:
    """folder/in.parquet with `rows` prompts and folder/job.yaml running them."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from hf_reference import tiny_model_folder

    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "in.parquet"
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(rows)], "prompt": prompts(rows)}),
                   data)
    job = {
        "name": f"row-memory-{rows}",
        "model": {"path": str(tiny_model_folder("llama")), "device": "cpu"},
        "input": {"path": str(data)},
        "output": {"path": str(folder / "out.parquet"), "mode": "overwrite"},
        "sampling": {"max_tokens": max_tokens, "temperature": 0.8, "seed": 1,
                     "logprobs": logprobs},
        "engine": {"kv_cache_memory": "32MiB", "max_num_seqs": 64},
    }
    path = folder / "job.yaml"
    path.write_text(json.dumps(job))  # JSON is YAML
    return path


WARM_ROWS = 64


def child(job: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from batchllm.job import run_job

    warm = Path(job).parent / "warm"
    warm.mkdir(exist_ok=True)
    pq.write_table(pa.table({"id": [f"w{i}" for i in range(WARM_ROWS)],
                             "prompt": prompts(WARM_ROWS)}), warm / "in.parquet")
    spec = json.loads(Path(job).read_text())
    spec.update(name="row-memory-warm-up", input={"path": str(warm / "in.parquet")},
                output={"path": str(warm / "out.parquet"), "mode": "overwrite"})
    (warm / "job.yaml").write_text(json.dumps(spec))
    run_job(warm / "job.yaml", progress=False)
    gc.unfreeze()  # what the warm-up froze (batchllm.collector) is freed, for the job to reuse
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # the peak starts again from here
    start = time.perf_counter()
    metrics = run_job(job, progress=False)
    print(json.dumps({"rows": metrics["rows"], "wall_s": round(time.perf_counter() - start, 1),
                      "peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))


def measure(job: Path, checkpoint_rows: int = 256) -> dict:
    """Runs the job in a fresh child (a part every `checkpoint_rows` rows); its rows, wall
    seconds and peak resident set (peak_kib)."""
    env = {**os.environ, "BATCHLLM_CHECKPOINT_ROWS": str(checkpoint_rows)}
    out = subprocess.run([sys.executable, __file__, "child", str(job)], check=True,
                         capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    if sys.argv[1:2] == ["child"]:
        return child(sys.argv[2])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="4000,24000")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--logprobs", type=int, default=5)
    ap.add_argument("--out", default="/tmp/batchllm-row-memory")
    args = ap.parse_args()
    sizes = [int(s) for s in args.rows.split(",")]
    results = []
    for n in sizes:
        job = write_job(Path(args.out) / str(n), n, args.max_tokens, args.logprobs)
        r = measure(job)
        r["peak_mib"] = round(r.pop("peak_kib") / 1024, 1)
        print(json.dumps(r), flush=True)
        results.append(r)
    lo, hi = results[0], results[-1]
    if hi["rows"] == lo["rows"]:  # one size: no growth to report
        return
    per_row = (hi["peak_mib"] - lo["peak_mib"]) * (1 << 20) / (hi["rows"] - lo["rows"])
    print(json.dumps({"bytes_per_extra_row": round(per_row)}))


if __name__ == "__main__":
    main()
