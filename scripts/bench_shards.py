"""Sharding at scale: the synthetic prompts of bench_planner.py, planned, then cut into N shards.

Prints the planning and sharding time, peak RSS, each shard's predicted cost and the duplicated
prefix tokens, i.e. what `batchllm plan` prints with engine.workers: N, minus reading and
tokenizing the Parquet input (which this skips: the prompts are token ids already).

    python scripts/bench_shards.py --rows 1000000 --workers 8
"""

from __future__ import annotations

import argparse
import resource
import time

from bench_planner import synthetic

from batchllm.plan.planner import make_plan
from batchllm.plan.shards import make_shards


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()
    tokens, offsets, max_tokens = synthetic(args.rows, max(1, args.rows // 20))
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
