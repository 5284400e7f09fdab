"""The rotary embedding and the KV store as one op (ModelOps.rope_store), composed from a rotary
op and a store: the twin of the Triton kernel that does both in one pass
(kernels/triton/rotary.py), and the CPU path's op (from the C or the torch pair).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from batchllm_kernels.reference.pointwise import rope_ref
from batchllm_kernels.reference.store_kv import store_kv_ref


def rope_then_store(rope_: Callable, store_kv: Callable) -> Callable:
    """rope_store from `rope_` (PointwiseOps.rope_) and `store_kv` (ModelOps.store_kv)."""

    def rope_store(
        qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) * D]
        positions: torch.Tensor,  # [T] int64
        cos: torch.Tensor,  # [P, D] fp32
        sin: torch.Tensor,
        num_heads: int,  # Hq
        k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T] int64
        **scales: torch.Tensor,  # k_scale, v_scale [Hkv] fp32 of an FP8 cache
    ) -> None:
        """Rotate the q and k heads of qkv in place; write k and v at their slots."""
        t, hkv, d = qkv.shape[0], k_cache.shape[2], k_cache.shape[3]
        rope_(qkv, positions, cos, sin, num_heads + hkv)
        k = qkv[:, num_heads * d : (num_heads + hkv) * d].view(t, hkv, d)
        v = qkv[:, (num_heads + hkv) * d :].view(t, hkv, d)
        store_kv(k, v, k_cache, v_cache, slot_mapping, **scales)

    return rope_store


rope_store_ref = rope_then_store(rope_ref, store_kv_ref)
