"""One run per output: the lock beside the output, held by real processes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from job_files import ops_job, start_cli

from batchllm.rows.lock import OutputLock, OutputLocked, lock_path

HOLD = """
import sys, time
from batchllm.rows.lock import OutputLock
lock = OutputLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(600)
"""


def _holder(output: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(output)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline() == "held\n"
    return proc


def test_lock_names_its_holder_and_dies_with_it(tmp_path):
    out = tmp_path / "out.parquet"
    holder = _holder(out)
    try:
        with pytest.raises(OutputLocked) as e:
            OutputLock(str(out)).acquire()
        assert e.value.holder.pid == holder.pid and e.value.holder.host == socket.gethostname()
        assert f"pid {holder.pid} on {socket.gethostname()}, started " in str(e.value)
        assert json.loads(Path(f"{out}.lock").read_text())["pid"] == holder.pid
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # the kernel released it with the process: no stale lock to clean
    lock = OutputLock(str(out)).acquire()
    assert json.loads(Path(f"{out}.lock").read_text())["pid"] == os.getpid()
    lock.release()
    assert not Path(f"{out}.lock").exists()
    with OutputLock(str(out)):  # again after a clean release
        assert Path(f"{out}.lock").exists()


def test_object_storage_output_locks_a_local_file(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHLLM_CACHE", str(tmp_path / "cache"))
    lock = OutputLock("s3://bucket/out/result.parquet")
    assert lock.local_only and lock.path == lock_path("s3://bucket/out/result.parquet")
    assert lock.path.startswith(str(tmp_path / "cache" / "locks"))
    with lock, pytest.raises(OutputLocked):
        OutputLock("s3://bucket/out/result.parquet").acquire()
    assert not OutputLock("/local/out.parquet").local_only


def _wait_for_lock(out: Path, procs: list[subprocess.Popen]) -> subprocess.Popen:
    """The one of `procs` whose pid the output's lock file names, once one of them holds it."""
    for _ in range(2400):
        try:
            pid = json.loads(Path(f"{out}.lock").read_text())["pid"]
        except (OSError, ValueError, KeyError):
            pid = None
        for p in procs:
            if p.pid == pid:
                return p
        assert any(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.05)
    raise AssertionError("no run took the lock")


@pytest.mark.slow  # two commands in processes of their own
def test_two_runs_of_one_output_one_runs_the_other_exits_2(tmp_path):
    job = ops_job(tmp_path, "run")
    out = tmp_path / "run" / "out.parquet"
    # Python's own import log on stderr (into files: a pipe would fill): the loser must be
    # refused before it imports torch
    logs = [(tmp_path / f"stderr-{i}").open("w+") for i in range(2)]
    runs = [start_cli("run", str(job), "--quiet", "--set", "output.mode=resume",
                      env={"PYTHONPROFILEIMPORTTIME": "1"}, stderr=log) for log in logs]
    winner = _wait_for_lock(out, runs)
    loser = next(p for p in runs if p is not winner)
    loser.communicate(timeout=120)
    err = Path(logs[runs.index(loser)].name).read_text()
    for log in logs:  # the children keep their own descriptors
        log.close()
    assert loser.returncode == 2, err
    assert winner.poll() is None  # exactly one runs
    imports = [s.rsplit("|", 1)[-1].strip() for s in err.splitlines()
               if s.startswith("import time:")]
    assert "batchllm.rows.lock" in imports  # the log is there: the lock's module was imported
    assert not [m for m in imports if m == "torch" or m.startswith("torch.")]
    line, = [s for s in err.strip().splitlines() if not s.startswith("import time:")]
    assert line.startswith(f"batchllm: error: output.path: another run is writing {out} "
                           f"(pid {winner.pid} on {socket.gethostname()}, started ")
    assert f"flock {out}.lock true" in line and f"kill {winner.pid}" in line
    assert "--set output.mode=resume" in line
    # kill -9 the holder: the next run starts at once (no stale lock) and finishes the job
    winner.send_signal(signal.SIGKILL)
    winner.wait()
    after = start_cli("run", str(job), "--quiet", "--set", "output.mode=resume")
    assert _wait_for_lock(out, [after]) is after
    _, err = after.communicate(timeout=600)
    assert after.returncode == 0, err
    assert not Path(f"{out}.lock").exists()
