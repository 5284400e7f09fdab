"""Triton kernel: a gated MLP's activation-and-multiply of the fused gate-up projection,
act(gate) * up, with act SiLU (Llama, Qwen, Mistral, Phi) or GELU-tanh (Gemma).

One program per (token, block of columns). Rounded as Hugging Face's MLP in the model dtype:
act(gate) rounded to it, then the product.
Twins: `batchllm_kernels.reference.pointwise.silu_mul_ref`, `gelu_tanh_mul_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchllm_kernels.triton import launch
from batchllm_kernels.triton.checks import cdiv, check_device, check_rows
from batchllm_kernels.triton.launch import Launch

_BLOCK = 1024  # columns per program
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _gated_mul_kernel(
    gate_up_ptr, out_ptr,  # [T, 2I] (rows strided), [T, I] contiguous
    width, stride_t,  # I
    GELU_TANH: tl.constexpr,  # False: SiLU
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < width
    gate = tl.load(gate_up_ptr + t * stride_t + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + t * stride_t + width + offs, mask=mask, other=0.0)
    dtype = out_ptr.dtype.element_ty
    if GELU_TANH:
        # 0.5 g (1 + tanh(u)), u = sqrt(2/pi) (g + 0.044715 g^3); tanh(u) = 1 - 2 / (1 + e^(2u)),
        # with e^(2u) clamped so that a large u gives 1, not inf / inf
        u = _SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate)
        e = tl.exp2(tl.minimum(2.0 * _LOG2E * u, 126.0))
        act = 0.5 * gate * (2.0 - 2.0 / (1.0 + e))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    act = act.to(dtype).to(tl.float32)
    tl.store(out_ptr + t * width + offs, (act * up.to(tl.float32)).to(dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """silu(gate_up[:, :I]) * gate_up[:, I:]."""
    out, launches = plan_gated_mul(gate_up, gelu_tanh=False)
    launch.run(launches)
    return out


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """gelu(gate_up[:, :I], approximate="tanh") * gate_up[:, I:]."""
    out, launches = plan_gated_mul(gate_up, gelu_tanh=True)
    launch.run(launches)
    return out


def plan_gated_mul(gate_up: torch.Tensor,
                   gelu_tanh: bool) -> tuple[torch.Tensor, list[Launch]]:
    """The output of silu_mul (gelu_tanh False) or gelu_tanh_mul, and the launch that fills it."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [T, 2I], got shape {tuple(gate_up.shape)}")
    t, width = gate_up.shape[0], gate_up.shape[1] // 2
    check_rows("gate_up", gate_up, (t, 2 * width))
    check_device(_gated_mul_kernel, gate_up=gate_up)
    out = torch.empty(t, width, dtype=gate_up.dtype, device=gate_up.device)
    if t == 0 or width == 0:
        return out, []
    return out, [Launch(_gated_mul_kernel, (t, cdiv(width, _BLOCK)),
                        (gate_up, out, width, gate_up.stride(0)),
                        {"GELU_TANH": gelu_tanh, "BLOCK": _BLOCK})]
