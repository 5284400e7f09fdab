"""Triton kernel: the residual add and RMSNorm in one pass (h += delta; out = w * norm(h)).

One program per token row. Rounded as Hugging Face's LlamaRMSNorm and its residual add in the
model dtype: the sum rounded to h's dtype, the variance and the scaling in float32, the
normalised row cast to the dtype before the weight multiplies it.
Twin: `batchllm_kernels.reference.pointwise.add_rms_norm_ref` (torch runs it as ~8 kernels).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchllm_kernels.triton import launch
from batchllm_kernels.triton.checks import check_device, check_rows, pow2
from batchllm_kernels.triton.launch import Launch


@triton.jit
def _add_rms_norm_kernel(
    h_ptr, delta_ptr, w_ptr, out_ptr,  # [T, H] (rows strided), [T, H], [H], [T, H] contiguous
    eps, stride_h, stride_delta,
    H: tl.constexpr, BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr,
):
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(h_ptr + t * stride_h + offs, mask=mask, other=0.0)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + t * stride_delta + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + delta.to(tl.float32)).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + t * stride_h + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, 0) / H + eps)
    y = (x32 * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + offs, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(
    h: torch.Tensor,  # [T, H], the residual stream, updated in place
    delta: torch.Tensor | None,  # [T, H] or None
    weight: torch.Tensor,  # [H]
    eps: float,
) -> torch.Tensor:  # [T, H], h's dtype
    """h += delta (when given), then RMSNorm of h times weight."""
    out, launches = plan_add_rms_norm(h, delta, weight, eps)
    launch.run(launches)
    return out


def plan_add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, list[Launch]]:
    """The output of add_rms_norm and the launch that fills it."""
    if h.dim() != 2:
        raise ValueError(f"h must be [T, H], got shape {tuple(h.shape)}")
    t, width = h.shape
    check_rows("h", h, (t, width))
    check_rows("weight", weight, (width,))
    tensors = {"h": h, "weight": weight}
    if delta is not None:
        check_rows("delta", delta, (t, width))
        tensors["delta"] = delta
    check_device(_add_rms_norm_kernel, **tensors)
    out = torch.empty(t, width, dtype=h.dtype, device=h.device)
    if t == 0:
        return out, []
    block = pow2(width)
    # A row per program: more warps for wide rows keep the registers per thread in bounds.
    warps = 4 if block <= 1024 else 8 if block <= 4096 else 16
    return out, [Launch(_add_rms_norm_kernel, (t,), (
        h, h if delta is None else delta, weight, out, eps,
        h.stride(0), 0 if delta is None else delta.stride(0),
    ), {"H": width, "BLOCK": block, "HAS_DELTA": delta is not None, "num_warps": warps})]
