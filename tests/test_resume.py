"""A job killed with SIGKILL at several points, then resumed, gives the same final file as an
uninterrupted run; SIGTERM flushes finished rows and says how to resume."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from hf_reference import tiny_model_folder
from job_files import ops_job, ops_reference, output_row, run_cli, start_cli, tiny_job

from batchllm.config import load_job
from batchllm.job import JobCannotStart, run_job
from batchllm.resume import job_fingerprint
from batchllm.rows.reader import read_input
from batchllm.rows.writer import CheckpointWriter

pytestmark = pytest.mark.slow  # the fast lane leaves it out (README: Run the tests)

BATCHLLM = str(Path(sys.executable).parent / "batchllm")
ROWS = 96


def make_job(tmp: Path, name: str) -> Path:
    prompts = [f"Contract {i % 7}: the parties agree to terms {i % 3}. Question {i}?"
               for i in range(ROWS)]
    return tiny_job(tmp, name, "resume-test", prompts,
                    sampling={"max_tokens": 8, "temperature": 0.8, "seed": 3},
                    engine={"kv_cache_memory": "64MiB", "max_num_seqs": 4})


# The CLI with os.replace wrapped so that renaming the final file over its name kills the
# process first: a crash after the final file is written under its temporary name and before it
# becomes out.parquet, a moment too short to hit with a signal from outside.
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

# The CLI held once it has written N parts: it writes the flag file, then waits (in the main
# thread, where a signal interrupts it) to be killed: the kill lands mid-run, whatever the pace.
_HELD_AFTER_PARTS = """
import sys, time
from batchllm.rows.writer import CheckpointWriter
hold, flag = int(sys.argv.pop(1)), sys.argv.pop(1)
write, written = CheckpointWriter._write_part, []
def write_then_hold(self, rows):
    write(self, rows)
    written.append(len(rows))
    if len(written) == hold:
        open(flag, "w").close()
        while True:
            time.sleep(60)
CheckpointWriter._write_part = write_then_hold
from batchllm.cli import app
app()
"""


def start(job: Path, *args: str, kill_before: Path | None = None,
          hold_after: int | None = None) -> subprocess.Popen:
    """`batchllm run job`; with kill_before, one that SIGKILLs itself as it would rename its
    final file to `kill_before`; with hold_after, one held after that many parts (its flag:
    held(job))."""
    env = dict(os.environ, BATCHLLM_CHECKPOINT_ROWS="8", PYTHONUNBUFFERED="1")
    cli = [BATCHLLM]
    if kill_before is not None:
        cli = [sys.executable, "-c", _KILLED_BEFORE_FINAL_RENAME, str(kill_before)]
    elif hold_after is not None:
        held(job).unlink(missing_ok=True)
        cli = [sys.executable, "-c", _HELD_AFTER_PARTS, str(hold_after), str(held(job))]
    return subprocess.Popen([*cli, "run", str(job), "--quiet", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def held(job: Path) -> Path:
    return job.with_suffix(".held")


def wait_held(proc: subprocess.Popen, job: Path) -> None:
    """Until the run is held (its flag written); fails if it ends first."""
    while not held(job).exists():
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.01)


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
    """Killed from outside once 1 or 6 of the 12 parts are written (the run held there until
    the kill lands), or from inside as it would rename the final file (None)."""
    job = make_job(tmp_path, "run")
    out = tmp_path / "run" / "out.parquet"
    if kill_after_parts is None:
        proc = start(job, kill_before=out)
    else:
        proc = start(job, hold_after=kill_after_parts)
        wait_held(proc, job)
        proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == -signal.SIGKILL, f"not killed: exit {proc.returncode}\n{err}"
    assert not out.exists()
    if kill_after_parts is None:  # every row is in the parts; the final file was written
        assert rows_in_parts(out) == ROWS
        assert [p.name for p in out.parent.glob(".out.parquet.tmp-*")] != []
    else:  # killed mid-run
        assert parts(out) == kill_after_parts and rows_in_parts(out) < ROWS
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
    # what the metrics count: the whole file's rows, this process's work under run_*
    assert metrics["rows"] == ROWS and metrics["rows_error"] == 0
    assert metrics["run_rows"] == ROWS - metrics["rows_resumed"]
    in_file = pc.sum(final["completion_tokens"]).as_py()
    if kill_after_parts is None:
        assert metrics["rows_resumed"] == ROWS and metrics["run_completion_tokens"] == 0
    else:
        assert 0 < metrics["rows_resumed"] < ROWS
        assert 0 < metrics["run_completion_tokens"] < in_file
    assert metrics["run_completion_tokens"] == metrics["completion_tokens"]
    assert metrics["run_prefill_tokens"] == metrics["prefill_tokens"]


def test_sigterm_flushes_and_says_how_to_resume(tmp_path, uninterrupted):
    job = make_job(tmp_path, "term")
    out = tmp_path / "term" / "out.parquet"
    proc = start(job, hold_after=2)
    wait_held(proc, job)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "SIGTERM" in err and "output.mode=resume" in err
    assert parts(out) >= 2 and not out.exists()  # 2, and the rows finished since, flushed
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


# -- what a resume refuses -------------------------------------------------------------------------

def test_a_final_file_not_of_this_job_is_never_reported_complete(tmp_path):
    """Yesterday's final file and no checkpoint (an overwrite run killed before its first part):
    `mode: resume` with today's input refuses (exit 2) with the overwrite hint; so does a final
    file without a fingerprint. Today's own final file is complete."""
    job = ops_job(tmp_path, "run")
    out = tmp_path / "run" / "out.parquet"
    assert run_job(str(job), progress=False)["rows"] == 60
    again = run_cli("run", str(job), "--quiet", "--set", "output.mode=resume")
    assert again.returncode == 0 and f"{out} is complete" in again.stderr
    table = pq.read_table(tmp_path / "in.parquet")
    prompts = [p + " Today." for p in table["prompt"].to_pylist()]
    pq.write_table(table.set_column(1, "prompt", pa.array(prompts)), tmp_path / "in.parquet")
    stale = run_cli("run", str(job), "--quiet", "--set", "output.mode=resume")
    assert stale.returncode == 2, stale.stderr
    assert (f"output.path: {out} exists and is another job's output (differs in: files)"
            in stale.stderr and "use output.mode: overwrite" in stale.stderr)
    pq.write_table(pq.read_table(out).replace_schema_metadata({}), out)  # no fingerprint
    with pytest.raises(JobCannotStart, match="holds no fingerprint of a batchllm job"):
        run_job(str(job), ["output.mode=resume"], progress=False)


