"""The Ray side of a sharded job: joining or starting Ray, and creating worker actors.

Only this module and `driver` import ray, and only when a job has engine.workers > 1.
"""

from __future__ import annotations

import importlib.util
import os

from batchllm.config import ConfigError, JobConfig

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


def connect(cfg: JobConfig) -> bool:
    """Join Ray: the running session of this process, the cluster at engine.ray_address, or a new
    local instance (no dashboard; at least one logical CPU per worker), even where `ray start`
    left a cluster running on this machine. Returns whether this call started Ray (then the
    caller shuts it down)."""
    import ray

    if ray.is_initialized():
        return False
    address = cfg.engine.ray_address
    if address:
        ray.init(address=address)
    else:
        cpus = max(os.cpu_count() or 1, cfg.engine.workers)
        ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    return True


def use_gpus(cfg: JobConfig) -> bool:
    """One GPU per worker when the cluster has GPUs and the job does not ask for the CPU."""
    import ray

    return cfg.model.device != "cpu" and ray.cluster_resources().get("GPU", 0) >= 1


def actor_name(cfg: JobConfig, worker: int, attempt: int = 0) -> str:
    """The Ray name of a worker's actor (in the driver's namespace); attempt > 0 after a restart."""
    base = f"batchllm:{os.path.abspath(cfg.output.path)}:w{worker}"
    return base if attempt == 0 else f"{base}:r{attempt}"


def start_worker(cfg: JobConfig, fingerprint: dict, flush_rows: int, worker: int, attempt: int,
                 gpus: bool):
    """A new ShardWorker actor (it loads the model when it starts). Ray does not restart it:
    the driver does, with the rows not yet in parts."""
    import ray

    from batchllm.scale.worker import ShardWorker

    resources = {"num_gpus": 1} if gpus else {"num_cpus": CPU_WORKER_CPUS}
    # max_concurrency 2: pid() answers while run_shard runs
    actor = ray.remote(ShardWorker).options(
        name=actor_name(cfg, worker, attempt), max_restarts=0, max_concurrency=2, **resources)
    return actor.remote(cfg, fingerprint, flush_rows)
