"""Micro-benchmark: the CPU projection kernel (kernels/cpu/linear.c) on SmolLM2-135M's shapes,
with the weights streamed from memory as in a decode step, against this machine's bandwidth.

  python scripts/bench_linear.py                     # bandwidth, then the table for M = 1..64
  python scripts/bench_linear.py --rows 16,32 --repeat 3
  python scripts/bench_linear.py --bandwidth-only

Bandwidth: a sum over a 1 GiB float32 buffer (far beyond the caches) with torch at 1 and 2
threads, the best of --repeat. The projections: 30 layers of distinct packed weights (qkv
576 -> 960, o 576 -> 576, gate_up 576 -> 3072, down 1536 -> 576) and the lm_head 576 -> 49,152,
~538 MB in all, run in the model's order for one step of M rows; each call timed, the best of
--repeat steps kept per shape. The floor of a step is max(bytes / bandwidth, flops / peak): at
these sizes the bytes (the weights read once per step) dominate, so the table shows the step's
time against bytes / bandwidth ("floor %": 100 means the weights streamed at full bandwidth).
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

from kernels.cpu import linear as cpu_linear

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


def make_weights() -> list[tuple[str, torch.Tensor, int]]:
    """(shape name, panels, N) for every projection of one step, in the model's order."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(LAYERS):
        for name, k, n in LAYER_SHAPES:
            out.append((name, cpu_linear.pack_panels(torch.randn(n, k, generator=gen) / k**0.5),
                        n))
    name, k, n = HEAD
    out.append((name, cpu_linear.pack_panels(torch.randn(n, k, generator=gen) / k**0.5), n))
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
    weights = make_weights()
    shapes = [s[0] for s in LAYER_SHAPES] + [HEAD[0]]
    flops_per_row = {s: 0 for s in shapes}
    bytes_of = {s: 0 for s in shapes}
    for name, panels, n in weights:
        flops_per_row[name] += 2 * panels.shape[1] * n
        bytes_of[name] += panels.numel() * 4
    total_bytes = sum(bytes_of.values())
    rate = bw[min(threads, 2)]
    floor_s = total_bytes / (rate * 1e9)
    print(f"# weights {total_bytes / 1e6:.0f} MB: a step's floor at {rate:.1f} GB/s is "
          f"{floor_s * 1e3:.1f} ms")
    print(f"{'M':>3} " + " ".join(f"{s:>8}" for s in shapes)
          + f" {'step ms':>8} {'GFLOP/s':>8} {'floor %':>8}   (GFLOP/s per shape)")
    for m in (int(r) for r in a.rows.split(",")):
        t = step_times(weights, m, a.repeat)
        rates = " ".join(f"{flops_per_row[s] * m / t[s] / 1e9:8.1f}" for s in shapes)
        total = sum(flops_per_row.values()) * m / t["step"] / 1e9
        print(f"{m:>3} {rates} {t['step'] * 1e3:8.2f} {total:8.1f} "
              f"{100 * floor_s / t['step']:8.0f}", flush=True)


if __name__ == "__main__":
    main()
