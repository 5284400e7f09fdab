"""Triton kernel: SiLU-and-multiply of the fused gate-up projection, silu(gate) * up.

One program per (token, block of columns). Rounded as Hugging Face's MLP in the model dtype:
silu(gate) rounded to it, then the product.
Twin: `kernels.reference.pointwise.silu_mul_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton import launch
from kernels.triton.checks import cdiv, check_device, check_rows
from kernels.triton.launch import Launch

_BLOCK = 1024  # columns per program


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr, out_ptr,  # [T, 2I] (rows strided), [T, I] contiguous
    width, stride_t,  # I
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < width
    gate = tl.load(gate_up_ptr + t * stride_t + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + t * stride_t + width + offs, mask=mask, other=0.0)
    dtype = out_ptr.dtype.element_ty
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + t * width + offs, (silu * up.to(tl.float32)).to(dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """silu(gate_up[:, :I]) * gate_up[:, I:]."""
    out, launches = plan_silu_mul(gate_up)
    launch.run(launches)
    return out


def plan_silu_mul(gate_up: torch.Tensor) -> tuple[torch.Tensor, list[Launch]]:
    """The output of silu_mul and the launch that fills it."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [T, 2I], got shape {tuple(gate_up.shape)}")
    t, width = gate_up.shape[0], gate_up.shape[1] // 2
    check_rows("gate_up", gate_up, (t, 2 * width))
    check_device(_silu_mul_kernel, gate_up=gate_up)
    out = torch.empty(t, width, dtype=gate_up.dtype, device=gate_up.device)
    if t == 0 or width == 0:
        return out, []
    return out, [Launch(_silu_mul_kernel, (t, cdiv(width, _BLOCK)),
                        (gate_up, out, width, gate_up.stride(0)), {"BLOCK": _BLOCK})]
