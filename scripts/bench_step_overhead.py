"""Micro-benchmark: what the step loop costs outside the model, per step, on small decode steps.

  python scripts/bench_step_overhead.py                  # 1, 4 and 8 rows, 256 tokens each
  python scripts/bench_step_overhead.py --rows 1 --profile   # and cProfile's top entries

SmolLM2-135M on the CPU, greedy, end of sequence ignored, each row its own prompt. Timed: the
whole `generate` (planning included) and, inside it, the model's forward (`hidden`, then the
lm_head as `greedy` or `logits`); the difference divided by the steps is the loop's own cost:
scheduling, the step's inputs and metadata, sampling, stopping. The best of --repeat runs.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batchllm import LLM, SamplingParams


def timed_model(model) -> dict[str, float]:
    """Wraps the model's forward halves (instance attributes) to add their seconds up."""
    spent = {"forward": 0.0}
    for name in ("hidden", "greedy", "logits"):
        fn = getattr(model, name, None)
        if fn is None:  # a model without the fused greedy head
            continue

        def call(*args, fn=fn):
            t0 = time.perf_counter()
            out = fn(*args)
            spent["forward"] += time.perf_counter() - t0
            return out

        setattr(model, name, call)
    return spent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,4,8")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="cProfile the last run of each")
    a = p.parse_args()
    print(f"# load average {os.getloadavg()[0]:.2f}")
    llm = LLM("smollm2-135m-instruct", dtype="float32", device="cpu")
    spent = timed_model(llm.runtime.loaded.model)
    sp = SamplingParams(max_tokens=a.tokens, ignore_eos=True)
    print(f"{'rows':>4} {'steps':>6} {'wall ms':>9} {'forward ms':>11} {'us/step outside':>16}")
    for m in (int(r) for r in a.rows.split(",")):
        prompts = [f"Question {i}: what is {i} times {i + 3}? Explain step by step."
                   for i in range(m)]
        best = None
        for run in range(a.repeat + a.profile):  # the profiled run is an extra one
            spent["forward"] = 0.0
            prof = cProfile.Profile() if run == a.repeat else None
            t0 = time.perf_counter()
            if prof:
                prof.enable()
            llm.generate(prompts, sp)
            if prof:
                prof.disable()
            wall = time.perf_counter() - t0
            steps = llm.last_metrics["steps"]
            outside = (wall - spent["forward"]) / steps
            if prof is None and (best is None or outside < best[3]):
                best = (steps, wall, spent["forward"], outside)
            if prof:
                stats = pstats.Stats(prof).sort_stats("tottime")
                stats.print_stats(r"batchllm/(engine|plan|rows|llm)|sampler|numpy|torch\.", 25)
        steps, wall, forward, outside = best
        print(f"{m:>4} {steps:>6} {wall * 1e3:9.1f} {forward * 1e3:11.1f} {outside * 1e6:16.0f}",
              flush=True)


if __name__ == "__main__":
    main()
