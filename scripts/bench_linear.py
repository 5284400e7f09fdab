"""Micro-benchmark: the CPU projection kernel (kernels/cpu/linear.c) on SmolLM2-135M's
shapes, with the weights streamed from memory as in a decode step, against this machine's
bandwidth.

  python scripts/bench_linear.py                     # bandwidth, then the table for M = 1..64
  python scripts/bench_linear.py --rows 16,32 --repeat 3
  python scripts/bench_linear.py --cached            # one layer's weights for all 30
  python scripts/bench_linear.py --weights float32   # a float32 checkpoint's values
  python scripts/bench_linear.py --bandwidth-only

Bandwidth: a sum over a 1 GiB float32 buffer (far beyond the caches) with torch at 1 and 2
threads, the best of --repeat. The projections: 30 layers of distinct packed weights (qkv
576 -> 960, o 576 -> 576, gate_up 576 -> 3072, down 1536 -> 576) and the lm_head 576 -> 49,152
as greedy rows take it (its argmax), run in the model's order for one step of M rows, as the
engine runs them, on the FMA tiles from W's float32 panels. The weights are random values of the
checkpoint's kind (--weights): q4_1 (default: llama.cpp's Q4_1 of normal values, d q + m of a
4-bit q and float16 d, m a block of 32, as SmolLM2's layers), float32 or bf16 (the same speed:
the panels are float32 whatever the values). Each call timed, the best of --repeat steps kept
per shape. The floor of a step is max(bytes / bandwidth, flops / peak): the bytes are the
weights' panels read once per step, and the table shows the step's time against bytes /
bandwidth ("floor %": 100 means the weights streamed at full bandwidth).
--cached runs one layer's weights (12 MB) thirty times, so they come from the last-level cache,
not from memory. A streamed step of 17-64 rows takes about its first 16 rows' step plus the
cached step's time past 16 rows: the row tiles after the first, whose weights come from L2, do
not overlap the stream.
Figures only mean something on an idle machine (the script prints the load average).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from batchllm_kernels.cpu import linear as cpu_linear

LAYERS = 30
HIDDEN, INTER, VOCAB = 576, 1536, 49152
# (name, K, N) of one layer's projections (qkv and gate_up fused, as model/layers.py lays them)
LAYER_SHAPES = [("qkv", HIDDEN, 960), ("o", HIDDEN, HIDDEN), ("gate_up", HIDDEN, 2 * INTER),
                ("down", INTER, HIDDEN)]
HEAD = ("lm_head", HIDDEN, VOCAB)


def bandwidth(threads: int, repeat: int, gib: float = 1.0) -> float:
    """GB/s (1e9 bytes) of a streaming read of `gib` GiB at `threads` threads: best of repeat.
    (A C loop of 4 AVX-512 accumulators read at most ~10% faster here: 14.5-15 and 27.5 GB/s.)"""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    buf = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeat + 1):  # the first pass also faults the pages in
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    torch.set_num_threads(old)
    return buf.numel() * 4 / best / 1e9


def checkpoint_values(n: int, k: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    """Random weight [N, K] (K a multiple of 32) whose values are of the checkpoint's kind."""
    w = torch.randn(n, k, generator=gen) / k**0.5
    if kind == "q4_1":  # llama.cpp's Q4_1 of w: d q + m, q in 0..15, m a block of 32's minimum
        blocks = w.view(n, k // 32, 32)  # and d its range / 15, both float16
        lo = blocks.amin(-1, keepdim=True)
        d = ((blocks.amax(-1, keepdim=True) - lo) / 15).half().float()
        q = ((blocks - lo) / d).round().clamp(0, 15)
        return (d * q + lo.half().float()).reshape(n, k)
    return w.bfloat16().float() if kind == "bf16" else w


def make_weights(kind: str, cached: bool) -> list[tuple]:
    """(shape name, panels, N) for every projection of one step, in the model's order; with
    cached, the first layer's weights for every layer."""
    gen = torch.Generator().manual_seed(0)

    def packed(name: str, k: int, n: int) -> tuple:
        return name, cpu_linear.pack_panels(checkpoint_values(n, k, kind, gen)), n

    layer = [packed(name, k, n) for name, k, n in LAYER_SHAPES]
    out = list(layer)
    for _ in range(LAYERS - 1):
        out += layer if cached else [packed(name, k, n) for name, k, n in LAYER_SHAPES]
    out.append(packed(*HEAD))
    return out


def step_times(weights, m: int, repeat: int) -> dict[str, float]:
    """Seconds per shape (summed over the layers) of one step of m rows, best of repeat."""
    xs = {k: torch.randn(m, k) for k in (HIDDEN, INTER)}
    best: dict[str, float] = {}
    for _ in range(repeat + 1):  # one warm-up step
        spent: dict[str, float] = {}
        for name, panels, n in weights:
            x = xs[panels.shape[1]]
            t0 = time.perf_counter()
            if name == HEAD[0]:
                cpu_linear.linear_argmax(x, panels, None, n)
            else:
                cpu_linear.linear(x, panels, None, n)
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
        spent["step"] = sum(spent.values())
        best = {k: min(v, best.get(k, float("inf"))) for k, v in spent.items()}
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,4,8,16,24,32,40,64")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--bandwidth-only", action="store_true")
    p.add_argument("--weights", choices=("q4_1", "float32", "bf16"), default="q4_1",
                   help="the checkpoint's kind of values (default q4_1, as SmolLM2's)")
    p.add_argument("--cached", action="store_true",
                   help="one layer's weights for all 30 (from the last-level cache)")
    p.add_argument("--threads", type=int, default=None,
                   help="threads of the products (default torch's; the floor uses its bandwidth)")
    a = p.parse_args()
    bw = {t: bandwidth(t, a.repeat) for t in (1, 2)}
    if a.threads:
        torch.set_num_threads(a.threads)
    threads = torch.get_num_threads()
    print(f"# load average {os.getloadavg()[0]:.2f}, torch threads {threads}")
    print(f"# streaming read of 1 GiB: 1 thread {bw[1]:.1f} GB/s, 2 threads {bw[2]:.1f} GB/s")
    if a.bandwidth_only:
        return
    weights = make_weights(a.weights, a.cached)
    print(f"# {a.weights} weights, the FMA tiles, float32 panels"
          + (", one layer's weights for all 30 (cached)" if a.cached else ""))
    shapes = [s[0] for s in LAYER_SHAPES] + [HEAD[0]]
    flops_per_row = {s: 0 for s in shapes}
    for name, panels, n in weights:
        flops_per_row[name] += 2 * panels.shape[1] * n
    rate = bw[min(threads, 2)]
    print(f"# floor: the bytes read from memory a step at {rate:.1f} GB/s"
          + (" (cached: the rest from the cache, no floor %)" if a.cached else ""))
    print(f"{'M':>3} " + " ".join(f"{s:>8}" for s in shapes)
          + f" {'step ms':>8} {'GFLOP/s':>8} {'MB':>6} {'floor %':>8}   (GFLOP/s per shape)")
    for m in (int(r) for r in a.rows.split(",")):
        seen, total_bytes = set(), 0
        for _, panels, _ in weights:
            if id(panels) not in seen:  # cached: the same weight read again comes from cache
                total_bytes += panels.numel() * 4
                seen.add(id(panels))
        t = step_times(weights, m, a.repeat)
        rates = " ".join(f"{flops_per_row[s] * m / t[s] / 1e9:8.1f}" for s in shapes)
        total = sum(flops_per_row.values()) * m / t["step"] / 1e9
        floor_s = total_bytes / (rate * 1e9)
        floor = "-" if a.cached else f"{100 * floor_s / t['step']:.0f}"
        print(f"{m:>3} {rates} {t['step'] * 1e3:8.2f} {total:8.1f} {total_bytes / 1e6:6.0f} "
              f"{floor:>8}", flush=True)


if __name__ == "__main__":
    main()
