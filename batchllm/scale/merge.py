"""The metrics of a sharded job: the single-process metrics summed over workers, the shards'
predicted figures, and one entry per worker."""

from __future__ import annotations

from dataclasses import dataclass, field

_SUMMED = ("rows", "prompt_tokens", "prefill_tokens", "cached_tokens", "completion_tokens",
           "preemptions", "steps")
_MAXED = ("kv_pages_total", "kv_pages_peak", "kv_pages_shared_peak")
_SAME = ("kv_bytes_per_token", "page_size", "device", "dtype", "model")


@dataclass
class WorkerRecord:
    """What the driver knows of one worker (one shard) across its attempts."""

    worker: int
    predicted_prefill_tokens: int = 0  # of the rows the last attempt was given to run
    restarts: int = 0  # attempts that died
    rows_recovered: int = 0  # rows a dead attempt had flushed to parts: not run again
    result: dict = field(default_factory=dict)  # LLM.run metrics of the attempt that finished

    def summary(self) -> dict:
        r = self.result
        return {
            "worker": self.worker,
            "rows": r.get("rows", 0),
            "prefill_tokens": r.get("prefill_tokens", 0),
            "predicted_prefill_tokens": self.predicted_prefill_tokens,
            "completion_tokens": r.get("completion_tokens", 0),
            "wall_seconds": r.get("wall_seconds", 0.0),
            "restarts": self.restarts,
            "rows_recovered": self.rows_recovered,
        }


def merge_metrics(records: list[WorkerRecord], wall: float, tree_tokens: int,
                  duplicated_tokens: int, shards: dict) -> dict:
    """One metrics dict for the whole job; `rows` here counts the rows run (job.py sets the
    job's row counts afterwards). tree_tokens: of the whole job on one worker;
    duplicated_tokens: prefix tokens computed on more than one worker."""
    results = [w.result for w in records if w.result]
    m: dict = {k: sum(r.get(k, 0) for r in results) for k in _SUMMED}
    m.update({k: max((r.get(k, 0) for r in results), default=0) for k in _MAXED})
    m.update({k: results[0].get(k) for k in _SAME} if results else {})
    completion, prompt = m["completion_tokens"], m["prompt_tokens"]
    m.update(
        tree_tokens=tree_tokens,
        wall_seconds=wall,
        output_tokens_per_s=completion / wall if wall else 0.0,
        total_tokens_per_s=(prompt + completion) / wall if wall else 0.0,
        workers=len(records),
        worker_restarts=sum(w.restarts for w in records),
        rows_recovered=sum(w.rows_recovered for w in records),
        predicted_prefill_tokens=sum(w.predicted_prefill_tokens for w in records),
        predicted_duplicated_prefix_tokens=duplicated_tokens,
        shards=shards,
        per_worker=[w.summary() for w in records],
    )
    return m
