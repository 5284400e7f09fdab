"""Job files for tests: a Parquet of prompts (ids "r0", "r1", ...) and a job that runs a tiny
random Llama (hf_reference.tiny_model_folder) on it on the CPU."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from hf_reference import tiny_model_folder

from batchllm.rows.record import Row
from batchllm.sampling_params import SamplingParams


def tiny_job(tmp: Path, name: str, job_name: str, prompts: list[str], sampling: dict,
             engine: dict, **sections: dict) -> Path:
    """Writes tmp/in.parquet (once: every job of a test shares it) and tmp/<name>.yaml, a job
    named job_name whose output is tmp/<name>/out.parquet. Returns the job file's path.
    sections: fields to change in other sections, e.g. output={"mode": "resume"}."""
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
    for section, fields in sections.items():
        job[section].update(fields)
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


# -- the operations tests' job: 60 rows, run through the real command line ------------------------

BATCHLLM = str(Path(sys.executable).parent / "batchllm")
FAULTY_CLI = str(Path(__file__).with_name("faulty_cli.py"))
OPS_ROWS = 60


def ops_job(tmp: Path, name: str, **sections: dict) -> Path:
    """The 60-row job of the operations tests (sampled, so that a resumed run that got a row's
    generator wrong would show), its input in tmp/in.parquet, its output tmp/<name>/out.parquet."""
    prompts = [f"Contract {i % 5}: the parties agree to terms {i % 3}. Question {i}?"
               for i in range(OPS_ROWS)]
    return tiny_job(tmp, name, "ops-test", prompts,
                    sampling={"max_tokens": 4, "temperature": 0.8, "seed": 5},
                    engine={"kv_cache_memory": "64MiB", "max_num_seqs": 8}, **sections)


def start_cli(*args: str, fault: str | None = None, env: dict | None = None,
              stderr=subprocess.PIPE) -> subprocess.Popen:
    """`batchllm ARGS` in a new process (checkpoint parts every 6 rows); with `fault`, through
    faulty_cli.py with that fault injected."""
    env = dict(os.environ, BATCHLLM_CHECKPOINT_ROWS="6", PYTHONUNBUFFERED="1", **(env or {}))
    command = [BATCHLLM, *args]
    if fault is not None:
        env["BATCHLLM_TEST_FAULT"] = fault
        command = [sys.executable, FAULTY_CLI, *args]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)


def run_cli(*args: str, **kw) -> subprocess.CompletedProcess:
    proc = start_cli(*args, **kw)
    out, err = proc.communicate(timeout=600)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_in_process(*args: str) -> subprocess.CompletedProcess:
    """`batchllm ARGS` through the CLI's typer app in this process (no interpreter start, torch
    import or model load per call): the exit code, stdout and stderr as a finished process gives
    them. The tests of the console script's own exit, signals and locks between processes keep
    start_cli."""
    from typer.testing import CliRunner

    from batchllm.cli import app

    result = CliRunner(env={"BATCHLLM_CHECKPOINT_ROWS": "6"}).invoke(  # as start_cli sets it
        app, list(args), catch_exceptions=False)
    return subprocess.CompletedProcess(["batchllm", *args], result.exit_code, result.stdout,
                                       result.stderr)


@functools.cache
def ops_reference():
    """The final file of the operations job run once, uninterrupted (once per test process)."""
    import pyarrow.parquet as pq

    tmp = Path(tempfile.mkdtemp(prefix="batchllm-ops-reference-"))
    done = run_in_process("run", str(ops_job(tmp, "full")), "--quiet")
    assert done.returncode == 0, done.stderr
    return pq.read_table(tmp / "full" / "out.parquet")
