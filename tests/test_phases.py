"""The phases of a job (engine/metrics.py Phases, job.py): in the metrics file, each measured by
the code that does it, positive, adding up to the whole process; start-up ends at the first
forward; `batchllm run --profile` prints them; the Prometheus file carries them too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hf_reference import tiny_model_folder

from batchllm.engine.metrics import PHASES, Phases, phase_report, process_started
from batchllm.job import run_job
from batchllm.rows.prometheus import render

BATCHLLM = str(Path(sys.executable).parent / "batchllm")
PARTS = ("import", "read", "load", "tokenize", "plan")  # start-up: these, up to the first forward
EPS = 1e-9  # float rounding of sums of perf_counter differences, not a time slack


def write_job(tmp: Path) -> Path:
    prompts = [f"Clause {i}: the parties agree that" for i in range(12)]
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(12)], "prompt": prompts}),
                   tmp / "in.parquet")
    job = {"name": "phases", "model": {"path": str(tiny_model_folder("llama")), "device": "cpu"},
           "input": {"path": str(tmp / "in.parquet")},
           "output": {"path": str(tmp / "out.parquet"), "prometheus": str(tmp / "job.prom")},
           "sampling": {"max_tokens": 5, "ignore_eos": True},
           "engine": {"kv_cache_memory": "64MiB"}}
    (tmp / "job.yaml").write_text(json.dumps(job))
    return tmp / "job.yaml"


def check_phases(m: dict, whole: float) -> None:
    """The keys are there and positive; measured one after another, they add up to no more than
    the process, which is within the caller's own measure; the parts run before the first
    forward, the write after it; what no phase covers (lock, checks) is smaller than the largest phase."""
    for phase in PHASES:
        assert m[f"{phase}_seconds"] > 0, phase
    assert 0 < m["startup_seconds"] < m["process_seconds"] <= whole
    measured = sum(m[f"{p}_seconds"] for p in PHASES)
    assert measured <= m["process_seconds"] + EPS  # disjoint blocks on one clock
    # the rest (lock, output checks) is smaller than the largest phase: a step of the job's
    # size left out of every phase shows here
    assert m["process_seconds"] - measured < max(m[f"{p}_seconds"] for p in PHASES)
    before_forward = sum(m[f"{p}_seconds"] for p in PARTS)
    assert before_forward <= m["startup_seconds"] + EPS  # the parts end before the first forward
    # the first forward is in the run: before the run's end, so before the write
    assert m["startup_seconds"] < before_forward + m["run_seconds"]
    assert m["startup_seconds"] + m["write_seconds"] <= m["process_seconds"] + EPS


@pytest.mark.slow  # the whole command in a process of its own
def test_the_command_reports_the_phases(tmp_path: Path) -> None:
    job = write_job(tmp_path)
    start = time.perf_counter()
    proc = subprocess.run([BATCHLLM, "run", str(job), "--quiet", "--profile"],
                          capture_output=True, text=True, timeout=600, check=False)
    whole = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    m = json.loads((tmp_path / "out.parquet.metrics.json").read_text())
    check_phases(m, whole)
    assert m["import_seconds"] > 0  # counted from the process start (the unit test below)
    assert "profile (seconds)" in proc.stderr
    for phase in (*PHASES, "whole", "start-up"):
        assert f"\n  {phase} " in proc.stderr, phase
    prom = (tmp_path / "job.prom").read_text()
    for key in ("startup_seconds", "load_seconds", "run_seconds", "process_seconds"):
        assert f'batchllm_{key}{{job="phases"}} ' in prom, key


def test_run_job_counts_from_the_call(tmp_path: Path) -> None:
    job = write_job(tmp_path)
    start = time.perf_counter()
    m = run_job(job, progress=False)
    check_phases(m, time.perf_counter() - start)
    assert json.loads((tmp_path / "out.parquet.metrics.json").read_text())["load_seconds"] == (
        m["load_seconds"])


def test_phases_add_what_each_block_takes() -> None:
    phases = Phases(started=time.perf_counter() - 1.0)
    first = time.perf_counter()
    with phases.timed("read"):
        time.sleep(0.02)
    between = time.perf_counter()
    with phases.timed("read"):
        time.sleep(0.02)
    last = time.perf_counter()
    phases.since_start("import")
    d = phases.to_dict()
    # both blocks added: more than either sleep, no more than the span around them
    assert 0.04 <= d["read_seconds"] <= last - first
    assert d["read_seconds"] > between - first
    assert d["import_seconds"] >= 1.0 and d["process_seconds"] >= d["import_seconds"]
    assert "startup_seconds" not in d  # no forward ran
    assert "read" in phase_report(d) and "whole" in phase_report(d)


def test_process_start_is_before_now_and_after_boot() -> None:
    age = time.perf_counter() - process_started()
    assert 0 <= age < time.monotonic() + 1
    if os.path.exists("/proc/self/stat"):
        assert age > 0.05  # this test process has run pytest's collection at least


def test_prometheus_renders_the_phase_keys() -> None:
    text = render("j", {"load_seconds": 1.5, "startup_seconds": 2.0})
    assert 'batchllm_load_seconds{job="j"} 1.5' in text
    assert 'batchllm_startup_seconds{job="j"} 2.0' in text
