"""One worker of a sharded job: loads the model once, runs shards with the single-process
runtime (`Runtime.run_rows`) and writes the same checkpoint parts, tagged with its worker number.

A plain class: the driver makes it a Ray actor (`ray.remote(ShardWorker)`, two calls at a time),
so this module does not import ray at import time. While a shard runs, the driver asks
`progress()` (it replaces a worker whose count stops moving: engine.worker_timeout) and, when the
job is interrupted, `flush()` (the finished rows go to parts before the actor is killed).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from batchllm.config import JobConfig
from batchllm.engine.metrics import RunMetrics
from batchllm.engine.runtime import Runtime
from batchllm.model.errors import ModelError
from batchllm.plan.partition import row_key
from batchllm.rows.fingerprint import NUMERICS
from batchllm.rows.writer import CheckpointWriter
from batchllm.scale.shard import Shard, gather_pieces, part_tag


@dataclass
class WorkerResult:
    """What a finished worker attempt sends back to the driver."""

    worker: int
    metrics: RunMetrics
    wall_seconds: float
    pid: int
    key_range: tuple[bytes, bytes] | None = None  # engine.sharding partition: its rows' keys


class ShardWorker:
    """Holds the job's model; `run_shard` runs one shard and returns its result."""

    def __init__(self, cfg: JobConfig, fingerprint: dict, flush_rows: int) -> None:
        self.cfg = cfg
        self.fingerprint = fingerprint
        self.flush_rows = flush_rows
        self.runtime = Runtime.from_config(cfg)
        self._check_numerics()
        self._progress = 0  # steps run and rows finished: what the driver watches
        self._writer: CheckpointWriter | None = None

    def _check_numerics(self) -> None:
        """The device and dtype this worker runs must be those the job's fingerprint records
        (the driver resolved them on its machine): one file never mixes numerics."""
        want = self.fingerprint.get(NUMERICS) or {}
        loaded = self.runtime.loaded
        have = {"device": loaded.device.type,
                "dtype": str(loaded.model.dtype).removeprefix("torch.")}
        for key, value in have.items():
            if key in want and want[key] != value:
                raise ModelError(
                    f"model.{key}: this worker runs {value}, the job's driver resolved "
                    f"{want[key]} (its own machine's); set model.{key}: {value} in the job")

    def pid(self) -> int:
        """The worker's process id (tests kill it)."""
        return os.getpid()

    def progress(self) -> int:
        """Steps run and rows finished so far; the driver replaces a worker whose count stops."""
        return self._progress

    def flush(self) -> int:
        """Write the finished rows not yet in a part (the job is being interrupted); returns
        the rows this attempt has written to parts."""
        writer = self._writer
        if writer is None:
            return 0
        writer.flush()
        return writer.rows_flushed

    def _step(self, stats) -> None:
        self._progress += 1

    def _row(self, row) -> None:
        self._progress += 1
        self._writer.add(row)  # a copy, written with the next part
        row.release()  # the worker keeps no finished row's results until the end

    def run_shard(self, shard: Shard) -> WorkerResult:
        """Run the shard's rows except `skip`; finished rows go to parts as they finish."""
        start = time.perf_counter()
        self._writer = CheckpointWriter(self.cfg.output.path, self.fingerprint,
                                        flush_rows=self.flush_rows, tag=part_tag(shard.worker))
        metrics = self.runtime.run_rows(shard.rows, self._row, self._step, skip=shard.skip)
        self._writer.flush()
        return WorkerResult(shard.worker, metrics, time.perf_counter() - start, os.getpid())

    def run_partition(self, pieces: list, worker: int, done: list[int]) -> WorkerResult:
        """Run this worker's pieces of every block (Ray object refs, engine.sharding: partition)
        except the rows in `done`, planned here. The result's key_range is the smallest and
        largest key of the rows in the plan (the driver counts the prefix tokens cut apart)."""
        import ray

        shard = gather_pieces(ray.get(pieces), worker, set(done))
        result = self.run_shard(shard)
        keys = [row_key(r.prompt_ids) for r in shard.rows if r.ok]  # admitted by the run
        result.key_range = (min(keys), max(keys)) if keys else None
        return result
