"""Triton kernel: merge attention states over two disjoint key sets by the log-sum-exp rule.

One program per (token, block of heads). Twin:
`batchllm_kernels.reference.merge_states.merge_states_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchllm_kernels.triton import launch
from batchllm_kernels.triton.checks import cdiv, check_device, check_rows, pow2
from batchllm_kernels.triton.launch import Launch


@triton.jit
def _merge_states_kernel(
    o_a_ptr, lse_a_ptr, o_b_ptr, lse_b_ptr,  # [T, H, D], [T, H]
    o_ptr, lse_ptr,  # [T, H, D], [T, H] fp32, contiguous
    num_heads,
    stride_at, stride_ah, stride_bt, stride_bh,
    stride_lat, stride_lah, stride_lbt, stride_lbh,
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = offs_h < num_heads
    mask = h_ok[:, None] & (offs_d[None, :] < D)
    lse_a = tl.load(lse_a_ptr + t * stride_lat + offs_h * stride_lah, mask=h_ok).to(tl.float32)
    lse_b = tl.load(lse_b_ptr + t * stride_lbt + offs_h * stride_lbh, mask=h_ok).to(tl.float32)
    m = tl.maximum(lse_a, lse_b)
    empty = m == float("-inf")  # both parts empty
    m = tl.where(empty, 0.0, m)
    w_a = tl.exp(lse_a - m)  # 0 for an empty part
    w_b = tl.exp(lse_b - m)
    total = w_a + w_b
    lse = tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, total)))
    denom = tl.where(empty, 1.0, total)
    o_a = tl.load(o_a_ptr + t * stride_at + offs_h[:, None] * stride_ah + offs_d[None, :],
                  mask=mask, other=0.0).to(tl.float32)
    o_b = tl.load(o_b_ptr + t * stride_bt + offs_h[:, None] * stride_bh + offs_d[None, :],
                  mask=mask, other=0.0).to(tl.float32)
    o = o_a * (w_a / denom)[:, None] + o_b * (w_b / denom)[:, None]
    o_off = (t * num_heads + offs_h)[:, None] * D + offs_d[None, :]
    tl.store(o_ptr + o_off, o.to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(lse_ptr + t * num_heads + offs_h, lse, mask=h_ok)


def merge_states(
    o_a: torch.Tensor,  # [T, H, D]
    lse_a: torch.Tensor,  # [T, H] fp32
    o_b: torch.Tensor,  # [T, H, D]
    lse_b: torch.Tensor,  # [T, H] fp32
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,  # (o, lse) to write, contiguous
) -> tuple[torch.Tensor, torch.Tensor]:  # o [T, H, D] (o_a's dtype), lse [T, H] fp32
    """Merge attention over two disjoint key sets by the log-sum-exp rule.

    m = max(lse_a, lse_b); lse = m + log(e^(lse_a-m) + e^(lse_b-m));
    o = e^(lse_a-lse) o_a + e^(lse_b-lse) o_b. A part with lse = -inf contributes nothing;
    two empty parts give o = 0 and lse = -inf (never NaN). `out` may be one of the parts (a
    merge in place: each program reads its rows before it writes them).
    """
    o, lse, launches = plan_merge_states(o_a, lse_a, o_b, lse_b, out=out)
    launch.run(launches)
    return o, lse


def plan_merge_states(
    o_a: torch.Tensor,
    lse_a: torch.Tensor,
    o_b: torch.Tensor,
    lse_b: torch.Tensor,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[Launch]]:
    """The outputs (o, lse) of merge_states and the launches that fill them."""
    if o_a.dim() != 3:
        raise ValueError(f"o_a must be [T, H, D], got shape {tuple(o_a.shape)}")
    t, h, d = o_a.shape
    check_rows("o_a", o_a, (t, h, d))
    check_rows("o_b", o_b, (t, h, d))
    if o_b.dtype != o_a.dtype:
        raise ValueError(f"o_a ({o_a.dtype}) and o_b ({o_b.dtype}) must share a dtype")
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        if tuple(lse.shape) != (t, h) or not lse.dtype.is_floating_point:
            raise ValueError(f"{name} must be float32 of shape {(t, h)}, got {lse.dtype} "
                             f"{tuple(lse.shape)}")
    check_device(_merge_states_kernel, o_a=o_a, lse_a=lse_a, o_b=o_b, lse_b=lse_b)
    if out is None:
        o = torch.empty(t, h, d, dtype=o_a.dtype, device=o_a.device)
        lse = torch.empty(t, h, dtype=torch.float32, device=o_a.device)
    else:
        o, lse = out
        if (tuple(o.shape) != (t, h, d) or o.dtype != o_a.dtype or not o.is_contiguous()
                or tuple(lse.shape) != (t, h) or lse.dtype != torch.float32
                or not lse.is_contiguous()):
            raise ValueError("out must be a contiguous o like o_a and a contiguous float32 lse "
                             f"[T, H], got {o.dtype} {tuple(o.shape)} and {lse.dtype} "
                             f"{tuple(lse.shape)}")
    if t == 0 or h == 0:
        return o, lse, []
    block_h = min(16, pow2(h))
    return o, lse, [Launch(_merge_states_kernel, (t, cdiv(h, block_h)), (
        o_a, lse_a, o_b, lse_b, o, lse, h,
        o_a.stride(0), o_a.stride(1), o_b.stride(0), o_b.stride(1),
        lse_a.stride(0), lse_a.stride(1), lse_b.stride(0), lse_b.stride(1),
    ), {"D": d, "BLOCK_H": block_h, "BLOCK_D": pow2(d)})]
