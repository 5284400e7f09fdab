"""A job killed with SIGKILL at several points, then resumed, gives the same final file as an
uninterrupted run; SIGTERM flushes finished rows and says how to resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from job_files import tiny_job

BATCHLLM = str(Path(sys.executable).parent / "batchllm")
ROWS = 96


def make_job(tmp: Path, name: str) -> Path:
    prompts = [f"Contract {i % 7}: the parties agree to terms {i % 3}. Question {i}?"
               for i in range(ROWS)]
    return tiny_job(tmp, name, "resume-test", prompts,
                    sampling={"max_tokens": 8, "temperature": 0.8, "seed": 3},
                    engine={"kv_cache_memory": "64MiB", "max_num_seqs": 4})


def start(job: Path, *args: str) -> subprocess.Popen:
    env = dict(os.environ, BATCHLLM_CHECKPOINT_ROWS="8", PYTHONUNBUFFERED="1")
    return subprocess.Popen([BATCHLLM, "run", str(job), "--quiet", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def parts(out: Path) -> int:
    folder = Path(str(out) + ".parts")
    return len(list(folder.glob("part-*.parquet"))) if folder.exists() else 0


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> pa.Table:
    tmp = tmp_path_factory.mktemp("full")
    proc = start(make_job(tmp, "full"))
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    return pq.read_table(tmp / "full" / "out.parquet")


@pytest.mark.parametrize("kill_after_parts", [1, 6, None])
def test_sigkill_then_resume_gives_the_same_file(tmp_path, uninterrupted, kill_after_parts):
    job = make_job(tmp_path, "run")
    out = tmp_path / "run" / "out.parquet"
    proc = start(job)
    # None: kill as soon as the final file is being written (or after, if it was quick)
    while proc.poll() is None:
        if kill_after_parts is not None and parts(out) >= kill_after_parts:
            break
        if kill_after_parts is None and Path(str(out) + ".tmp").exists():
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    if kill_after_parts is not None:
        assert not out.exists()
        assert parts(out) >= kill_after_parts
    again = start(job)
    _, err = again.communicate(timeout=600)
    assert again.returncode == 2 and "exists" in err  # mode error refuses the leftovers
    resumed = start(job, "--set", "output.mode=resume")
    _, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err
    final = pq.read_table(out)
    assert final.equals(uninterrupted)
    assert final.schema.metadata == uninterrupted.schema.metadata
    assert not Path(str(out) + ".parts").exists()
    if kill_after_parts is not None:
        metrics = json.loads(Path(str(out) + ".metrics.json").read_text())
        assert 0 < metrics["rows_resumed"] < ROWS
        assert metrics["rows"] == ROWS


def test_sigterm_flushes_and_says_how_to_resume(tmp_path, uninterrupted):
    job = make_job(tmp_path, "term")
    out = tmp_path / "term" / "out.parquet"
    proc = start(job)
    while proc.poll() is None and parts(out) < 2:
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "SIGTERM" in err and "output.mode=resume" in err
    assert parts(out) >= 2 and not out.exists()
    resumed = start(job, "--set", "output.mode=resume")
    _, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err
    assert pq.read_table(out).equals(uninterrupted)
