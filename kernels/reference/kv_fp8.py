"""The FP8 KV cache's definition, in torch: what the store writes and what attention reads.

A cache of dtype float8_e4m3fn holds, for KV head h of a layer, e4m3(x / scale[h]) (nearest,
ties to even, saturated at +-448); attention reads fp8 * scale[h]. The scales (k and v, [Hkv]
float32 per layer) come from the checkpoint or are 1.0 (batchllm/model/kv_scales.py), never
from the data. The Triton kernels compute the same values (kernels/triton/fp8.py); these are
their twins' and the CPU path's.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [T, Hkv, D] (any float dtype), scale [Hkv] fp32 -> [T, Hkv, D] float8_e4m3fn."""
    return (x.float() / scale[:, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                  heads_dim: int) -> torch.Tensor:
    """Cache rows x (float8_e4m3fn) whose dimension `heads_dim` is the KV head -> x * scale in
    `dtype` (the product in float32, then rounded once)."""
    shape = [1] * x.dim()
    shape[heads_dim] = scale.shape[0]
    return (x.float() * scale.view(shape)).to(dtype)
