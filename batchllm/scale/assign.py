"""Which input rows each worker runs: the job's plan cut into shards, mapped back to input rows.

Rows that cannot run (their error is known before the model loads) are in no plan; they go to
the shard with the lowest predicted cost, where the worker writes their error rows at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from batchllm.config import JobConfig
from batchllm.plan.partition import choose_cuts, route, sample_block, samples_per_block
from batchllm.plan.rows_plan import RowsPlan, plan_rows
from batchllm.plan.shards import Shards, make_shards
from batchllm.rows.blocks import BLOCK_ROWS, count_rows
from batchllm.rows.record import Row

DRIVER_PLAN_ROWS = 1_000_000  # engine.sharding auto: above this, tasks partition the input


def partitioned(cfg: JobConfig) -> bool:
    """Whether a sharded job's input is partitioned by Ray tasks (the driver reads only ids)."""
    if cfg.engine.workers == 1 or cfg.engine.sharding == "tree":
        return False
    return cfg.engine.sharding == "partition" or count_rows(cfg.input) > DRIVER_PLAN_ROWS


def plan_index(planned: RowsPlan) -> np.ndarray:
    """[R] int64: the input row index of each plan row."""
    return np.asarray([r.index for r in planned.rows], np.int64)


@dataclass(eq=False)
class JobShards:
    """A job's plan and its shards; `rows[k]` are the input row indices of shard k (sorted)."""

    planned: RowsPlan  # over the rows that can run, in their input order
    shards: Shards
    rows: list[np.ndarray]  # [N] of int64 input row indices

    def stats(self) -> dict:
        """The shards' figures, as `batchllm plan` and the metrics file show them."""
        s = self.shards.stats()
        s["shard_rows"] = [len(r) for r in self.rows]
        s["shard_cost"] = self.shards.cost.tolist()
        return s


def job_plan(rows: Sequence[Row], cfg: JobConfig, max_model_len: int) -> RowsPlan:
    """The job's one plan: its admitted rows, planned with the job's settings."""
    return plan_rows(rows, max_model_len, cfg.engine.prefix_sharing, cfg.planner.order)


def shard_job(rows: Sequence[Row], cfg: JobConfig, max_model_len: int,
              num_shards: int) -> JobShards:
    """Plan every row of the job (rows[i].index == i) and cut the plan into shards."""
    planned = job_plan(rows, cfg, max_model_len)
    shards = make_shards(planned.plan, num_shards)
    good = plan_index(planned)
    out = [good[s] for s in shards.rows]
    bad = np.setdiff1d(np.arange(len(rows)), good)
    if len(bad):
        k = int(np.argmin(shards.cost))
        out[k] = np.sort(np.concatenate((out[k], bad)))
    return JobShards(planned, shards, out)


def partition_job(rows: Sequence[Row], cfg: JobConfig, max_model_len: int,
                  num_shards: int) -> JobShards:
    """What engine.sharding: partition does, computed on this machine (for `batchllm plan`):
    the same sampling, cuts and routing over blocks of BLOCK_ROWS consecutive rows (the run's
    blocks are whole row groups, so its cuts may differ slightly); rows that cannot run go to
    part 0, as `route` sends them."""
    planned = job_plan(rows, cfg, max_model_len)  # admits: sampling and routing see errors
    blocks = [rows[lo : lo + BLOCK_ROWS] for lo in range(0, len(rows), BLOCK_ROWS)]
    per_block = samples_per_block(len(blocks))
    uppers = choose_cuts([sample_block(b, per_block) for b in blocks], num_shards)
    part = route(rows, uppers)  # [len(rows)]
    good = plan_index(planned)
    shards = Shards.of(planned.plan,
                       [np.flatnonzero(part[good] == k) for k in range(num_shards)])
    return JobShards(planned, shards, [np.flatnonzero(part == k) for k in range(num_shards)])


def describe(job: JobShards) -> dict[str, object]:
    """Human-readable lines for `batchllm plan`: one per shard, then the duplicated tokens."""
    s = job.shards
    out: dict[str, object] = {"workers": s.num_shards}
    for k in range(s.num_shards):
        out[f"shard {k}"] = (f"rows={len(job.rows[k])} prefill={s.prefill_tokens[k]} "
                             f"decode={s.decode_tokens[k]} cost={s.cost[k]}")
    mean = float(s.cost.mean()) if s.num_shards else 0.0
    out["shard_cost_max_over_mean"] = f"{float(s.cost.max()) / mean:.3f}" if mean else "1.000"
    out["duplicated_prefix_tokens"] = s.duplicated_tokens
    out["predicted_prefill_tokens_all_workers"] = int(s.prefill_tokens.sum())
    return out
