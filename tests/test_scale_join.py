"""engine.ray_address joins a running Ray cluster (here a head node started with `ray start` in
its own process group, 4 logical CPUs, authentication off as for any local test instance): the
job's workers run there and the output equals the single-process output. Without an address a
job starts its own local instance even while that cluster runs."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from test_scale import make_job

from batchllm.job import run_job

pytestmark = pytest.mark.slow  # the fast lane leaves it out (README: Run the tests)

ray = pytest.importorskip("ray")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def head_node(monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    if ray.is_initialized():
        ray.shutdown()
    port = free_port()
    cli = str(Path(sys.executable).with_name("ray"))
    head = subprocess.Popen(
        [cli, "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1",
         "--num-cpus=4", "--include-dashboard=false", "--disable-usage-stats", "--block"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.5)
    else:
        os.killpg(head.pid, signal.SIGKILL)
        pytest.fail("the Ray head node did not start")
    yield f"127.0.0.1:{port}"
    os.killpg(head.pid, signal.SIGTERM)
    try:
        head.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(head.pid, signal.SIGKILL)


def test_job_joins_a_running_cluster(tmp_path, head_node):
    run_job(make_job(tmp_path, "one", workers=1), progress=False)
    metrics = run_job(str(make_job(tmp_path, "joined", workers=2)),
                      [f"engine.ray_address={head_node}"], progress=False)
    assert pq.read_table(tmp_path / "joined" / "out.parquet").equals(
        pq.read_table(tmp_path / "one" / "out.parquet"))
    assert metrics["workers"] == 2 and all(w["rows"] > 0 for w in metrics["per_worker"])
    assert not ray.is_initialized()  # the driver left the cluster; the cluster stays up


def test_no_address_starts_a_local_instance_beside_a_running_cluster(tmp_path, head_node):
    """ray.init() alone would join the cluster `ray start` recorded, and refuse num_cpus."""
    run_job(make_job(tmp_path, "one", workers=1), progress=False)
    metrics = run_job(str(make_job(tmp_path, "local", workers=2)), progress=False)
    assert pq.read_table(tmp_path / "local" / "out.parquet").equals(
        pq.read_table(tmp_path / "one" / "out.parquet"))
    assert metrics["workers"] == 2 and not ray.is_initialized()
