"""Micro-benchmark: one decode step of a group of requests that share a long prompt prefix.

Three ways to attend (all in one step, one query per request, page size 16):
  cascade  prefix_attention over the shared prefix pages (read once per query tile)
           + paged_attention over each request's own pages (kv_start = prefix length)
           + merge_states
  paged    paged_attention per request over its whole context (the prefix read R times)
  sdpa     gather each request's pages into contiguous K/V, then torch's
           scaled_dot_product_attention (and sdpa alone, the gather excluded)
On CUDA, times come from triton.testing.do_bench (eager: includes Python launch overhead)
and do_bench_cudagraph (GPU time); the issue's goal is cascade >= 3x faster than paged.

  python scripts/bench_kernels.py                        # H200: 32 requests, 2,048 + 64 tokens
  python scripts/bench_kernels.py --device cpu --interpret   # tiny smoke check, no GPU
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--interpret", action="store_true",
                   help="run the kernels in Triton's interpreter (set before triton is imported)")
    p.add_argument("--requests", type=int, default=None, help="requests in the group (32)")
    p.add_argument("--prefix", type=int, default=None, help="shared prefix tokens (2048)")
    p.add_argument("--own", type=int, default=None, help="own tokens per request (64)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--heads", default=None,
                   help="Hq/Hkv/D configurations, comma separated (32/8/128,32/8/64,9/3/64)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="bfloat16 on CUDA; float32 on the CPU (the interpreter's tl.dot "
                   "mishandles bfloat16)")
    args = p.parse_args()
    tiny = args.device == "cpu"
    if tiny and not args.interpret:
        p.error("--device cpu needs --interpret (the Triton kernels only run on CUDA otherwise)")
    args.dtype = args.dtype or ("float32" if tiny else "bfloat16")
    args.requests = args.requests or (4 if tiny else 32)
    args.prefix = args.prefix or (64 if tiny else 2048)
    args.own = args.own or (8 if tiny else 64)
    args.heads = args.heads or ("4/2/64,9/3/64" if tiny else "32/8/128,32/8/64,9/3/64")
    return args


ARGS = parse_args()
if ARGS.interpret:
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
import triton.testing

from batchllm_kernels.triton.merge_states import merge_states
from batchllm_kernels.triton.paged_attention import paged_attention
from batchllm_kernels.triton.prefix_attention import prefix_attention


def make_step(r: int, prefix: int, own: int, page_size: int, hq: int, hkv: int, d: int,
              dtype: torch.dtype, device: str) -> dict:
    """A paged cache where R requests share `prefix` tokens (whole pages) and own `own` more."""
    assert prefix % page_size == 0, "the shared prefix must fill whole pages"
    g = torch.Generator().manual_seed(0)
    shared = prefix // page_size
    own_pages = -(-own // page_size)
    num_pages = shared + r * own_pages
    perm = torch.randperm(num_pages, generator=g).int()
    own_ids = perm[shared:].view(r, own_pages)
    table = torch.cat([perm[:shared].expand(r, shared), own_ids], 1)  # [R, max_pages]
    shape = (num_pages, page_size, hkv, d)
    ctx = prefix + own
    i32 = {"dtype": torch.int32, "device": device}
    return {
        "q": torch.randn(r, hq, d, generator=g).to(dtype).to(device),  # [R, Hq, D]
        "k_cache": torch.randn(shape, generator=g).to(dtype).to(device),
        "v_cache": torch.randn(shape, generator=g).to(dtype).to(device),
        "table": table.contiguous().to(device),
        "prefix_pages": perm[:shared][None].contiguous().to(device),  # [1, shared]
        "prefix_lens": torch.tensor([prefix], **i32),
        "cu_group": torch.tensor([0, r], **i32),
        "cu_q": torch.arange(r + 1, **i32),
        "ctx": torch.full((r,), ctx, **i32),
        "start_own": torch.full((r,), prefix, **i32),
        "start_all": torch.zeros(r, **i32),
        # slots of every request's context, for the gathered-pages baseline
        "slots": (table.long().repeat_interleave(page_size, 1) * page_size
                  + torch.arange(page_size).repeat(table.shape[1]))[:, :ctx].to(device),
        "scale": d**-0.5,
    }


def cascade(s: dict):
    o_p, l_p = prefix_attention(s["q"], s["k_cache"], s["v_cache"], s["prefix_pages"],
                                s["prefix_lens"], s["cu_group"], s["scale"])
    o_s, l_s = paged_attention(s["q"], s["k_cache"], s["v_cache"], s["table"], s["cu_q"],
                               s["ctx"], s["start_own"], s["scale"])
    return merge_states(o_p, l_p, o_s, l_s)


def paged(s: dict):
    return paged_attention(s["q"], s["k_cache"], s["v_cache"], s["table"], s["cu_q"], s["ctx"],
                           s["start_all"], s["scale"])


def gather(s: dict):
    """Each request's K and V as contiguous [R, Hkv, ctx, D]."""
    hkv, d = s["k_cache"].shape[2:]
    k = s["k_cache"].view(-1, hkv, d)[s["slots"]].transpose(1, 2)
    v = s["v_cache"].view(-1, hkv, d)[s["slots"]].transpose(1, 2)
    return k, v


