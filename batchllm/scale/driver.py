"""The driver of a sharded job (engine.workers > 1): plan and shard locally (engine.sharding:
tree) or have Ray tasks range-partition the rows (partition), run each shard on a Ray actor
(scale/pool.py: a worker that dies or stalls is replaced, with the rows it had not flushed),
merge the metrics. Interrupted (SIGINT, SIGTERM: run_job's JobInterrupted), it has every worker
flush its finished rows to parts before the workers are stopped, as the local path flushes.

The parts the workers write are the single-process checkpoint format, in the same folder
(tagged per worker), so run_job finalizes and resumes a sharded job exactly like a local one.
"""

from __future__ import annotations

import dataclasses
import os
import time
from itertools import pairwise

import numpy as np
import pyarrow.parquet as pq

from batchllm.config import JobConfig
from batchllm.model.loader import job_model
from batchllm.plan.partition import common_tokens
from batchllm.plan.shards import shard_prefill
from batchllm.progress import Progress
from batchllm.rows import storage
from batchllm.rows.blocks import InputIndex
from batchllm.rows.build import build_rows
from batchllm.rows.reader import InputRows
from batchllm.rows.record import Row
from batchllm.rows.writer import CheckpointWriter
from batchllm.scale.assign import JobShards, plan_index, shard_job
from batchllm.scale.cluster import ray_session, use_gpus
from batchllm.scale.merge import ShardedMetrics, WorkerRecord, merge_metrics
from batchllm.scale.pool import Work, WorkerPool
from batchllm.scale.shard import Shard
from batchllm.scale.shuffle import Partitions, partition_rows


class _PartsWatcher:
    """Moves the progress bar by the rows of part files that appear (the workers' flushes)."""

    def __init__(self, writer: CheckpointWriter, bar: Progress) -> None:
        self.dir, self.bar = writer.parts_dir, bar
        self.seen = set(storage.list_dir(self.dir))

    def poll(self) -> None:
        for name in sorted(set(storage.list_dir(self.dir)) - self.seen):
            if name.endswith(".parquet"):
                try:
                    source = storage.arrow_source(storage.join(self.dir, name))
                    self.bar.add_rows(pq.read_metadata(source).num_rows)
                except OSError:
                    continue  # renamed away or damaged: look again next time
            self.seen.add(name)
        self.bar.tick()


def _shard(job: JobShards, k: int, done: set[int], rows: list[Row]) -> Shard:
    mine = job.rows[k].tolist()
    return Shard(k, [rows[i] for i in mine], done.intersection(mine))


def _predicted(job: JobShards, k: int, done: set[int]) -> int:
    """Predicted prefill tokens of shard k's rows that are not done."""
    planned = plan_index(job.planned)
    plan_row = np.full(int(planned.max(initial=-1)) + 1, -1, np.int64)
    plan_row[planned] = np.arange(len(planned))
    rows = job.rows[k]
    rows = rows[rows < len(plan_row)]
    todo = np.array([plan_row[i] for i in rows.tolist() if i not in done and plan_row[i] >= 0],
                    np.int64)
    return shard_prefill(job.planned.plan, todo)


def _absolute_paths(cfg: JobConfig) -> JobConfig:
    """The output path, and the model path when it is a local folder, made absolute."""
    model = cfg.model
    if os.path.isdir(model.path):
        model = dataclasses.replace(model, path=os.path.abspath(model.path))
    output = dataclasses.replace(cfg.output, path=storage.absolute(cfg.output.path))
    return dataclasses.replace(cfg, model=model, output=output)


def _tree_work(cfg: JobConfig, source: InputRows) -> tuple[Work, JobShards]:
    """engine.sharding: tree: the driver tokenizes and plans the whole job and cuts the plan."""
    tokenizer, limit = job_model(cfg.model.path, cfg.model.max_model_len, cfg.model.revision)
    rows = build_rows(tokenizer, cfg.input, cfg.sampling, source,
                      keep_prompt=cfg.output.include_prompt)
    job = shard_job(rows, cfg, limit, cfg.engine.workers)

    def call(actor, k: int, done: set[int]):
        return actor.run_shard.remote(_shard(job, k, done, rows))

    return Work(job.rows, call, lambda k, done: _predicted(job, k, done)), job


def _partition_work(cfg: JobConfig, index: InputIndex) -> tuple[Work, Partitions]:
    """engine.sharding: partition: tasks tokenize and range-partition; workers plan."""
    _, limit = job_model(cfg.model.path, cfg.model.max_model_len, cfg.model.revision)
    parts = partition_rows(cfg, index, cfg.engine.workers, limit)

    def call(actor, k: int, done: set[int]):
        mine = sorted(done.intersection(parts.rows[k].tolist()))
        return actor.run_partition.remote(parts.pieces[k], k, mine)

    return Work(parts.rows, call, None), parts


def _cut_tokens(records: list[WorkerRecord]) -> list[int]:
    """Prefix tokens computed on two workers at each cut between non-empty partitions: the
    longest common prefix of the largest key before the cut and the smallest after it."""
    ranges = [w.result.key_range for w in records if w.result and w.result.key_range]
    return [common_tokens(a[1], b[0]) for a, b in pairwise(ranges)]


def run_sharded(cfg: JobConfig, source: InputRows | InputIndex, writer: CheckpointWriter,
                done: set[int], bar: Progress) -> ShardedMetrics:
    """Run every row not in `done` on engine.workers Ray actors; their parts land in
    writer.parts_dir. `source`: all input rows (the driver plans: engine.sharding tree) or the
    input's index (tasks tokenize and partition). Returns the merged metrics (run_job finalizes
    the output)."""
    start = time.perf_counter()
    cfg = _absolute_paths(cfg)  # workers may start in another directory (a joined cluster)
    records = [WorkerRecord(k) for k in range(cfg.engine.workers)]
    watcher = _PartsWatcher(writer, bar)
    with ray_session(cfg):
        if isinstance(source, InputIndex):
            work, parts = _partition_work(cfg, source)
        else:
            work, job = _tree_work(cfg, source)
        pool = WorkerPool(cfg, writer, work, records, done, use_gpus(cfg))
        try:
            pool.run(watcher.poll)
        except BaseException:  # interrupted, or failed: what the workers finished is kept
            pool.flush()
            raise
        finally:
            pool.close()
        watcher.poll()
    wall = time.perf_counter() - start
    if isinstance(source, InputIndex):
        for w in records:  # a worker plans its own part: its plan is the prediction
            w.predicted_prefill_tokens = w.result.metrics.tree_tokens if w.result else 0
        cuts = _cut_tokens(records) if cfg.engine.prefix_sharing else []
        stats = {"sharding": "partition", "blocks": parts.blocks,
                 "shard_rows": [len(r) for r in parts.rows], "cut_shared_tokens": cuts}
        tree = sum(w.predicted_prefill_tokens for w in records) - sum(cuts)
        return merge_metrics(records, wall, tree, sum(cuts), stats)
    stats = {"sharding": "tree", **job.stats()}
    return merge_metrics(records, wall, job.shards.tree_tokens, job.shards.duplicated_tokens,
                         stats)
