"""Scale-out on a local Ray instance with 2 CPU workers and a tiny model: the sharded output
equals the single-process output row for row; each worker's measured prefill equals its shard's
prediction; no row runs twice; a worker killed mid-shard is restarted with its unflushed rows, a
stalled one replaced (engine.worker_timeout); SIGTERM has every worker flush and prints the
resume command."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hf_reference import tiny_model_folder
from job_files import output_row, tiny_job

from batchllm.config import ConfigError, load_job
from batchllm.job import run_job
from batchllm.model.tokenizer import load_tokenizer
from batchllm.plan_report import plan_job
from batchllm.resume import job_fingerprint
from batchllm.rows.reader import read_input
from batchllm.rows.writer import CheckpointWriter
from batchllm.scale.assign import partitioned
from batchllm.scale.cluster import actor_name

pytestmark = pytest.mark.slow  # the fast lane leaves it out (README: Run the tests)

ray = pytest.importorskip("ray")

BATCHLLM = str(Path(sys.executable).parent / "batchllm")
HELD_WORKERS = Path(__file__).with_name("held_workers")  # its sitecustomize holds the workers

ROWS = 64
PROMPTS = [f"Contract {i % 5}: the parties agree to clause {i % 3}. Question {i}?"
           for i in range(ROWS)]


def make_job(tmp: Path, name: str, workers: int) -> Path:
    return tiny_job(tmp, name, f"scale-{name}", PROMPTS,
                    sampling={"max_tokens": 12, "temperature": 0.8, "seed": 5},
                    engine={"kv_cache_memory": "64MiB", "max_num_seqs": 8, "workers": workers})


@pytest.fixture(scope="module")
def single_run(tmp_path_factory) -> tuple[pa.Table, dict]:
    tmp = tmp_path_factory.mktemp("single")
    metrics = run_job(make_job(tmp, "one", workers=1), progress=False)
    return pq.read_table(tmp / "one" / "out.parquet"), metrics


@pytest.fixture(scope="module")
def single(single_run) -> pa.Table:
    return single_run[0]


def split_input(tmp: Path, files: int = 3, bad_column: bool = False) -> Path:
    """The job's input rows as `files` Parquet files in a folder (one block each); bad_column:
    the second file's max_tokens column holds strings."""
    table = pq.read_table(tmp / "in.parquet")
    folder = tmp / "in_parts"
    folder.mkdir()
    size = -(-table.num_rows // files)
    for f in range(files):
        piece = table.slice(f * size, size)
        if bad_column and f == 1:
            piece = piece.append_column("max_tokens", pa.array(["7"] * piece.num_rows))
        pq.write_table(piece, folder / f"part-{f}.parquet")
    return folder


def check_workers(metrics: dict) -> None:
    """Per worker: measured prefill == predicted; flushed rows of a dead attempt not run again."""
    per = metrics["per_worker"]
    assert len(per) == 2 and all(w["rows"] > 0 for w in per)
    for w in per:
        assert w["prefill_tokens"] == w["predicted_prefill_tokens"], w
    # every row ran exactly once in a finished attempt, or was flushed by one that died
    assert sum(w["rows"] for w in per) + metrics["rows_recovered"] == ROWS
    assert metrics["prefill_tokens"] == sum(w["prefill_tokens"] for w in per)


def shared_by_one_contract() -> int:
    """The tokens both workers compute when two shards are cut from PROMPTS.

    The 5 contracts (rows with equal i % 5) hold 13, 13, 13, 13 and 12 rows of about equal cost,
    so no cut between whole contracts (26 or 39 rows) lies within the 10% tolerance of half the
    cost (32 rows); a cut between two clauses of one contract does (26 + 4 = 30 rows), and among
    those cuts both sharding modes take one that separates the fewest shared tokens: the prefix
    that all rows of one contract share (the chat template's system turn, then "Contract k: the
    parties agree to clause "). It is computed on both workers."""
    tokenizer = load_tokenizer(tiny_model_folder("llama"))
    chats = [[{"role": "user", "content": p}] for i, p in enumerate(PROMPTS) if i % 5 == 0]
    texts = tokenizer.apply_chat_template(chats, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    shared = 0
    while len({tuple(row[: shared + 1]) for row in ids}) == 1:
        shared += 1
    return shared


@pytest.mark.parametrize("sharding", ["tree", "partition"])
def test_plan_shows_shards_without_running(tmp_path, sharding):
    report = plan_job(str(make_job(tmp_path, "plan", workers=2)),
                      [f"engine.sharding={sharding}"])
    assert report["workers"] == 2 and report["sharding"].startswith(sharding)
    rows = [int(report[f"shard {k}"].split()[0].removeprefix("rows=")) for k in (0, 1)]
    assert sum(rows) == ROWS and min(rows) > 0
    assert report["duplicated_prefix_tokens"] == shared_by_one_contract()
    assert (report["predicted_prefill_tokens_all_workers"]
            == report["tree_tokens"] + report["duplicated_prefix_tokens"])


def test_two_workers_equal_one_process(tmp_path, single, local_ray):
    job = make_job(tmp_path, "two", workers=2)
    metrics = run_job(job, progress=False)
    out = tmp_path / "two" / "out.parquet"
    assert pq.read_table(out).equals(single)
    assert not Path(str(out) + ".parts").exists()
    assert metrics["workers"] == 2 and metrics["worker_restarts"] == 0
    assert metrics["rows_recovered"] == 0
    check_workers(metrics)
    # no shared prefix split badly: the workers together prefill the tree plus the duplicates
    assert (metrics["prefill_tokens"]
            == metrics["tree_tokens"] + metrics["predicted_duplicated_prefix_tokens"])
    written = json.loads(Path(str(out) + ".metrics.json").read_text())
    assert written["per_worker"] == metrics["per_worker"]


def test_partitioned_two_workers_equal_one_process(tmp_path, single_run, local_ray):
    """engine.sharding: partition: tasks tokenize 3 blocks and range-partition the rows; each
    worker plans its part. Same output; the parts' trees minus the tokens cut apart are the
    single process's tree."""
    table, one = single_run
    job = make_job(tmp_path, "part", workers=2)
    folder = split_input(tmp_path)
    metrics = run_job(str(job), [f"input.path={folder}", "engine.sharding=partition"],
                      progress=False)
    assert pq.read_table(tmp_path / "part" / "out.parquet").equals(table)
    assert metrics["shards"]["sharding"] == "partition" and metrics["shards"]["blocks"] == 3
    assert metrics["shards"]["shard_rows"] == [w["rows"] for w in metrics["per_worker"]]
    check_workers(metrics)
    assert metrics["tree_tokens"] == one["tree_tokens"]
    assert (metrics["prefill_tokens"]
            == metrics["tree_tokens"] + metrics["predicted_duplicated_prefix_tokens"])


def test_partition_reports_a_bad_column_of_one_block(tmp_path, local_ray):
    job = make_job(tmp_path, "badcol", workers=2)
    folder = split_input(tmp_path, bad_column=True)
    with pytest.raises(ConfigError, match="max_tokens.*type string"):
        run_job(str(job), [f"input.path={folder}", "engine.sharding=partition"], progress=False)


def test_auto_sharding_partitions_above_the_driver_limit(tmp_path, monkeypatch):
    cfg = load_job(str(make_job(tmp_path, "auto", workers=2)))
    assert not partitioned(cfg)
    monkeypatch.setattr("batchllm.scale.assign.DRIVER_PLAN_ROWS", ROWS - 1)
    assert partitioned(cfg)
    assert not partitioned(load_job(str(tmp_path / "auto.yaml"), ["engine.sharding=tree"]))


@pytest.mark.parametrize("sharding", ["tree", "partition"])
def test_killed_worker_is_restarted_with_its_unflushed_rows(tmp_path, single, local_ray,
                                                             monkeypatch, sharding):
    monkeypatch.setenv("BATCHLLM_CHECKPOINT_ROWS", "2")
    job = make_job(tmp_path, "kill", workers=2)
    out = tmp_path / "kill" / "out.parquet"
    parts = Path(str(out) + ".parts")
    result: dict = {}
    sets = [f"engine.sharding={sharding}"]
    thread = threading.Thread(target=lambda: result.update(run_job(str(job), sets,
                                                                   progress=False)))
    thread.start()
    deadline = time.monotonic() + 120
    while not list(parts.glob("part-*-w1.parquet")) and time.monotonic() < deadline:
        time.sleep(0.01)
    victim = ray.get_actor(actor_name(load_job(str(job), sets), 1))
    os.kill(ray.get(victim.pid.remote()), signal.SIGKILL)
    thread.join(timeout=300)
    assert result, "the job did not finish"
    assert pq.read_table(out).equals(single)
    assert result["worker_restarts"] == 1
    dead = result["per_worker"][1]
    assert dead["restarts"] == 1 and 0 < dead["rows_recovered"]
    check_workers(result)


def test_resume_runs_only_rows_not_in_parts(tmp_path, single, local_ray):
    """The parts of an earlier, killed run (here: the first rows of the single-process output)
    are kept; the workers run the other rows only, and the final file is the same."""
    job = make_job(tmp_path, "resume", workers=2)
    cfg = load_job(str(job), ["output.mode=resume"])
    done = list(range(0, ROWS, 3))
    writer = CheckpointWriter(cfg.output.path,
                              job_fingerprint(cfg, read_input(cfg.input).files))
    for i in done:
        writer.add(output_row(i, single.slice(i, 1).to_pylist()[0]))
    writer.flush()
    metrics = run_job(cfg, progress=False)
    assert pq.read_table(cfg.output.path).equals(single)
    assert metrics["rows_resumed"] == len(done)
    assert sum(w["rows"] for w in metrics["per_worker"]) == ROWS - len(done)
    # the file's rows, and this process's work under run_* (issue 27 item 6), as run locally
    assert metrics["rows"] == ROWS and metrics["run_rows"] == ROWS - len(done)
    assert metrics["run_completion_tokens"] == metrics["completion_tokens"] > 0
    for w in metrics["per_worker"]:
        assert w["prefill_tokens"] == w["predicted_prefill_tokens"], w


def test_a_stalled_worker_is_replaced_and_its_rows_rerun(tmp_path, single, local_ray,
                                                         monkeypatch):
    """Worker 1 stopped (SIGSTOP) once it has flushed a part: with engine.worker_timeout 8 s it
    is killed and replaced; the job finishes with the single process's file."""
    monkeypatch.setenv("BATCHLLM_CHECKPOINT_ROWS", "2")
    job = make_job(tmp_path, "stall", workers=2)
    out = tmp_path / "stall" / "out.parquet"
    sets = ["engine.worker_timeout=8"]
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(run_job(str(job), sets,
                                                                   progress=False)))
    thread.start()
    while not list(Path(f"{out}.parts").glob("part-*-w1.parquet")):
        assert thread.is_alive(), "the job ended before worker 1 wrote a part"
        time.sleep(0.01)
    victim = ray.get(ray.get_actor(actor_name(load_job(str(job), sets), 1)).pid.remote())
    os.kill(victim, signal.SIGSTOP)
    try:
        thread.join(timeout=600)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
    assert result, "the job did not finish"
    assert pq.read_table(out).equals(single)
    assert result["worker_timeouts"] == 1 and result["worker_restarts"] == 1
    assert result["per_worker"][1]["timeouts"] == 1
    assert sum(w["rows"] for w in result["per_worker"]) + result["rows_recovered"] == ROWS


def test_sigterm_flushes_every_worker_and_says_how_to_resume(tmp_path, single):
    """`batchllm run` of two workers (its own Ray on loopback); each worker held with one row
    finished after its first part of two: SIGTERM to the driver has both flush that row,
    exits 1 with the resume command; the resumed run gives the single process's file."""
    job = make_job(tmp_path, "term", workers=2)
    out = tmp_path / "term" / "out.parquet"
    flags = tmp_path / "held"
    flags.mkdir()
    env = dict(os.environ, BATCHLLM_CHECKPOINT_ROWS="2", RAY_AUTH_MODE="disabled",
               BATCHLLM_TEST_HOLD=str(flags),
               PYTHONPATH=os.pathsep.join([str(HELD_WORKERS), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([BATCHLLM, "run", str(job), "--quiet"], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    while len(list(flags.iterdir())) < 2:  # both workers held
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err
    assert "SIGTERM" in err and "--set output.mode=resume" in err
    parts = sorted(Path(f"{out}.parts").glob("part-*.parquet"))
    assert sum(pq.read_metadata(p).num_rows for p in parts) == 2 * 3  # 2 flushed + 1 each
    assert not out.exists()
    resumed = subprocess.run([BATCHLLM, "run", str(job), "--quiet", "--set",
                              "output.mode=resume"], env={**env, "BATCHLLM_TEST_HOLD": ""},
                             capture_output=True, text=True, timeout=600, check=False)
    assert resumed.returncode == 0, resumed.stderr
    assert pq.read_table(out).equals(single)
