"""Job files for tests: a Parquet of prompts (ids "r0", "r1", ...) and a job that runs a tiny
random Llama (hf_reference.tiny_model_folder) on it on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from hf_reference import tiny_model_folder

from batchllm.rows.record import Row
from batchllm.sampling_params import SamplingParams


def tiny_job(tmp: Path, name: str, job_name: str, prompts: list[str], sampling: dict,
             engine: dict) -> Path:
    """Writes tmp/in.parquet (once: every job of a test shares it) and tmp/<name>.yaml, a job
    named job_name whose output is tmp/<name>/out.parquet. Returns the job file's path."""
    data = tmp / "in.parquet"
    if not data.exists():
        ids = [f"r{i}" for i in range(len(prompts))]
        pq.write_table(pa.table({"id": ids, "prompt": prompts}), data)
    job = {
        "name": job_name,
        "model": {"path": str(tiny_model_folder("llama")), "device": "cpu"},
        "input": {"path": str(data)},
        "output": {"path": str(tmp / name / "out.parquet")},
        "sampling": sampling,
        "engine": engine,
    }
    path = tmp / f"{name}.yaml"
    path.write_text(json.dumps(job))  # JSON is YAML
    return path


def output_row(index: int, line: dict) -> Row:
    """A line of a final output file (a dict of its columns) as the finished Row that wrote it,
    to put into a checkpoint part as an earlier run would have."""
    prompt_ids = np.zeros(line["prompt_tokens"], np.int32)  # only the count is written
    row = Row(index, line["id"], prompt_ids, SamplingParams(), line.get("prompt"))
    if line["finish_reason"] == "error":
        row.fail(line["error"])
    else:
        row.finish(line.get("token_ids") or [0] * line["completion_tokens"], line["completion"],
                   line["finish_reason"], line["cached_tokens"])
    return row
