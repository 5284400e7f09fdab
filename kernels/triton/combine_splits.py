"""Triton kernel: attention states of the key splits of one launch combined by log-sum-exp.

The attention kernels split a row's keys into ranges when the rows alone cannot fill the GPU
(prefix_attention.py always may; paged_attention.py for decode-only steps); each split writes a
float32 partial state, and this kernel folds them: one program per (token, block of heads).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchllm_kernels.triton.checks import cdiv, pow2
from batchllm_kernels.triton.launch import Launch


@triton.jit
def _combine_splits_kernel(
    o_part_ptr, lse_part_ptr,  # [S, T, H, D] fp32, [S, T, H] fp32, contiguous
    o_ptr, lse_ptr,  # [T, H, D], [T, H] fp32, contiguous
    num_tokens, num_heads, num_splits,
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = offs_h < num_heads
    mask = h_ok[:, None] & (offs_d[None, :] < D)
    row = t * num_heads + offs_h  # [BLOCK_H] index into [T, H]
    split_rows = num_tokens * num_heads
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for s in range(num_splits):
        m = tl.maximum(m, tl.load(lse_part_ptr + s * split_rows + row, mask=h_ok, other=0.0))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for s in range(num_splits):
        w = tl.exp(tl.load(lse_part_ptr + s * split_rows + row, mask=h_ok, other=0.0) - m_safe)
        o_off = (s * split_rows + row)[:, None] * D + offs_d[None, :]
        acc += w[:, None] * tl.load(o_part_ptr + o_off, mask=mask, other=0.0)
        total += w
    empty = total == 0.0
    total_safe = tl.where(empty, 1.0, total)
    lse = tl.where(empty, float("-inf"), m_safe + tl.log(total_safe))
    o = acc / total_safe[:, None]
    tl.store(o_ptr + row[:, None] * D + offs_d[None, :], o.to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(lse_ptr + row, lse, mask=h_ok)


def split_buffers(num_splits: int, o: torch.Tensor,
                  lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the splits write: o and lse themselves for one split, else float32 partial states
    [S, T, H, D] and [S, T, H] (the kernels then store split s at stride_os * s)."""
    if num_splits == 1:
        return o, lse
    t, h, d = o.shape
    return (torch.empty(num_splits, t, h, d, dtype=torch.float32, device=o.device),
            torch.empty(num_splits, t, h, dtype=torch.float32, device=o.device))


def plan_combine(o_part: torch.Tensor, lse_part: torch.Tensor, o: torch.Tensor,
                 lse: torch.Tensor) -> Launch:
    """The launch that folds split_buffers' partial states into o [T, H, D] and lse [T, H]."""
    num_splits, t, h, d = o_part.shape
    block_h = min(16, pow2(h))
    return Launch(_combine_splits_kernel, (t, cdiv(h, block_h)),
                  (o_part, lse_part, o, lse, t, h, num_splits),
                  {"D": d, "BLOCK_H": block_h, "BLOCK_D": max(16, pow2(d))})
