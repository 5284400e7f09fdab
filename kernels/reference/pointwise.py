"""Pure-torch twins of the model's pointwise steps (RMSNorm with its residual add, rotary
embedding, SiLU-and-multiply, GELU-tanh-and-multiply), written as Hugging Face's modules compute
them: the GPU path's versions, the CPU path's where the C ones (kernels/cpu/ops.py) do not serve,
and their reference in tests/test_cpu_ops.py. `PointwiseOps` is the set a forward pass calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F


def gelu_tanh_mul_ref(gate_up):
    """Gemma's MLP activation: gelu(gate, approximate="tanh") * up (transformers' GELUTanh)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh").mul_(up)


class PointwiseOps(NamedTuple):
    add_rms_norm: Callable  # (h [T,H], delta [T,H] or None, w [H], eps) -> [T,H]; h += delta
    rope_: Callable  # (x [T, W], positions [T] int64, cos, sin [P, D], heads) -> None, in place
    silu_mul: Callable  # (gate_up [T, 2I]) -> [T, I]
    gelu_tanh_mul: Callable = gelu_tanh_mul_ref  # (gate_up [T, 2I]) -> [T, I]; Gemma's MLP


def add_rms_norm_ref(h, delta, weight, eps):
    if delta is not None:
        h.add_(delta)
    # As LlamaRMSNorm: the variance in float32, the weight in the model dtype.
    x32 = h.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(h.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_ref(x, positions, cos, sin, heads):
    d = cos.shape[1]
    c = cos[positions][:, None, :].to(x.dtype)  # [T, 1, D]
    s = sin[positions][:, None, :].to(x.dtype)
    part = x[:, : heads * d].view(x.shape[0], heads, d)
    part.copy_(part * c + _rotate_half(part) * s)


def silu_mul_ref(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate, inplace=True).mul_(up)


TORCH_OPS = PointwiseOps(add_rms_norm_ref, rope_ref, silu_mul_ref)
