"""Pure-torch twins of the FP8 projection's kernels (kernels/triton/fp8_matmul.py): the weight
dequantized (W = e4m3 * its block's scale), and the per-token quantization of the activations
that the W8A8 path adds. The CPU path runs `fp8_matmul_ref` without that quantization: the
weights dequantized, as transformers runs a dequantized checkpoint (correct, not fast).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor, row_block: int,
                      col_block: int, dtype: torch.dtype) -> torch.Tensor:
    """weight [N, K] e4m3, scale [R, G] fp32 -> [N, K] weight * scale in `dtype` (the product
    in float32, then rounded once)."""
    n, k = weight.shape
    s = scale.repeat_interleave(row_block, 0)[:n].repeat_interleave(col_block, 1)[:, :k]
    return (weight.float() * s).to(dtype)


def quantize_rows_ref(x: torch.Tensor, scale_ub: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], scales [M] fp32): scale = max|x_row| / 448 (the max capped at
    scale_ub when > 0; 1e-12 at least), e4m3(x / scale) saturated at +-448."""
    top = x.float().abs().amax(dim=1)
    if scale_ub > 0:
        top = top.clamp(max=scale_ub)
    scale = top.clamp(min=1e-12) / E4M3_MAX
    q = (x.float() / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    return q, scale


def fp8_matmul_ref(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # [R, G] fp32
    row_block: int,
    col_block: int,
    bias: torch.Tensor | None = None,
    *,
    fp8_dot: bool = False,  # W8A8: x quantized per token first
    scale_ub: float = 0.0,
) -> torch.Tensor:  # [M, N], x's dtype
    """x W^T + b, W the dequantized weight; fp8_dot: x replaced by its per-token e4m3 values
    times their scales (the product in float32)."""
    if fp8_dot:
        q, s = quantize_rows_ref(x, scale_ub)
        w = dequantize_weight(weight, scale, row_block, col_block, torch.float32)
        y = (q.float() @ w.T) * s[:, None]
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype)
    w = dequantize_weight(weight, scale, row_block, col_block, x.dtype)
    return F.linear(x, w, bias)
