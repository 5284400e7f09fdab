"""Host memory per row of a job: the peak resident set of a whole `run_job` in a fresh child
process, at two sizes, and the growth per extra row (the difference cancels the model, torch and
everything else a job holds whatever its size).

    python scripts/measure_row_memory.py [--rows 4000,24000] [--max-tokens 16] [--logprobs 5]
                                         [--out DIR]

The job (issue 27): short templated prompts on a tiny random Llama (tests/hf_reference.py) on the
CPU, sampled, each row `--max-tokens` tokens with `--logprobs` alternatives. Prints one JSON line
per size (rows, peak_mib: ru_maxrss of the child, wall_s) and then the growth in bytes per extra
row between the first and the last size. `child JOB` is the measuring child itself.
"""

from __future__ import annotations

import argparse
import json
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
        "engine": {"kv_cache_memory": "256MiB", "max_num_seqs": 256},
    }
    path = folder / "job.yaml"
    path.write_text(json.dumps(job))  # JSON is YAML
    return path


def child(job: str) -> None:
    from batchllm.job import run_job

    start = time.perf_counter()
    metrics = run_job(job, progress=False)
    print(json.dumps({"rows": metrics["rows"], "wall_s": round(time.perf_counter() - start, 1),
                      "peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))


def measure(job: Path) -> dict:
    """Runs the job in a fresh child; its rows, wall seconds and peak resident set (KiB)."""
    out = subprocess.run([sys.executable, __file__, "child", str(job)], check=True,
                         capture_output=True, text=True)
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
    per_row = (hi["peak_mib"] - lo["peak_mib"]) * (1 << 20) / (hi["rows"] - lo["rows"])
    print(json.dumps({"bytes_per_extra_row": round(per_row)}))


if __name__ == "__main__":
    main()
