"""Pure-torch twin of the Triton store (kernels/triton/store_kv.py) and of the C one
(kernels/cpu/ops.py): a step's new K and V into their slots of the paged cache.

Cache layout (one pair per layer): k_cache, v_cache of shape [num_pages, page_size, Hkv, D].
A token at position p of a sequence lives in slot page_table[p // page_size] * page_size
+ p % page_size. An FP8 cache (float8_e4m3fn) stores each KV head scaled (kv_fp8.py).
"""

from __future__ import annotations

import torch

from batchllm_kernels.reference.kv_fp8 import is_fp8, quantize_kv


def store_kv_ref(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64
    *,
    k_scale: torch.Tensor | None = None,  # [Hkv] fp32, an FP8 cache's (kv_fp8.py)
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write each token's K and V into its slot of the paged cache."""
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    if is_fp8(k_cache):  # torch has no index_copy_ for float8: the bytes are copied
        k = quantize_kv(k, k_scale).view(torch.uint8)
        v = quantize_kv(v, v_scale).view(torch.uint8)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    k_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
