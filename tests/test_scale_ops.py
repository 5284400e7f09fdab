"""Operating a sharded job: the local Ray instance a job starts listens on loopback only, in a
private folder; what counts as a worker's death (an out-of-memory kill like a crash). (The
stalled worker and SIGTERM tests are in test_scale.py, beside its fixtures.)"""

from __future__ import annotations

import glob
import ipaddress
import os
import platform
import tempfile

import pytest
from test_scale import make_job

from batchllm.config import load_job
from batchllm.scale.cluster import ray_session
from batchllm.scale.pool import crashes

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")



def _loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%")[0])
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def _listening(root: psutil.Process) -> list[tuple[str, str, int]]:
    """(process name, address, port) of every listening socket of `root` and its descendants."""
    out = []
    for proc in [root, *root.children(recursive=True)]:
        try:
            for c in proc.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    out.append((proc.name(), c.laddr.ip, c.laddr.port))
        except psutil.Error:
            continue  # ended meanwhile
    return out


@pytest.mark.slow
def test_a_local_instance_listens_on_loopback_only_in_a_private_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    if ray.is_initialized():
        ray.shutdown()
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "batchllm-ray-*")))
    cfg = load_job(make_job(tmp_path, "lo", workers=2))
    with ray_session(cfg):
        ray.get(ray.remote(platform.python_version).remote())  # a worker listens too
        sockets = _listening(psutil.Process())
        folder, = set(glob.glob(os.path.join(tempfile.gettempdir(), "batchllm-ray-*"))) - before
        assert oct(os.stat(folder).st_mode & 0o777) == oct(0o700)
        assert glob.glob(os.path.join(folder, "*", "session_*"))  # Ray's session files in it
    assert not ray.is_initialized()
    names = {name for name, _, _ in sockets}
    assert {"gcs_server", "raylet"} <= names, sockets
    assert [s for s in sockets if not _loopback(s[1])] == []
    assert not os.path.exists(folder)  # removed with the instance
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in os.environ  # the switch restored


def test_an_out_of_memory_kill_is_retried_like_a_crash():
    """The errors a dead worker raises to the driver, each replaced with its rows: a crash, a
    kill (the kernel's OOM killer: SIGKILL, test_scale's kill test), Ray's own out-of-memory
    kill, a lost node; an exception in our code is not retried (it would fail again)."""
    retried = crashes()
    for error in (ray.exceptions.ActorDiedError(), ray.exceptions.OutOfMemoryError("oom"),
                  ray.exceptions.WorkerCrashedError(), ray.exceptions.NodeDiedError("n")):
        assert isinstance(error, retried), error
    assert not isinstance(ray.exceptions.RayTaskError("f", "tb", ValueError("x")), retried)
