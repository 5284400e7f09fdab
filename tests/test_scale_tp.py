"""Ray workers as groups of devices: engine.workers 2 x engine.tensor_parallel 2, each worker one
actor in a placement group of 2 ranks' resources (here half a CPU each, gloo), its rank 1
spawned by it. The final file equals one process with tensor_parallel 1 (greedy), also when a
worker's actor is killed mid-run and restarted in its group; a group that fits no node is
refused before any worker starts."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from job_files import tiny_job

from batchllm.config import load_job
from batchllm.job import run_job
from batchllm.scale.cluster import actor_name

pytestmark = pytest.mark.slow  # Ray and four processes (the fast lane leaves it out)
ray = pytest.importorskip("ray")

ROWS = 24
PROMPTS = [f"Lease {i % 4}: the tenant pays rent on day {i % 9}. Question {i}?"
           for i in range(ROWS)]
COLUMNS = ["id", "completion", "finish_reason", "prompt_tokens", "completion_tokens"]


def make_job(tmp: Path, name: str, workers: int, tensor_parallel: int) -> Path:
    return tiny_job(tmp, name, f"scale-tp-{name}", PROMPTS, sampling={"max_tokens": 8},
                    engine={"kv_cache_memory": "32MiB", "max_num_seqs": 4, "workers": workers,
                            "tensor_parallel": tensor_parallel})


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("single")
    run_job(make_job(tmp, "one", workers=1, tensor_parallel=1), progress=False)
    return pq.read_table(tmp / "one" / "out.parquet").select(COLUMNS)


def test_two_workers_of_two_ranks_equal_one_process(tmp_path, single, local_ray):
    job = make_job(tmp_path, "groups", workers=2, tensor_parallel=2)
    metrics = run_job(str(job), progress=False)
    assert pq.read_table(tmp_path / "groups" / "out.parquet").select(COLUMNS).equals(single)
    assert len(metrics["per_worker"]) == 2 and all(w["rows"] > 0 for w in metrics["per_worker"])
    assert ray.util.placement_group_table() == {} or all(
        g["state"] == "REMOVED" for g in ray.util.placement_group_table().values())


def test_a_killed_group_restarts_in_its_devices(tmp_path, single, local_ray, monkeypatch):
    """Worker 1's actor (rank 0 of its group) SIGKILLed once it has written a part: its rank 1
    exits with it, a new actor starts in the same placement group, the file is the same."""
    monkeypatch.setenv("BATCHLLM_CHECKPOINT_ROWS", "2")
    job = make_job(tmp_path, "kill", workers=2, tensor_parallel=2)
    out = tmp_path / "kill" / "out.parquet"
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(run_job(str(job), progress=False)))
    thread.start()
    while not list(Path(f"{out}.parts").glob("part-*-w1.parquet")):
        assert thread.is_alive(), "the job ended before worker 1 wrote a part"
        time.sleep(0.01)
    victim = ray.get_actor(actor_name(load_job(str(job)), 1))
    os.kill(ray.get(victim.pid.remote()), signal.SIGKILL)
    thread.join(timeout=600)
    assert result, "the job did not finish"
    assert result["worker_restarts"] == 1
    assert pq.read_table(out).select(COLUMNS).equals(single)


def test_a_group_that_fits_no_node_is_refused(tmp_path, local_ray):
    job = make_job(tmp_path, "wide", workers=2, tensor_parallel=16)
    with pytest.raises(RuntimeError, match=r"engine.tensor_parallel: 16: a worker needs 8 CPUs "
                                           r"\(half a CPU per rank\) on one node; the cluster's "
                                           r"largest node has 4"):
        run_job(str(job), progress=False)
    assert not (tmp_path / "wide" / "out.parquet").exists()
