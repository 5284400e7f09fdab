"""The CPU decode kernel (decode.c), built and loaded by build.py.

Why C: the torch twin of decode attention must gather every sequence's keys and values out of
the pages into a padded copy before its products (reading them three times); the kernel reads
them once, in place. On this project's 2-core machine it is 2.5-4x faster for 40 sequences of
~500 tokens. Prefill chunks have their own kernel (prefill.c).
Without a compiler, or with BATCHLLM_CPU_KERNEL=0, `load()` returns None and the twin runs.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from batchllm_kernels.cpu.build import load_library
from batchllm_kernels.cpu.checks import attention_args


@functools.cache
def load() -> ctypes.CDLL | None:
    """The built kernel, or None where it cannot be built (a warning says why, once)."""
    lib = load_library("decode", "the CPU decode kernel")
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.cpu_decode_limits.argtypes = [i64, i64]
    lib.cpu_decode_attention.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64,
                                         i64, i64, i64, i64, ctypes.c_float, i64, ctypes.c_float,
                                         ptr, ptr]
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
    window: int = 0,
    softcap: float = 0.0,
) -> None:
    """Each one-query sequence's query against its keys kv_start .. context_len - 1 (the last
    `window` of them when window > 0; scores soft-capped when softcap > 0)."""
    q, (table, ctx, start, seqs, rows) = attention_args(
        "decode_attention", q, (k_cache, v_cache, o, lse),
        (page_table, context_lens, kv_start, seqs, rows))
    _, hq, d = q.shape
    load().cpu_decode_attention(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(),
        table.shape[1], ctx.data_ptr(), start.data_ptr(), seqs.data_ptr(), rows.data_ptr(),
        seqs.shape[0], hq, k_cache.shape[2], d, k_cache.shape[1], scale, window, softcap,
        o.data_ptr(), lse.data_ptr())
