"""Which input rows each worker runs: the job's plan cut into shards, mapped back to input rows.

Rows that cannot run (their error is known before the model loads) are in no plan; they go to
the shard with the lowest predicted cost, where the worker writes their error rows at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from batchllm.config import JobConfig
from batchllm.llm import RowInput
from batchllm.plan.partition import runnable
from batchllm.plan.planner import Plan, make_plan
from batchllm.plan.shards import Shards, make_shards


@dataclass(eq=False)
class JobShards:
    """A job's plan and its shards; `rows[k]` are the input row indices of shard k (sorted)."""

    plan: Plan  # over the rows that can run (`planned`), in their input order
    planned: np.ndarray  # [R] int64 input row index of each plan row
    shards: Shards
    rows: list[np.ndarray]  # [N] of int64 input row indices

    def stats(self) -> dict:
        """The shards' figures, as `batchllm plan` and the metrics file show them."""
        s = self.shards.stats()
        s["shard_rows"] = [len(r) for r in self.rows]
        s["shard_cost"] = self.shards.cost.tolist()
        return s


def plan_rows(inputs: Sequence[RowInput], cfg: JobConfig) -> tuple[Plan, np.ndarray]:
    """The plan of the rows that can run (no known error), and their input indices."""
    good = np.array([i for i, r in enumerate(inputs) if runnable(r)], np.int64)
    plan = make_plan(
        [inputs[i].prompt_ids for i in good],
        np.asarray([inputs[i].sampling.max_tokens for i in good], dtype=np.int32),
        prefix_sharing=cfg.engine.prefix_sharing,
        order=cfg.planner.order,
    )
    return plan, good


def shard_job(inputs: Sequence[RowInput], cfg: JobConfig, num_shards: int) -> JobShards:
    """Plan every row of the job and cut the plan into `num_shards` shards."""
    plan, good = plan_rows(inputs, cfg)
    shards = make_shards(plan, num_shards)
    rows = [good[s] for s in shards.rows]
    bad = np.setdiff1d(np.arange(len(inputs)), good)
    if len(bad):
        k = int(np.argmin(shards.cost))
        rows[k] = np.sort(np.concatenate((rows[k], bad)))
    return JobShards(plan, good, shards, rows)


def partition_job(inputs: Sequence[RowInput], cfg: JobConfig, num_shards: int) -> JobShards:
    """What engine.sharding: partition does, computed on this machine (for `batchllm plan`):
    the same sampling, cuts and routing over blocks of BLOCK_ROWS consecutive rows (the run's
    blocks are whole row groups, so its cuts may differ slightly); rows that cannot run go to
    part 0, as `route` sends them."""
    from batchllm.plan.partition import choose_cuts, route, sample_block, samples_per_block
    from batchllm.rows.blocks import BLOCK_ROWS

    plan, good = plan_rows(inputs, cfg)
    blocks = [inputs[lo : lo + BLOCK_ROWS] for lo in range(0, len(inputs), BLOCK_ROWS)]
    per_block = samples_per_block(len(blocks))
    uppers = choose_cuts([sample_block(b, per_block) for b in blocks], num_shards)
    part = route(inputs, uppers)  # [len(inputs)]
    shards = Shards.of(plan, [np.flatnonzero(part[good] == k) for k in range(num_shards)])
    return JobShards(plan, good, shards, [np.flatnonzero(part == k) for k in range(num_shards)])


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
