"""One worker of a sharded job: loads the model once, runs shards with the single-process
runtime (`Runtime.run`) and writes the same checkpoint parts, tagged with its worker number.

A plain class: the driver makes it a Ray actor (`ray.remote(ShardWorker)`), so this module does
not import ray at import time.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from batchllm.config import JobConfig
from batchllm.engine.metrics import RunMetrics
from batchllm.engine.runtime import Runtime
from batchllm.plan.partition import row_key
from batchllm.rows.record import Row
from batchllm.rows.writer import CheckpointWriter


@dataclass
class Shard:
    """What a worker runs: its rows, already tokenized, in input order."""

    worker: int  # shard number; the parts are tagged "-w{worker}"
    rows: list[Row]
    skip: set[int] = field(default_factory=set)  # row indices already in parts: planned, not run


@dataclass
class WorkerResult:
    """What a finished worker attempt sends back to the driver."""

    worker: int
    metrics: RunMetrics
    wall_seconds: float
    pid: int
    key_range: tuple[bytes, bytes] | None = None  # engine.sharding partition: its rows' keys


def part_tag(worker: int) -> str:
    """The tag of a worker's part names: part-00000-w1.parquet."""
    return f"-w{worker}"


class ShardWorker:
    """Holds the job's model; `run_shard` runs one shard and returns its result."""

    def __init__(self, cfg: JobConfig, fingerprint: dict, flush_rows: int) -> None:
        self.cfg = cfg
        self.fingerprint = fingerprint
        self.flush_rows = flush_rows
        self.runtime = Runtime.from_config(cfg)

    def pid(self) -> int:
        """The worker's process id (tests kill it)."""
        return os.getpid()

    def run_shard(self, shard: Shard) -> WorkerResult:
        """Run the shard's rows except `skip`; finished rows go to parts as they finish."""
        start = time.perf_counter()
        writer = CheckpointWriter(self.cfg.output.path, self.fingerprint,
                                  flush_rows=self.flush_rows, tag=part_tag(shard.worker))
        metrics = self.runtime.run(shard.rows, writer.add, None, skip=shard.skip)
        writer.flush()
        return WorkerResult(shard.worker, metrics, time.perf_counter() - start, os.getpid())

    def run_partition(self, pieces: list, worker: int, done: list[int]) -> WorkerResult:
        """Run this worker's pieces of every block (Ray object refs, engine.sharding: partition)
        except the rows in `done`, planned here. The result's key_range is the smallest and
        largest key of the rows in the plan (the driver counts the prefix tokens cut apart)."""
        import ray

        from batchllm.scale.shuffle import gather_pieces

        shard = gather_pieces(ray.get(pieces), worker, set(done))
        result = self.run_shard(shard)
        keys = [row_key(r.prompt_ids) for r in shard.rows if r.ok]  # admitted by the run
        result.key_range = (min(keys), max(keys)) if keys else None
        return result
