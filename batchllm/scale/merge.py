"""The metrics of a sharded job: the workers' run metrics merged (RunMetrics.merge, field by
field), the shards' predicted figures, and one entry per worker."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from batchllm.engine.metrics import RunMetrics

if TYPE_CHECKING:
    from batchllm.scale.worker import WorkerResult


@dataclass
class WorkerRecord:
    """What the driver knows of one worker (one shard) across its attempts."""

    worker: int
    predicted_prefill_tokens: int = 0  # of the rows the last attempt was given to run
    restarts: int = 0  # attempts that died or were replaced
    timeouts: int = 0  # of them, attempts replaced for making no progress (worker_timeout)
    rows_recovered: int = 0  # rows a dead attempt had flushed to parts: not run again
    result: WorkerResult | None = None  # of the attempt that finished

    def summary(self) -> dict:
        m = self.result.metrics if self.result else RunMetrics()
        return {
            "worker": self.worker,
            "rows": m.rows,
            "prefill_tokens": m.prefill_tokens,
            "predicted_prefill_tokens": self.predicted_prefill_tokens,
            "completion_tokens": m.completion_tokens,
            "wall_seconds": self.result.wall_seconds if self.result else 0.0,
            "restarts": self.restarts,
            "timeouts": self.timeouts,
            "rows_recovered": self.rows_recovered,
        }


@dataclass
class ShardedMetrics:
    """A sharded job's figures: the merged run, then what only the driver knows."""

    run: RunMetrics
    workers: int
    worker_restarts: int
    worker_timeouts: int  # of the restarts, workers replaced for making no progress
    rows_recovered: int
    predicted_prefill_tokens: int
    predicted_duplicated_prefix_tokens: int  # prefix tokens computed on more than one worker
    shards: dict = field(default_factory=dict)  # the cut's figures (sharding mode, rows, cost)
    per_worker: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = self.run.to_dict()
        d.update({k: v for k, v in vars(self).items() if k != "run"})
        return d


def merge_metrics(records: list[WorkerRecord], wall: float, tree_tokens: int,
                  duplicated_tokens: int, shards: dict) -> ShardedMetrics:
    """One record for the whole job; its `rows` counts the rows run (the job adds its own row
    counts). tree_tokens: of the whole job on one worker."""
    runs = [w.result.metrics for w in records if w.result]
    return ShardedMetrics(
        run=RunMetrics.merge(runs, tree_tokens=tree_tokens, wall_seconds=wall),
        workers=len(records),
        worker_restarts=sum(w.restarts for w in records),
        worker_timeouts=sum(w.timeouts for w in records),
        rows_recovered=sum(w.rows_recovered for w in records),
        predicted_prefill_tokens=sum(w.predicted_prefill_tokens for w in records),
        predicted_duplicated_prefix_tokens=duplicated_tokens,
        shards=shards,
        per_worker=[w.summary() for w in records],
    )
