"""The Ray side of a sharded job: joining or starting Ray, and creating worker actors.

Without engine.ray_address a job starts its own Ray instance on this machine, reachable from this
machine only: every Ray process listens on 127.0.0.1 (Ray's gRPC servers have no authentication
of their own), and its session files (sockets, logs, spilled objects) live in a new private
folder (0700) that goes away with the instance. engine.ray_address joins the cluster it names,
as that cluster is set up. Only this module, `driver`, `worker` and `shuffle` import ray, and
only when a job has engine.workers > 1.

With engine.tensor_parallel: N a worker is a group of N devices of one node: a placement group
of one bundle ({GPU: N}, or N half CPUs on a CPU-only cluster) reserved for the worker, its
actor placed in it with the whole bundle, so that the N devices are the actor's visible ones;
the actor spawns its ranks 1..N-1 as on one machine (engine/tensor_parallel.py: NCCL or gloo
over the node's loopback). Not a bundle per rank: Ray shows an actor only its own bundle's
devices, and the ranks are the actor's processes, not Ray's. The group is kept across the
worker's restarts (the replacement starts on the same devices at once) and removed when the
worker finishes or the job ends. A job whose group fits no node fails before any worker starts.
"""

from __future__ import annotations

import contextlib
import importlib.util
import ipaddress
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator

from batchllm.config import ConfigError, JobConfig
from batchllm.rows.redact import redact
from batchllm.rows.storage import absolute

# A worker on a CPU-only cluster takes half a logical CPU: whole-CPU actors on a small machine
# leave nothing for Ray's own tasks (seen on 2 cores: ray.init(num_cpus=2) with two 1-CPU actors
# hung). Each actor's torch still uses the threads it is given (OMP_NUM_THREADS).
CPU_WORKER_CPUS = 0.5


def require_ray(cfg: JobConfig) -> None:
    """A job of several workers cannot start without Ray: ConfigError (exit 2) before anything
    is read or written."""
    if cfg.engine.workers > 1 and importlib.util.find_spec("ray") is None:
        raise ConfigError(f"engine.workers: {cfg.engine.workers} workers need Ray; "
                          "pip install batchllm[ray]")


# Ray's own switch for a single-node instance: where it is off, Ray takes the loopback address as
# the node's (on Linux it is on, and Ray replaces 127.0.0.1 by the host's address, on which its
# servers then listen). Read by Ray when it is imported, and looked up again at ray.init.
_CLUSTER_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextlib.contextmanager
def _loopback_only() -> Iterator[None]:
    """The switch off while a local instance starts (its processes inherit it), as it was after."""
    old = os.environ.get(_CLUSTER_SWITCH)
    os.environ[_CLUSTER_SWITCH] = "0"
    from ray._private import ray_constants  # imported with ray: the value it read then

    was = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = was
        if old is None:
            os.environ.pop(_CLUSTER_SWITCH, None)
        else:
            os.environ[_CLUSTER_SWITCH] = old


@contextlib.contextmanager
def ray_session(cfg: JobConfig) -> Iterator[None]:
    """Ray for the job's workers: the running session of this process; the cluster at
    engine.ray_address; or a new local instance on 127.0.0.1 with a private folder (no
    dashboard; at least one logical CPU per worker), even where `ray start` left a cluster
    running on this machine. A Ray this call started or joined is left when the block ends."""
    import ray

    if ray.is_initialized():
        yield
        return
    folder = None
    ours = _signal_handlers()
    try:
        if cfg.engine.ray_address:
            ray.init(address=cfg.engine.ray_address)
        else:
            folder = tempfile.mkdtemp(prefix="batchllm-ray-")  # 0700; Ray opens its own
            cpus = max(os.cpu_count() or 1, cfg.engine.workers)  # temp folder (0777) inside
            with _loopback_only():
                ray.init(address="local", num_cpus=cpus, include_dashboard=False,
                         log_to_driver=False, _node_ip_address="127.0.0.1",
                         _temp_dir=os.path.join(folder, "ray"))
            node = ray.util.get_node_ip_address()
            if not ipaddress.ip_address(node).is_loopback:  # a Ray that no longer has the switch
                raise RuntimeError(f"engine.ray_address: the local Ray instance listens on {node}"
                                   ", not 127.0.0.1; start Ray yourself and set ray_address")
        for signum, handler in ours.items():  # Ray's core worker replaced them with its own,
            signal.signal(signum, handler)     # which dies at SIGTERM without a flush
        yield
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


