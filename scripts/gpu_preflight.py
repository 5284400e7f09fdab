"""scripts/gpu_check.sh's preflight, 20 s at most: the versions, the packages the GPU path
imports (not vllm, polars, gguf or llguidance: the device image lacks them), one Triton kernel
run, one CUDA graph captured and replayed. Exit 1 at the first failure, naming it.

    python scripts/gpu_preflight.py [--device cuda|cpu]

--device cpu (GPU_CHECK_SMOKE): the Triton kernel in the interpreter, no graph capture.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

NEEDED = ("torch", "triton", "transformers", "safetensors", "tokenizers", "numpy", "pyarrow",
          "huggingface_hub", "pytest")


def fail(what: str) -> int:
    print(f"PREFLIGHT FAILED: {what}", flush=True)
    return 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    missing = [m for m in NEEDED if importlib.util.find_spec(m) is None]
    if missing:
        return fail(f"missing Python packages: {' '.join(missing)}")
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch
    import transformers
    import triton
    import triton.language as tl

    print("python", sys.version.split()[0], "torch", torch.__version__, "triton",
          triton.__version__, "transformers", transformers.__version__, "cuda", torch.version.cuda,
          torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device",
          flush=True)
    if args.device == "cuda" and not torch.cuda.is_available():
        return fail("no CUDA device")

    @triton.jit
    def add_one(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)

    x = torch.arange(100, dtype=torch.float32, device=args.device)
    add_one[(1,)](x, 100, BLOCK=128)
    if not torch.equal(x.cpu(), torch.arange(1, 101, dtype=torch.float32)):
        return fail("a Triton kernel ran with a wrong result")
    print("triton kernel: ok", flush=True)
    if args.device != "cuda":
        print("cuda graph: skipped (no CUDA device in a smoke run)")
        return 0
    static = torch.zeros(64, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the capture, as capture requires
        out = static * 2 + 1
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = static * 2 + 1
    static.fill_(3)
    graph.replay()
    torch.cuda.synchronize()
    if not bool((out == 7).all()):
        return fail("a replayed CUDA graph gave a wrong result")
    print("cuda graph: captured and replayed, ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
