"""The CPU prefill-chunk and shared-prefix attention kernel (prefill.c), built and loaded by
build.py.

Why C: torch's flash kernel needs each chunk's keys and values gathered out of the pages and its
key heads repeated for grouped queries, and runs its blocks through small matrix products; the
kernel reads the pages in place, skips the key blocks a causal query block cannot see, and keeps
its tiles in registers (1.9x torch's flash kernel on 18 prompts of 440 tokens, 2 cores). A shared
prefix's group of queries runs the same way, merged into its own part's result in the same pass.
Without a compiler, with BATCHLLM_CPU_KERNEL=0 or a head size that is not a multiple of 16, the
torch path (kernels/reference/paged_attention.py's attend_chunks) runs.
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
    lib = load_library("prefill", "the CPU prefill attention kernel")
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.cpu_prefill_supports.argtypes = [i64]
    lib.cpu_prefill_attention.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64,
                                          i64, i64, i64, i64, ctypes.c_float, i64,
                                          ctypes.c_float, ptr, ptr]
    lib.cpu_prefill_attention.restype = None
    lib.cpu_prefix_attention.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64,
                                         i64, i64, ctypes.c_float, ctypes.c_float, ptr, ptr]
    lib.cpu_prefix_attention.restype = None
    return lib


def supports(dtype: torch.dtype, head_dim: int) -> bool:
    """float32, a head size that is a multiple of 16, and the kernel built."""
    lib = load() if dtype == torch.float32 else None
    return lib is not None and bool(lib.cpu_prefill_supports(head_dim))


def prefill_attention(
    q: torch.Tensor,  # [T, Hq, D] fp32
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D] fp32, contiguous
    v_cache: torch.Tensor,
    page_table: torch.Tensor,  # [B, max_pages] int32
    cu_q: torch.Tensor,  # [B+1] int32
    context_lens: torch.Tensor,  # [B] int32
    kv_start: torch.Tensor,  # [B] int32
    seqs: torch.Tensor,  # [n] int32, the sequences with several queries
    scale: float,
    o: torch.Tensor,  # [T, Hq, D] fp32, written at those sequences' rows
    lse: torch.Tensor,  # [T, Hq] fp32, written at those sequences' rows
    window: int = 0,
    softcap: float = 0.0,
) -> None:
    """Each chunk's queries against its keys kv_start .. the query's own position (causal; the
    last `window` of them when window > 0; scores soft-capped when softcap > 0)."""
    q, (table, cu, ctx, start, seqs) = attention_args(
        "prefill_attention", q, (k_cache, v_cache, o, lse),
        (page_table, cu_q, context_lens, kv_start, seqs))
    _, hq, d = q.shape
    load().cpu_prefill_attention(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(),
        table.shape[1], cu.data_ptr(), ctx.data_ptr(), start.data_ptr(), seqs.data_ptr(),
        seqs.shape[0], hq, k_cache.shape[2], d, k_cache.shape[1], scale, window, softcap,
        o.data_ptr(), lse.data_ptr())


def prefix_attention_into(
    q: torch.Tensor,  # [T, Hq, D] fp32
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D] fp32, contiguous
    v_cache: torch.Tensor,
    prefix_pages: torch.Tensor,  # [G, max_pages] int32
    prefix_lens: torch.Tensor,  # [G] int32
    cu_q: torch.Tensor,  # [G+1] int32, query rows of group g: cu_q[g]:cu_q[g+1]
    scale: float,
    o: torch.Tensor,  # [T, Hq, D] fp32: the rows' own part in, both parts merged out
    lse: torch.Tensor,  # [T, Hq] fp32, likewise
    *,
    softcap: float = 0.0,
) -> None:
    """Each group's queries against all its prefix keys, merged into the state o and lse hold:
    prefix_attention_ref + merge_states_ref in one pass."""
    q, (pages, lens, cu) = attention_args("prefix_attention_into", q, (k_cache, v_cache, o, lse),
                                          (prefix_pages, prefix_lens, cu_q))
    _, hq, d = q.shape
    load().cpu_prefix_attention(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), pages.data_ptr(),
        pages.shape[1], cu.data_ptr(), lens.data_ptr(), lens.shape[0], hq, k_cache.shape[2], d,
        k_cache.shape[1], scale, softcap, o.data_ptr(), lse.data_ptr())

