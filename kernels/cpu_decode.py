"""The CPU decode kernel (cpu_decode.c): built with the system C compiler on first use, cached,
called through ctypes.

Why C: the torch twin of decode attention must gather every sequence's keys and values out of
the pages into a padded copy before its products (reading them three times); the kernel reads
them once, in place. On this project's 2-core machine it is 2.5-4x faster for 40 sequences of
~500 tokens. Prefill chunks and shared prefixes keep torch's fused flash kernel (reference.py).

Built with `$CC` (default `cc`) -O3 -march=native -fopenmp into $BATCHLLM_CACHE/kernels (default
~/.cache/batchllm/kernels), keyed by the source, flags, compiler and CPU; OpenMP is torch's own
runtime (libgomp from torch/lib, already loaded), so torch's thread count applies. Without a
compiler, or with BATCHLLM_CPU_KERNEL=0, `load()` returns None and the twin runs.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from kernels.reference import attend_chunks
from kernels.step_index import StepIndex

_SOURCE = Path(__file__).with_name("cpu_decode.c")
_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fPIC", "-shared")


def _torch_omp() -> Path | None:
    """torch's bundled libgomp.so.1, or None (then the kernel is built without OpenMP)."""
    lib = Path(torch.__file__).parent / "lib"
    return lib if (lib / "libgomp.so.1").exists() else None


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return "".join(line for line in f if line.startswith(("model name", "flags")))
    except OSError:
        return platform.processor()


def _build(compiler: str) -> Path:
    omp = _torch_omp()
    flags = list(_FLAGS) + (["-fopenmp", f"-Wl,-rpath,{omp}"] if omp else [])
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             check=True).stdout
    key = hashlib.sha256("\0".join([_SOURCE.read_text(), *flags, version, platform.machine(),
                                    _cpu_id()]).encode()).hexdigest()[:16]
    env = os.environ.get("BATCHLLM_CACHE")
    folder = (Path(env).expanduser() if env else Path.home() / ".cache" / "batchllm") / "kernels"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        folder = Path(tempfile.gettempdir())
    target = folder / f"cpu_decode-{key}.so"
    if not target.exists():
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
        os.close(fd)
        try:
            subprocess.run([compiler, *flags, str(_SOURCE), "-o", tmp], check=True,
                           capture_output=True, text=True)
            os.replace(tmp, target)  # atomic: another process may build the same key
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


@functools.cache
def load() -> ctypes.CDLL | None:
    """The built kernel, or None where it cannot be built (a warning says why, once)."""
    if os.environ.get("BATCHLLM_CPU_KERNEL", "1") == "0":
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    try:
        if compiler is None:
            raise OSError("no C compiler (set CC, or install gcc)")
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or e
        print(f"batchllm: the CPU decode kernel could not be built ({detail}); decoding uses the "
              "slower torch path", file=sys.stderr)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.cpu_decode_limits.argtypes = [i64, i64]
    lib.cpu_decode_attention.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64, i64,
                                         i64, i64, i64, ctypes.c_float, ptr, ptr]
    lib.cpu_decode_attention.restype = None
    return lib


def supports(dtype: torch.dtype, num_q_heads: int, head_dim: int) -> bool:
    """Whether the kernel can run this cache (float32, within its fixed buffers) and is built.
    Any page size and any number of KV heads that divides num_q_heads works."""
    lib = load() if dtype == torch.float32 else None
    return lib is not None and bool(lib.cpu_decode_limits(num_q_heads, head_dim))


def decode_attention(
    q: torch.Tensor,  # [T, Hq, D] fp32
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D] fp32, contiguous
    v_cache: torch.Tensor,
    page_table: torch.Tensor,  # [B, max_pages] int32
    context_lens: torch.Tensor,  # [B] int32
    kv_start: torch.Tensor,  # [B] int32
    seqs: torch.Tensor,  # [n] int32, the one-query sequences
    rows: torch.Tensor,  # [n] int32, their query rows
    scale: float,
    o: torch.Tensor,  # [T, Hq, D] fp32, written at `rows`
    lse: torch.Tensor,  # [T, Hq] fp32, written at `rows`
) -> None:
    """Each one-query sequence's query against its keys kv_start .. context_len - 1."""
    q = q.contiguous()
    tables = [page_table.contiguous(), context_lens.contiguous(), kv_start.contiguous(),
              seqs.contiguous(), rows.contiguous()]
    for t in (k_cache, v_cache, o, lse):
        if not t.is_contiguous():
            raise ValueError("decode_attention: caches and outputs must be contiguous")
    if any(t.dtype != torch.int32 for t in tables):
        raise TypeError("decode_attention: page tables, lengths and indices are int32")
    table, ctx, start, seqs, rows = tables
    _, hq, d = q.shape
    load().cpu_decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(), table.shape[1],
        ctx.data_ptr(), start.data_ptr(), seqs.data_ptr(), rows.data_ptr(), seqs.shape[0], hq,
        k_cache.shape[2], d, k_cache.shape[1], scale, o.data_ptr(), lse.data_ptr())


def paged_attention_cpu(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,
    page_table: torch.Tensor,  # [B, max_pages] int32
    cu_q: torch.Tensor,  # [B+1] int32
    context_lens: torch.Tensor,  # [B] int32
    kv_start: torch.Tensor,  # [B] int32
    scale: float,
    step: StepIndex,  # index_step(..., gather_decodes=False)
) -> tuple[torch.Tensor, torch.Tensor]:  # o [T, Hq, D], lse [T, Hq] fp32
    """paged_attention_ref with its decodes in C: same arguments, same results (to rounding)."""
    t, hq, d = q.shape
    o = q.new_zeros(t, hq, d)
    lse = torch.full((t, hq), float("-inf"), dtype=torch.float32)
    if len(step.decode_seqs):
        decode_attention(q, k_cache, v_cache, page_table, context_lens, kv_start,
                         step.decode_seqs, step.decode_rows, scale, o, lse)
    attend_chunks(q, k_cache, v_cache, step, scale, o, lse)
    return o, lse
