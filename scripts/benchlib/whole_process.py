"""`--whole-process`: each setting timed as the whole process a user starts, imports and model
load included: `batchllm run JOB.yaml` against the transformers script a user would write
(hf_job.py). Rounds in alternating order as in isolate.py; figures are means."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .isolate import mean_of
from .workload import workload_file

HERE = Path(__file__).resolve().parent
SETTINGS = ("hf-static", "batchllm-sharing", "batchllm-no-sharing")


def _job_file(args: argparse.Namespace, workload: Path, out: Path, sharing: bool) -> Path:
    """The job a user would write for the workload (JSON is YAML)."""
    import pyarrow.parquet as pq

    chats = "messages" in pq.read_schema(workload).names
    job = {
        "name": f"bench-{'sharing' if sharing else 'no-sharing'}",
        "model": {"path": args.model, "device": args.device, "dtype": "float32"},
        "input": {"path": str(workload), "messages_column": "messages" if chats else None},
        "output": {"path": str(out / "out.parquet"), "mode": "overwrite"},
        "sampling": {"max_tokens": args.max_tokens, "ignore_eos": not args.eos},
        "engine": {"page_size": args.page_size, "prefix_sharing": sharing},
    }
    path = out / "job.yaml"
    path.write_text(json.dumps(job))
    return path


def _run_one(name: str, args: argparse.Namespace, workload: Path, tmp: Path) -> dict:
    out = tmp / name
    out.mkdir(exist_ok=True)
    if name == "hf-static":
        from batchllm.model.resolve import resolve_model  # the folder only: not in the timing

        cmd = [sys.executable, str(HERE / "hf_job.py"), str(workload),
               str(resolve_model(args.model)), str(out / "hf.json"),
               "--batch-size", str(args.batch_size), "--max-tokens", str(args.max_tokens)]
        cmd += ["--eos"] if args.eos else []
    else:
        job = _job_file(args, workload, out, sharing=name == "batchllm-sharing")
        cmd = ["batchllm", "run", str(job), "--quiet"]
    start = time.perf_counter()
    subprocess.run(cmd, check=True)
    wall = time.perf_counter() - start
    if name == "hf-static":
        got = json.loads((out / "hf.json").read_text())
        return {"setting": name, "wall_s": wall, **got, "note": "whole process"}
    m = json.loads((out / "out.parquet.metrics.json").read_text())
    return {"setting": name, "wall_s": wall, "prompt_tokens": m["prompt_tokens"],
            "output_tokens": m["completion_tokens"], "prefill_tokens": m["prefill_tokens"],
            "kv_pages_peak": m["kv_pages_peak"], "metrics": m,
            "note": f"whole process; start-up {m.get('startup_seconds', 0):.1f} s, inside the "
                    f"run {m['wall_seconds']:.1f} s"}


def whole_process(args: argparse.Namespace) -> tuple[list[dict], dict, dict[str, list[dict]]]:
    """Every setting as its own process, --repeat rounds in alternating order. Returns (the
    means, the environment, every run)."""
    names = [n for n in SETTINGS if not (n == "hf-static" and (args.skip_hf or
                                                               args.skip_hf_static))
             and not (n.startswith("batchllm") and args.skip_batchllm)]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        workload = workload_file(args.workload, Path(tmp))
        if args.rows is not None:
            import pyarrow.parquet as pq

            cut = Path(tmp) / "rows.parquet"
            pq.write_table(pq.read_table(workload).slice(0, args.rows), cut)
            workload = cut
        for round_ in range(args.repeat):
            for name in names if round_ % 2 == 0 else names[::-1]:
                print(f"running {name} (whole process) ...", file=sys.stderr, flush=True)
                r = _run_one(name, args, workload, Path(tmp))
                r["output_tok_s"] = r["output_tokens"] / r["wall_s"]
                r["total_tok_s"] = (r["prompt_tokens"] + r["output_tokens"]) / r["wall_s"]
                print(f"  {name}: {r['wall_s']:.1f} s", file=sys.stderr, flush=True)
                runs[name].append(r)
    env = {"whole_process": True, "repeat": args.repeat, "eos": args.eos}
    return [mean_of(runs[n]) for n in names], env, runs
