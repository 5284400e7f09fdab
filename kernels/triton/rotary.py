"""Triton kernel: the rotary embedding of q and k in place, and k and v into the paged cache.

One program per (token, block of heads) of the fused qkv projection's row [Hq | Hkv | Hkv
heads of D]: q and k heads are rotated (rotate-half, cos and sin tables [P, D] with repeated
halves, as Hugging Face builds them) and written back; with STORE, the rotated k heads and the
v heads also go to their slot of the cache (a negative slot is a padding token: not stored).
The store reads the rotated k from registers, not back from memory: one pass instead of the
rotation's chain of torch kernels and a store kernel after it. An FP8 cache is written as
store_kv.py writes it (each KV head divided by its scale, rounded to e4m3).
Rounded as Hugging Face's apply_rotary_pos_emb in the model dtype: cos and sin cast to it, each
product rounded, then their sum.
Twins: `batchllm_kernels.reference.pointwise.rope_ref`, and
`batchllm_kernels.reference.rope_store.rope_store_ref` (that and `store_kv_ref`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchllm_kernels.triton import launch
from batchllm_kernels.triton.checks import (
    cdiv,
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
def _rope_store_kernel(
    qkv_ptr, positions_ptr, cos_ptr, sin_ptr,  # [T, W] (rows strided), [T] int64, [P, D] fp32
    k_cache_ptr, v_cache_ptr, slot_ptr,  # [num_pages * page_size, Hkv, D] contiguous, [T] int64
    k_scale_ptr, v_scale_ptr,  # [Hkv] fp32, read with FP8 only
    stride_t, stride_cos, stride_slot, stride_ch,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
    HEADS: tl.constexpr,  # HQ + HKV, and the HKV v heads after them with STORE
    BLOCK_H: tl.constexpr, HALF: tl.constexpr, STORE: tl.constexpr,
    FP8: tl.constexpr,  # the caches are the uint8 bits of float8_e4m3fn
):
    t = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HALF)
    rotated = offs_h < HQ + HKV  # q and k heads; the v heads after them (with STORE)
    mask = (offs_h < HEADS)[:, None] & (offs_d < D // 2)[None, :]
    dtype = qkv_ptr.dtype.element_ty
    pos = tl.load(positions_ptr + t)
    table = pos * stride_cos + offs_d
    cos1 = tl.load(cos_ptr + table).to(dtype).to(tl.float32)[None, :]
    cos2 = tl.load(cos_ptr + table + D // 2).to(dtype).to(tl.float32)[None, :]
    sin1 = tl.load(sin_ptr + table).to(dtype).to(tl.float32)[None, :]
    sin2 = tl.load(sin_ptr + table + D // 2).to(dtype).to(tl.float32)[None, :]
    row = qkv_ptr + t * stride_t + offs_h[:, None] * D + offs_d[None, :]
    x1 = tl.load(row, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_H, HALF], first halves
    x2 = tl.load(row + D // 2, mask=mask, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1); each product rounded first
    y1 = ((x1 * cos1).to(dtype).to(tl.float32) - (x2 * sin1).to(dtype).to(tl.float32)).to(dtype)
    y2 = ((x2 * cos2).to(dtype).to(tl.float32) + (x1 * sin2).to(dtype).to(tl.float32)).to(dtype)
    y1 = tl.where(rotated[:, None], y1, x1.to(dtype))
    y2 = tl.where(rotated[:, None], y2, x2.to(dtype))
    back = mask & rotated[:, None]
    tl.store(row, y1, mask=back)
    tl.store(row + D // 2, y2, mask=back)
    if STORE:
        slot = tl.load(slot_ptr + t)
        if slot >= 0:
            is_k = (offs_h >= HQ) & rotated
            kv_head = tl.where(is_k, offs_h - HQ, offs_h - HQ - HKV)
            dst = slot * stride_slot + kv_head[:, None] * stride_ch + offs_d[None, :]
            k_mask = mask & is_k[:, None]
            v_mask = mask & (offs_h >= HQ + HKV)[:, None]
            if FP8:
                is_v = (offs_h >= HQ + HKV) & (offs_h < HEADS)
                k_s = tl.load(k_scale_ptr + kv_head, mask=is_k, other=1.0)[:, None]
                v_s = tl.load(v_scale_ptr + kv_head, mask=is_v, other=1.0)[:, None]
                s = tl.where(is_k[:, None], k_s, v_s)
                z1 = encode_e4m3(tl.math.div_rn(y1.to(tl.float32), s))
                z2 = encode_e4m3(tl.math.div_rn(y2.to(tl.float32), s))
            else:
                z1 = y1.to(k_cache_ptr.dtype.element_ty)
                z2 = y2.to(k_cache_ptr.dtype.element_ty)
            tl.store(k_cache_ptr + dst, z1, mask=k_mask)
            tl.store(k_cache_ptr + dst + D // 2, z2, mask=k_mask)
            tl.store(v_cache_ptr + dst, z1, mask=v_mask)
            tl.store(v_cache_ptr + dst + D // 2, z2, mask=v_mask)


def rope_store(
    qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) * D], contiguous in its last dimension
    positions: torch.Tensor,  # [T] int64
    cos: torch.Tensor,  # [P, D] fp32
    sin: torch.Tensor,  # [P, D] fp32
    num_heads: int,  # Hq
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64
    *,
    k_scale: torch.Tensor | None = None,  # [Hkv] fp32: an FP8 cache's scales
    v_scale: torch.Tensor | None = None,
) -> None:
    """Rotate the q and k heads of qkv in place; write k and v at their slots of the cache."""
    launch.run(plan_rope_store(qkv, positions, cos, sin, num_heads, k_cache, v_cache,
                               slot_mapping, k_scale=k_scale, v_scale=v_scale))


def rope_(
    x: torch.Tensor,  # [T, W], the rotated heads first, contiguous in its last dimension
    positions: torch.Tensor,  # [T] int64
    cos: torch.Tensor,  # [P, D] fp32
    sin: torch.Tensor,  # [P, D] fp32
    heads: int,
) -> None:
    """Rotate the first `heads` heads of each row of x in place (PointwiseOps.rope_)."""
    launch.run(plan_rope_store(x, positions, cos, sin, heads))


def plan_rope_store(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, num_heads: int, k_cache: torch.Tensor | None = None,
                    v_cache: torch.Tensor | None = None,
                    slot_mapping: torch.Tensor | None = None, *,
                    k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> list[Launch]:
    """The launch of rope_store; without the cache (None), of rope_ over num_heads heads."""
    if qkv.dim() != 2 or cos.dim() != 2 or cos.shape != sin.shape:
        raise ValueError(f"qkv must be [T, W] and cos, sin [P, D], got {tuple(qkv.shape)}, "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    t, width = qkv.shape
    d = cos.shape[1]
    check_rows("qkv", qkv, (t, width))
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dtype != torch.float32 or not table.is_contiguous():
            raise ValueError(f"{name} must be a contiguous float32 [P, D] table")
    check_index("positions", positions, (t,), torch.int64)
    store = k_cache is not None
    hkv = 0
    tensors = {"qkv": qkv, "positions": positions, "cos": cos, "sin": sin}
    if store:
        _, hkv, cache_d = check_cache(k_cache, v_cache)
        check_index("slot_mapping", slot_mapping, (t,), torch.int64)
        tensors.update(k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
        if cache_d != d or width != (num_heads + 2 * hkv) * d:
            raise ValueError(f"qkv's width {width} must be (Hq + 2 Hkv) * D = ({num_heads} + 2 * "
                             f"{hkv}) * {cache_d} with the cache's head size D = cos's {d}")
    elif d % 2 or num_heads * d > width:
        raise ValueError(f"{num_heads} heads of {d} do not fit a row of {width}")
    check_device(_rope_store_kernel, **tensors)
    heads = num_heads + 2 * hkv
    if t == 0 or heads == 0:
        return []
    # at most 512 pairs a program: 16 heads of 128 spill sm_80's registers (compile_check.py)
    block_h = min(16, pow2(heads), max(1, 512 // pow2(d // 2)))
    fp8 = False
    caches = (qkv, qkv, positions, cos, cos)  # in the place of the cache's, never read
    if store:
        kc, vc, ks, vs, fp8 = kv_operands(k_cache, v_cache, k_scale, v_scale)
        caches = (kc, vc, slot_mapping, ks, vs)
    return [Launch(_rope_store_kernel, (t, cdiv(heads, block_h)), (
        qkv, positions, cos, sin, *caches,
        qkv.stride(0), cos.stride(0), k_cache.stride(1) if store else 0,
        k_cache.stride(2) if store else 0,
    ), {"HQ": num_heads, "HKV": hkv, "D": d, "HEADS": heads, "BLOCK_H": block_h,
        "HALF": pow2(d // 2), "STORE": store, "FP8": fp8})]