@pytest.mark.parametrize("change", ["dtype", "weights", "kernels"])
def test_a_resume_with_other_numerics_is_refused(tmp_path, change):
    """Parts of this job from a run in float32 with these weights and kernels; a resume in
    bfloat16, with a weight file changed since (its mtime), or with the C kernels switched off
    (BATCHLLM_CPU_KERNEL=0: the torch path), exits 2 naming what changed, before any weight
    loads; the parts stay where they are."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_folder("llama"), model)
    job = ops_job(tmp_path, "run", model={"path": str(model)})
    cfg = load_job(job, ["output.mode=resume"])
    writer = CheckpointWriter(cfg.output.path, job_fingerprint(cfg, read_input(cfg.input).files))
    for i, line in enumerate(ops_reference().to_pylist()[:12]):
        writer.add(output_row(i, line))
    writer.flush()
    sets = ["--set", "output.mode=resume"]
    if change == "dtype":
        sets += ["--set", "model.dtype=bfloat16"]
        what = "(dtype: 'float32' then, 'bfloat16' now"  # and the kernel path: C, then torch
    elif change == "weights":
        weights = next(model.glob("*.safetensors"))
        os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
        what = "(the model's files)"
    else:
        was = writer.fingerprint["numerics"]["kernel_path"]
        if was == "cpu-torch":
            pytest.skip("the C kernels do not build here: the parts were made on the torch path")
        what = f"(kernel_path: {was!r} then, 'cpu-torch' now)"
    env = {"BATCHLLM_CPU_KERNEL": "0"} if change == "kernels" else None
    refused = run_cli("run", str(job), "--quiet", *sets, env=env)
    assert refused.returncode == 2, refused.stderr
    line, = refused.stderr.strip().splitlines()
    assert f"was computed with other numerics {what}" in line, line
    assert "use output.mode: overwrite" in line
    assert rows_in_parts(Path(cfg.output.path)) == 12 and not Path(
        f"{cfg.output.path}.discarded").exists()
