"""Micro-benchmark: what the step loop costs outside the model, per step, on small decode steps.

  python scripts/bench_step_overhead.py                  # 1, 4 and 8 rows, 256 tokens each
  python scripts/bench_step_overhead.py --rows 1 --profile   # and cProfile's top entries
  python scripts/bench_step_overhead.py --model tiny --mix issue --logprobs 0,5 \
      --rows 1,64,256,1024 --max-num-seqs 1024 --tokens 16 --repeat 1   # issue 28's curve

SmolLM2-135M (or --model tiny: scripts/random_models.py's 2-layer random model, so the forward
is small) on the CPU, end of sequence ignored, each row its own prompt. --mix greedy: every row
greedy; --mix issue: a third of the rows with two stop strings, half at temperature 0.7.
--logprobs 0,5: each row count without and with `logprobs: 5`. Per step: the metrics file's
step_host_seconds / steps where the engine reports it, else (wall - forward) / steps. Timed: the
whole `generate` (planning included) and, inside it, the model's forward (`hidden`, then the
lm_head as `greedy` or `logits`); the difference divided by the steps is the loop's own cost:
scheduling, the step's inputs and metadata, sampling, stopping. The best of --repeat runs.
--clock thread times everything in the main thread's CPU time instead of the wall clock: on a
machine other jobs load, it leaves out the time the process waited for a core. The model is
loaded as `batchllm run` loads it (collector.start_up: the start-up heap frozen out of the
garbage collector); before that, full collections over it (~0.1 s each, 4 in a 1,024-row run) were
part of the figures.
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

from batchllm import LLM, SamplingParams, collector

TINY_DIR = Path(os.environ.get("TMPDIR", "/tmp")) / "batchllm-random-models"


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


def sampling(mix: str, rows: int, tokens: int, logprobs: int) -> list[SamplingParams]:
    """Per row: greedy, or the issue's mix (a third with two stop strings that the random
    model will rarely produce, half at temperature 0.7)."""
    out = []
    for i in range(rows):
        stop = ("\n\n\n", "</answer>") if mix == "issue" and i % 3 == 0 else ()
        temperature = 0.7 if mix == "issue" and i % 2 == 1 else 0.0
        out.append(SamplingParams(max_tokens=tokens, ignore_eos=True, stop=stop, seed=i,
                                  temperature=temperature, logprobs=logprobs))
    return out


def load(model: str, max_num_seqs: int, overlap: str) -> LLM:
    if model == "tiny":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from random_models import build

        model = str(build("tiny", TINY_DIR, "cpu"))
    return LLM(model, dtype="float32", device="cpu", max_num_seqs=max_num_seqs,
               kv_cache_memory=2 << 30, overlap={"on": True, "off": False}.get(overlap, "auto"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="an alias, a folder, or tiny")
    p.add_argument("--rows", default="1,4,8")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--mix", choices=("greedy", "issue"), default="greedy")
    p.add_argument("--logprobs", default="0", help="comma-separated: 0,5 runs both")
    p.add_argument("--overlap", choices=("auto", "on", "off"), default="auto",
                   help="engine.overlap (auto: off on the CPU)")
    p.add_argument("--profile", action="store_true", help="cProfile the last run of each")
    p.add_argument("--clock", choices=("wall", "thread"), default="wall",
                   help="thread: every timing (the engine's too) in the main thread's CPU "
                        "time, for a machine other jobs load")
    a = p.parse_args()
    if a.clock == "thread":
        time.perf_counter = time.thread_time  # the engine and runners call time.perf_counter()
    print(f"# load average {os.getloadavg()[0]:.2f}, model {a.model}, mix {a.mix}, "
          f"max_num_seqs {a.max_num_seqs}, {a.tokens} tokens per row, clock {a.clock}, "
          f"overlap {a.overlap}")
    with collector.start_up():  # as `batchllm run`: the start-up heap frozen, out of collections
        llm = load(a.model, a.max_num_seqs, a.overlap)
    spent = timed_model(llm.runtime.loaded.model)
    print(f"{'rows':>5} {'logprobs':>8} {'steps':>6} {'wall ms':>9} {'forward ms':>11} "
          f"{'host ms/step':>13} {'from':>8}")
    for m in (int(r) for r in a.rows.split(",")):
        if a.model == "tiny":
            prompts = [[3 + (i * 7 + j) % 4000 for j in range(12)] for i in range(m)]
        else:
            prompts = [f"Question {i}: what is {i} times {i + 3}? Explain step by step."
                       for i in range(m)]
        for k in (int(x) for x in a.logprobs.split(",")):
            sp = sampling(a.mix, m, a.tokens, k)
            llm.generate(prompts, sampling(a.mix, m, 2, k))  # untimed warm-up at this size
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
                metrics = llm.last_metrics
                steps = metrics["steps"]
                if metrics.get("step_host_seconds"):  # 0 until the step loop reports it
                    host, source = metrics["step_host_seconds"] / steps, "metrics"
                else:
                    host, source = (wall - spent["forward"]) / steps, "measured"
                if prof is None and (best is None or host < best[3]):
                    best = (steps, wall, spent["forward"], host, source)
                if prof:
                    stats = pstats.Stats(prof).sort_stats("tottime")
                    stats.print_stats(r"batchllm/(engine|plan|rows|llm)|sampler|numpy|torch\.", 25)
            steps, wall, forward, host, source = best
            print(f"{m:>5} {k:>8} {steps:>6} {wall * 1e3:9.1f} {forward * 1e3:11.1f} "
                  f"{host * 1e3:13.3f} {source:>8}", flush=True)


if __name__ == "__main__":
    main()
