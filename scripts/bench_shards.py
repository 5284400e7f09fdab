"""Sharding at scale: the synthetic prompts of bench_planner.py, planned, then cut into N shards.

Prints the planning and sharding time, peak RSS, each shard's predicted cost and the duplicated
prefix tokens, i.e. what `batchllm plan` prints with engine.workers: N, minus reading and
tokenizing the Parquet input (which this skips: the prompts are token ids already).

    python scripts/bench_shards.py --rows 1000000 --workers 8
    python scripts/bench_shards.py --rows 1000000 --workers 8 --sharding partition

--sharding partition runs engine.sharding: partition's code in one process: each block of 65,536
rows sampled (a task's work), the cuts chosen from the samples (the driver's), every block routed
(a task's), then each part planned as its worker would; it prints the time of each stage (the
per-block figures are per task), the bytes the driver receives, the part costs, and the tokens
computed on two workers: counted from the cuts and checked against the parts' trees minus the
whole job's tree.
"""

from __future__ import annotations

import argparse
import resource
import time
from itertools import pairwise

import numpy as np
from bench_planner import synthetic

from batchllm.plan.partition import (
    choose_cuts,
    common_tokens,
    route,
    row_key,
    sample_block,
    samples_per_block,
)
from batchllm.plan.planner import make_plan
from batchllm.plan.shards import make_shards
from batchllm.rows.blocks import BLOCK_ROWS
from batchllm.rows.record import Row
from batchllm.sampling_params import SamplingParams


def partition(tokens: np.ndarray, offsets: np.ndarray, max_tokens: np.ndarray,
              workers: int) -> None:
    rows = [Row(i, i, tokens[offsets[i] : offsets[i + 1]], SamplingParams(max_tokens=int(m)))
            for i, m in enumerate(max_tokens.tolist())]
    blocks = [rows[lo : lo + BLOCK_ROWS] for lo in range(0, len(rows), BLOCK_ROWS)]
    per_block = samples_per_block(len(blocks))
    t0 = time.perf_counter()
    samples = [sample_block(b, per_block) for b in blocks]
    t1 = time.perf_counter()
    uppers = choose_cuts(samples, workers)
    t2 = time.perf_counter()
    part = np.concatenate([route(b, uppers) for b in blocks])
    t3 = time.perf_counter()
    received = sum(len(k) + 8 for s in samples for k in s.keys) + 4 * len(rows)
    print(f"{len(blocks)} blocks of <= {BLOCK_ROWS:,} rows: sample {(t1 - t0) / len(blocks):.2f} "
          f"s per block, route {(t3 - t2) / len(blocks):.2f} s per block; choose_cuts "
          f"{t2 - t1:.2f} s; the driver receives {received / 2**20:.0f} MiB "
          f"({sum(len(s.keys) for s in samples):,} keys + a part number per row)")
    members = [np.flatnonzero(part == k) for k in range(workers)]
    t4 = time.perf_counter()
    trees, costs = [], []
    for m in members:
        plan = make_plan([rows[i].prompt_ids for i in m], max_tokens[m])
        trees.append(plan.stats()["tree_tokens"])
        costs.append(trees[-1] + int(max_tokens[m].sum()))
    t5 = time.perf_counter()
    whole = make_plan(tokens, max_tokens, offsets=offsets).stats()["tree_tokens"]
    ends = []
    for mm in members:
        if len(mm):
            ks = sorted(row_key(rows[i].prompt_ids) for i in mm)
            ends.append((ks[0], ks[-1]))
    cut = sum(common_tokens(a[1], b[0]) for a, b in pairwise(ends))
    cost = np.asarray(costs, np.float64)
    print(f"plan each part: {(t5 - t4) / workers:.1f} s per worker; parts' rows "
          f"{[len(m) for m in members]}")
    print(f"part cost max/mean {cost.max() / cost.mean():.4f}; tokens on two workers: "
          f"{cut:,} from the cuts, {sum(trees) - whole:,} = parts' trees - whole tree "
          f"({whole:,})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--sharding", choices=("tree", "partition"), default="tree")
    args = ap.parse_args()
    tokens, offsets, max_tokens = synthetic(args.rows, max(1, args.rows // 20))
    if args.sharding == "partition":
        partition(tokens, offsets, max_tokens, args.workers)
        print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB "
              "(all stages in one process)")
        return
    t0 = time.perf_counter()
    plan = make_plan(tokens, max_tokens, offsets=offsets)
    t1 = time.perf_counter()
    shards = make_shards(plan, args.workers)
    t2 = time.perf_counter()
    s = plan.stats()
    print(f"rows {args.rows:,}  prompt_tokens {s['prompt_tokens']:,}  tree_tokens "
          f"{s['tree_tokens']:,}  decode_tokens {int(max_tokens.sum()):,}  groups {s['groups']:,}")
    print(f"make_plan {t1 - t0:.1f} s  make_shards {t2 - t1:.1f} s  peak RSS "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    print(shards.pretty())
    st = shards.stats()
    print(f"cost max/mean {st['shard_cost_max_over_mean']:.4f}  duplicated "
          f"{shards.duplicated_tokens:,} ({shards.duplicated_tokens / s['tree_tokens']:.2e} of "
          f"the tree)")


if __name__ == "__main__":
    main()
