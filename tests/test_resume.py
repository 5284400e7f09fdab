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
from job_files import ops_job, ops_reference, output_row, start_cli, tiny_job

from batchllm.config import load_job
from batchllm.resume import job_fingerprint
from batchllm.rows.reader import read_input
from batchllm.rows.writer import CheckpointWriter

BATCHLLM = str(Path(sys.executable).parent / "batchllm")
ROWS = 96


def make_job(tmp: Path, name: str) -> Path:
    prompts = [f"Contract {i % 7}: the parties agree to terms {i % 3}. Question {i}?"
               for i in range(ROWS)]
    return tiny_job(tmp, name, "resume-test", prompts,
                    sampling={"max_tokens": 8, "temperature": 0.8, "seed": 3},
                    engine={"kv_cache_memory": "64MiB", "max_num_seqs": 4})


# The CLI with os.replace wrapped so that renaming the final file over its name kills the
# process first: a crash after out.parquet.tmp is written and before it becomes out.parquet, a
# moment too short to hit with a signal from outside.
_KILLED_BEFORE_FINAL_RENAME = """
import os, signal, sys
final, replace = os.path.abspath(sys.argv.pop(1)), os.replace
def replace_unless_final(src, dst, *args, **kwargs):
    if os.path.abspath(dst) == final:
        os.kill(os.getpid(), signal.SIGKILL)
    return replace(src, dst, *args, **kwargs)
os.replace = replace_unless_final
from batchllm.cli import app
app()
"""


def start(job: Path, *args: str, kill_before: Path | None = None) -> subprocess.Popen:
    """`batchllm run job`; with kill_before, one that SIGKILLs itself as it would rename its
    final file to `kill_before`."""
    env = dict(os.environ, BATCHLLM_CHECKPOINT_ROWS="8", PYTHONUNBUFFERED="1")
    cli = [BATCHLLM] if kill_before is None else [
        sys.executable, "-c", _KILLED_BEFORE_FINAL_RENAME, str(kill_before)]
    return subprocess.Popen([*cli, "run", str(job), "--quiet", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def part_files(out: Path) -> list[Path]:
    return sorted(Path(str(out) + ".parts").glob("part-*.parquet"))


def parts(out: Path) -> int:
    return len(part_files(out))


def rows_in_parts(out: Path) -> int:
    return sum(pq.read_metadata(p).num_rows for p in part_files(out))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> pa.Table:
    tmp = tmp_path_factory.mktemp("full")
    proc = start(make_job(tmp, "full"))
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    return pq.read_table(tmp / "full" / "out.parquet")


@pytest.mark.parametrize("kill_after_parts", [1, 6, None])
def test_sigkill_then_resume_gives_the_same_file(tmp_path, uninterrupted, kill_after_parts):
    """Killed from outside once 1 or 6 of the 12 parts are written (the rest of the run, about 1 s
    idle after part 6, leaves the kill ample time to land mid-run), or from inside as it would
    rename the final file (None)."""
    job = make_job(tmp_path, "run")
    out = tmp_path / "run" / "out.parquet"
    if kill_after_parts is None:
        proc = start(job, kill_before=out)
    else:
        proc = start(job)
        while proc.poll() is None and parts(out) < kill_after_parts:
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == -signal.SIGKILL, f"not killed: exit {proc.returncode}\n{err}"
    assert not out.exists()
    if kill_after_parts is None:  # every row is in the parts; the final file was written
        assert rows_in_parts(out) == ROWS and Path(str(out) + ".tmp").is_file()
    else:  # killed mid-run
        assert parts(out) >= kill_after_parts and rows_in_parts(out) < ROWS
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
    metrics = json.loads(Path(str(out) + ".metrics.json").read_text())
    assert metrics["rows"] == ROWS
    if kill_after_parts is None:
        assert metrics["rows_resumed"] == ROWS
    else:
        assert 0 < metrics["rows_resumed"] < ROWS


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


def test_bad_parts_are_moved_aside_named_and_counted(tmp_path):
    """A truncated part and a part of another job among good parts: both moved aside (not
    deleted) and named in a warning, parts_discarded = 2, their rows run again."""
    job = ops_job(tmp_path, "run")
    out = tmp_path / "run" / "out.parquet"
    cfg = load_job(job)
    ours = job_fingerprint(cfg, read_input(cfg.input).files)
    lines = ops_reference().to_pylist()

    def write_part(fp: dict, rows: range) -> Path:
        w = CheckpointWriter(out, fp, flush_rows=10**9)
        for i in rows:
            w.add(output_row(i, lines[i]))
        w.flush()
        return Path(w.parts_dir) / max(os.listdir(w.parts_dir))

    write_part(ours, range(15))
    write_part(ours, range(15, 30))
    torn = write_part(ours, range(30, 36))
    torn.write_bytes(torn.read_bytes()[: torn.stat().st_size // 2])  # truncated, as by a crash
    other = write_part({**ours, "sampling": {**ours["sampling"], "seed": 99}}, range(36, 42))
    proc = start_cli("run", str(job), "--quiet", "--set", "output.mode=resume")
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    warnings = [line for line in err.splitlines() if line.startswith("batchllm: warning")]
    assert len(warnings) == 2
    assert f"{torn} cannot be read" in warnings[0]
    assert f"{other} was written by another job (differs in: sampling)" in warnings[1]
    moved = sorted(Path(f"{out}.discarded").iterdir())
    assert [p.name.split(".")[0] for p in moved] == [torn.stem, other.stem]
    assert all(f"moved to {p}" in "".join(warnings) for p in moved)
    metrics = json.loads(Path(f"{out}.metrics.json").read_text())
    assert metrics["parts_discarded"] == 2 and metrics["rows_resumed"] == 30
    assert pq.read_table(out).equals(ops_reference())
