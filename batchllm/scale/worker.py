"""One worker of a sharded job: loads the model once, runs shards with the single-process engine
(`LLM.run`) and writes the same checkpoint parts, tagged with its worker number.

A plain class: the driver makes it a Ray actor (`ray.remote(ShardWorker)`), so this module does
not import ray.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from batchllm.config import JobConfig
from batchllm.llm import RequestOutput, RowInput
from batchllm.rows.writer import CheckpointWriter


@dataclass
class ShardInput:
    """What a worker needs to run one shard: its rows, already tokenized by the driver."""

    worker: int  # shard number; the parts are tagged "-w{worker}"
    rows: list[int]  # [S] input row indices, sorted
    inputs: list[RowInput]  # [S] engine rows
    ids: list[object]  # [S] input ids
    prompts: list[str | None]  # [S] rendered prompt text (written when output.include_prompt)
    skip: list[int]  # positions in `rows` already in parts: planned with the others, not run


def part_tag(worker: int) -> str:
    """The tag of a worker's part names: part-00000-w1.parquet."""
    return f"-w{worker}"


class ShardWorker:
    """Holds the job's model; `run_shard` runs one shard and returns its metrics."""

    def __init__(self, cfg: JobConfig, fingerprint: dict, flush_rows: int) -> None:
        from batchllm.job import build_llm  # job imports this package lazily: no import cycle

        self.cfg = cfg
        self.fingerprint = fingerprint
        self.flush_rows = flush_rows
        self.llm = build_llm(cfg)

    def pid(self) -> int:
        """The worker's process id (tests kill it)."""
        return os.getpid()

    def run_shard(self, shard: ShardInput) -> dict:
        """Run the shard's rows except `skip`; finished rows go to parts as they finish.
        Returns LLM.run's metrics plus worker, wall_seconds and pid."""
        from batchllm.job import output_row

        start = time.perf_counter()
        writer = CheckpointWriter(self.cfg.output.path, self.fingerprint,
                                  flush_rows=self.flush_rows, tag=part_tag(shard.worker))

        def on_output(j: int, out: RequestOutput) -> None:
            writer.add(output_row(shard.rows[j], shard.ids[j], shard.prompts[j], out))

        metrics = self.llm.run(shard.inputs, on_output, None, skip=set(shard.skip))
        writer.flush()
        metrics.update(worker=shard.worker, wall_seconds=time.perf_counter() - start,
                       pid=os.getpid())
        return metrics

    def run_partition(self, pieces: list, worker: int, done: list[int]) -> dict:
        """Run this worker's pieces of every block (Ray object refs, engine.sharding: partition)
        except the rows in `done`, planned here. Adds key_range: the smallest and largest key of
        the rows in the plan (the driver counts the prefix tokens cut apart from them)."""
        import ray

        from batchllm.plan.partition import row_key
        from batchllm.scale.shuffle import gather_pieces

        shard = gather_pieces(ray.get(pieces), worker, set(done))
        metrics = self.run_shard(shard)
        keys = [row_key(r.prompt_ids) for r in shard.inputs if self.llm.check_row(r) is None]
        metrics["key_range"] = (min(keys), max(keys)) if keys else None
        return metrics