def sdpa(s: dict, kv=None):
    k, v = kv if kv is not None else gather(s)
    q = s["q"][:, :, None]  # [R, Hq, 1, D]
    try:
        o = F.scaled_dot_product_attention(q, k, v, scale=s["scale"], enable_gqa=True)
    except TypeError:  # torch < 2.5: no enable_gqa
        g = q.shape[1] // k.shape[1]
        o = F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1),
                                           v.repeat_interleave(g, 1), scale=s["scale"])
    return o[:, :, 0]


def timed(fn, device: str) -> tuple[float, float | None]:
    """(eager ms, CUDA-graph ms or None) per call."""
    if device != "cuda":
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3, None
    eager = triton.testing.do_bench(fn, warmup=25, rep=100)
    graph = triton.testing.do_bench_cudagraph(fn, rep=100)
    return eager, graph


def main() -> None:
    a = ARGS
    dtype = getattr(torch, a.dtype)
    print(f"# {a.requests} requests, prefix {a.prefix}, own {a.own}, page {a.page_size}, "
          f"{a.dtype}, device {a.device}{' (interpreter)' if a.interpret else ''}"
          + (f", {torch.cuda.get_device_name()}" if a.device == "cuda" else ""))
    head = (f"{'Hq/Hkv/D':>10} {'method':>12} {'eager ms':>10} {'graph ms':>10} "
            f"{'x cascade':>10} {'max|diff|':>10}")
    print(head)
    worst = float("inf")
    for cfg in a.heads.split(","):
        hq, hkv, d = (int(x) for x in cfg.split("/"))
        s = make_step(a.requests, a.prefix, a.own, a.page_size, hq, hkv, d, dtype, a.device)
        expected = sdpa(s).float()
        kv = gather(s)
        methods = {
            "cascade": lambda s=s: cascade(s)[0],
            "paged": lambda s=s: paged(s)[0],
            "sdpa+gather": lambda s=s: sdpa(s),
            "sdpa": lambda s=s, kv=kv: sdpa(s, kv),
            "  prefix": lambda s=s: prefix_attention(
                s["q"], s["k_cache"], s["v_cache"], s["prefix_pages"], s["prefix_lens"],
                s["cu_group"], s["scale"]),
            "  own part": lambda s=s: paged_attention(
                s["q"], s["k_cache"], s["v_cache"], s["table"], s["cu_q"], s["ctx"],
                s["start_own"], s["scale"]),
        }
        base = None
        for name, fn in methods.items():
            eager, graph = timed(fn, a.device)
            t = graph if graph is not None else eager
            base = base or t
            out = fn()
            diff = "" if name.startswith(" ") else f"{(out.float() - expected).abs().max():.1e}"
            print(f"{cfg:>10} {name:>12} {eager:10.4f} {graph or float('nan'):10.4f} "
                  f"{t / base:10.2f} {diff:>10}")
            if name == "paged":
                worst = min(worst, t / base)
    print(f"# cascade speed-up over per-request paged attention: at least {worst:.2f}x "
          f"(goal 3x){'' if a.device == 'cuda' else ' -- CPU/interpreter figures mean nothing'}")


if __name__ == "__main__":
    main()