def _signal_handlers() -> dict:
    """The Python handlers of SIGINT and SIGTERM (run_job's: flush, then the resume command),
    where this thread may set them (the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)
            if signal.getsignal(s) is not None}


def use_gpus(cfg: JobConfig) -> bool:
    """GPUs for the workers (engine.tensor_parallel each) when the cluster has GPUs and the job
    does not ask for the CPU."""
    import ray

    return cfg.model.device != "cpu" and ray.cluster_resources().get("GPU", 0) >= 1


def worker_bundle(cfg: JobConfig, gpus: bool) -> dict[str, float]:
    """The Ray resources of one worker: engine.tensor_parallel GPUs, or half a CPU per rank."""
    n = cfg.engine.tensor_parallel
    return {"GPU": n} if gpus else {"CPU": CPU_WORKER_CPUS * n}


def check_groups_fit(cfg: JobConfig, gpus: bool) -> None:
    """With engine.tensor_parallel > 1, a worker's devices must all be on one node: a
    RuntimeError naming what the largest node has where none can hold a group."""
    import ray

    if cfg.engine.tensor_parallel == 1:
        return
    ((kind, need),) = worker_bundle(cfg, gpus).items()
    most = max((node["Resources"].get(kind, 0) for node in ray.nodes() if node["Alive"]),
               default=0)
    if most < need:
        what = "GPUs" if kind == "GPU" else "CPUs (half a CPU per rank)"
        raise RuntimeError(f"engine.tensor_parallel: {cfg.engine.tensor_parallel}: a worker "
                           f"needs {need:g} {what} on one node; the cluster's largest node has "
                           f"{most:g}")


def reserve_group(cfg: JobConfig, gpus: bool):
    """Worker's placement group (one bundle: worker_bundle) where engine.tensor_parallel > 1;
    None otherwise (the actor asks for its one device itself)."""
    if cfg.engine.tensor_parallel == 1:
        return None
    from ray.util.placement_group import placement_group

    return placement_group([worker_bundle(cfg, gpus)], strategy="STRICT_PACK")


def release_group(group) -> None:
    from ray.util.placement_group import remove_placement_group

    if group is not None:
        remove_placement_group(group)


def actor_name(cfg: JobConfig, worker: int, attempt: int = 0) -> str:
    """The Ray name of a worker's actor (in the driver's namespace); attempt > 0 after a restart."""
    base = f"batchllm:{redact(absolute(cfg.output.path))}:w{worker}"
    return base if attempt == 0 else f"{base}:r{attempt}"


def start_worker(cfg: JobConfig, fingerprint: dict, flush_rows: int, worker: int, attempt: int,
                 gpus: bool, group=None):
    """A new ShardWorker actor (it loads the model when it starts), in `group` (reserve_group)
    with all of its bundle where there is one. Ray does not restart it: the driver does, with
    the rows not yet in parts."""
    import ray

    from batchllm.scale.worker import ShardWorker

    bundle = worker_bundle(cfg, gpus)
    resources = {"num_gpus": bundle["GPU"]} if gpus else {"num_cpus": bundle["CPU"]}
    if group is not None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        resources["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=0)
    # max_concurrency 2: pid(), progress() and flush() answer while run_shard runs
    actor = ray.remote(ShardWorker).options(
        name=actor_name(cfg, worker, attempt), max_restarts=0, max_concurrency=2, **resources)
    return actor.remote(cfg, fingerprint, flush_rows)
