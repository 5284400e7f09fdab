"""A disk that fills up mid-run: exit 1, one line naming the file, what is saved and how to resume,
no temporary file left; once there is room, resume gives the uninterrupted run's file. Tested on a
real tmpfs of a few hundred KB where the test may mount one (root), and with ENOSPC injected into
the writes' fsync either way."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from job_files import OPS_ROWS, ops_job, ops_reference, run_cli, run_in_process

ERROR_LINE = "batchllm: error: cannot write "


@pytest.fixture
def small_disk(tmp_path):
    """A 384 KiB tmpfs mounted at tmp_path/disk (skipped where mount is not permitted)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=384k", "tmpfs", str(disk)],
                                 check=False, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot mount a tmpfs here: {e}")
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def _fill(disk: Path, leave: int) -> Path:
    """A file that takes all but `leave` bytes of the disk."""
    st = os.statvfs(disk)
    filler = disk / "filler"
    filler.write_bytes(b"\0" * max(st.f_bavail * st.f_frsize - leave, 0))
    return filler


def _check_stopped(proc: subprocess.CompletedProcess, out: Path, job: Path) -> None:
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    line, = [x for x in proc.stderr.splitlines() if x.startswith("batchllm: error")]
    parts = Path(f"{out}.parts")
    assert line.startswith((ERROR_LINE + str(parts), ERROR_LINE + str(out)))
    assert "No space left on device" in line
    assert f"finished rows are saved in {parts}" in line
    assert line.endswith(f"resume with: batchllm run {job} --set output.mode=resume")
    folder = out.parent
    assert [p.name for p in folder.rglob("*.tmp")] == []  # no temporary file left behind
    assert not out.exists()
    names = sorted(parts.glob("part-*.parquet"))
    saved = sum(pq.read_table(p).num_rows for p in names)  # every part left is whole
    assert 0 < saved < OPS_ROWS and f"the {saved} finished rows" in line


def _resume_gives_the_uninterrupted_file(job: Path, out: Path) -> None:
    resumed = run_in_process("run", str(job), "--quiet", "--set", "output.mode=resume")
    assert resumed.returncode == 0, resumed.stderr
    final = pq.read_table(out)
    reference = ops_reference()
    assert final.equals(reference)  # completions byte for byte, ids, counts, order
    assert final.schema.metadata == reference.schema.metadata


@pytest.mark.slow
def test_full_tmpfs_stops_with_one_line_and_resume_completes(tmp_path, small_disk):
    out_dir = small_disk / f"job-{uuid.uuid4().hex[:6]}"
    job = ops_job(tmp_path, "run", output={"path": str(out_dir / "out.parquet")})
    out = out_dir / "out.parquet"
    filler = _fill(small_disk, leave=12 * 4096)  # room for a few parts, not for the whole job
    proc = run_cli("run", str(job), "--quiet")
    _check_stopped(proc, out, job)
    filler.unlink()  # free the space, then resume
    _resume_gives_the_uninterrupted_file(job, out)


@pytest.mark.slow
def test_injected_enospc_stops_with_one_line_and_resume_completes(tmp_path):
    job = ops_job(tmp_path, "run")
    out = tmp_path / "run" / "out.parquet"
    proc = run_cli("run", str(job), "--quiet", fault="enospc:3")  # the 4th part fails
    _check_stopped(proc, out, job)
    assert len(list(Path(f"{out}.parts").glob("part-*.parquet"))) == 3
    _resume_gives_the_uninterrupted_file(job, out)


@pytest.mark.parametrize("mode", ["error", "overwrite", "resume"])
def test_an_output_path_that_is_a_folder_is_refused_before_the_run(tmp_path, mode, monkeypatch):
    """Exit 2 naming output.path, whatever the mode, before the model loads (the run went to
    the end and then failed to write, exit 1, with advice to resume that could not help)."""
    job = ops_job(tmp_path, "folder")
    out = tmp_path / "folder" / "out.parquet"
    out.mkdir(parents=True)
    from batchllm.engine import runtime

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(runtime.Runtime, "build", no_model)
    done = run_in_process("run", str(job), "--quiet", "--set", f"output.mode={mode}")
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().endswith(f"output.path: {out} is a folder; give the path of the "
                                        f"file to write")
    assert out.is_dir() and not any(out.iterdir())
