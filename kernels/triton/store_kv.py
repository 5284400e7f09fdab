"""Triton kernel: write a step's new K and V into their slots of the paged cache.

An FP8 cache (float8_e4m3fn, written through its uint8 view) holds each KV head's values
divided by its scale, rounded to e4m3 (kernels/triton/fp8.py). Twin:
`batchllm_kernels.reference.store_kv.store_kv_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchllm_kernels.triton import launch
from batchllm_kernels.triton.checks import (
    check_cache,
    check_device,
    check_index,
    check_rows,
    kv_operands,
    pow2,
)
from batchllm_kernels.triton.fp8 import encode_e4m3
from batchllm_kernels.triton.launch import Launch


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr,  # [T, Hkv, D]
    k_cache_ptr, v_cache_ptr,  # [num_pages * page_size, Hkv, D], contiguous
    slot_ptr,  # [T] int64
    k_scale_ptr, v_scale_ptr,  # [Hkv] fp32, read with FP8 only
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_slot, stride_ch,
    HKV: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,  # the caches are the uint8 bits of float8_e4m3fn
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # a padding slot: nothing to write
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < HKV) & (offs_d[None, :] < D)
    dst = slot * stride_slot + offs_h[:, None] * stride_ch + offs_d[None, :]
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    if FP8:
        k_scale = tl.load(k_scale_ptr + offs_h, mask=offs_h < HKV, other=1.0)[:, None]
        v_scale = tl.load(v_scale_ptr + offs_h, mask=offs_h < HKV, other=1.0)[:, None]
        tl.store(k_cache_ptr + dst, encode_e4m3(tl.math.div_rn(k.to(tl.float32), k_scale)),
                 mask=mask)
        tl.store(v_cache_ptr + dst, encode_e4m3(tl.math.div_rn(v.to(tl.float32), v_scale)),
                 mask=mask)
    else:
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64
    *,
    k_scale: torch.Tensor | None = None,  # [Hkv] fp32: an FP8 cache's scales
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write each token's K and V into slot page * page_size + offset of the paged cache.

    K and V are cast to the cache dtype (an FP8 cache: x / scale of its KV head, rounded to
    e4m3). A negative slot is skipped (a padding token).
    """
    launch.run(plan_store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale=k_scale,
                             v_scale=v_scale))


def plan_store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                  k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None) -> list[Launch]:
    """The launches of store_kv."""
    _, hkv, d = check_cache(k_cache, v_cache)
    t = k.shape[0] if k.dim() == 3 else -1
    check_rows("k", k, (t, hkv, d))
    check_rows("v", v, (t, hkv, d))
    check_index("slot_mapping", slot_mapping, (t,), torch.int64)
    check_device(_store_kv_kernel, k=k, v=v, k_cache=k_cache, v_cache=v_cache,
                 slot_mapping=slot_mapping)
    kc, vc, ks, vs, fp8 = kv_operands(k_cache, v_cache, k_scale, v_scale)
    if t == 0:
        return []
    return [Launch(_store_kv_kernel, (t,), (
        k, v, kc, vc, slot_mapping, ks, vs,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(1), k_cache.stride(2),
    ), {"HKV": hkv, "D": d, "BLOCK_H": pow2(hkv), "BLOCK_D": pow2(d), "FP8": fp8})]
