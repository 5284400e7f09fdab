"""The step loop's metrics keys (DESIGN): steps, steps_replayed, step_host_seconds and
kernel_path, in a real job's metrics file."""

from __future__ import annotations

import json
from pathlib import Path

from job_files import tiny_job

from batchllm.job import run_job
from batchllm.model.ops import kernel_path

PROMPTS = [f"Question {i}: what does clause {i} of the contract say?" for i in range(6)]


def test_a_jobs_metrics_count_its_steps_host_time_and_kernel_path(tmp_path: Path) -> None:
    job = tiny_job(tmp_path, "steps", "steps", PROMPTS, {"max_tokens": 5, "ignore_eos": True},
                   {"max_num_seqs": 2})
    run_job(job, progress=False)
    m = json.loads((tmp_path / "steps" / "out.parquet.metrics.json").read_text())
    # 6 rows, 2 at a time, 5 tokens each: at least 3 groups x 5 steps
    assert m["steps"] >= 15
    assert m["steps_replayed"] == 0  # no CUDA graph on the CPU
    # outside the forward and the sampling kernels: some, never the whole run
    assert 0 < m["step_host_seconds"] < m["run_seconds"]
    assert m["kernel_path"] == kernel_path("cpu", "float32") != ""
