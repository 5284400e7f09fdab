"""Triton kernel: the grouped product of a mixture-of-experts layer. The rows (token, expert
choice) arrive sorted by expert; expert e's run of rows, offsets[e] .. offsets[e+1] - 1, is
multiplied by its own weight w[e]: one matrix product per expert, all in one launch.

One program per (row tile, column tile). Tiles are numbered without a host sync, as the
attention kernels number theirs (tiles.find_seq): expert e owns tiles offsets[e] // BLOCK_M + e
onwards, at most N // BLOCK_M + E in all; a program finds its expert by binary search over the
offsets and returns at once when its tile lies past the expert's rows.
Twin: `batchllm_kernels.reference.grouped_matmul.grouped_matmul_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchllm_kernels.triton import launch
from batchllm_kernels.triton.checks import cdiv, check_device, check_index
from batchllm_kernels.triton.launch import Launch, dot_f32
from batchllm_kernels.triton.tiles import find_seq


@triton.jit
def _grouped_matmul_kernel(
    x_ptr, w_ptr, y_ptr, offsets_ptr,
    num_experts, n_out, k_in,
    stride_xn, stride_we, stride_wm, stride_yn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_F32: tl.constexpr,  # DOT_F32: launch.dot_f32
):
    tile = tl.program_id(0)
    e = find_seq(offsets_ptr, tile, num_experts, BLOCK_M)
    if e < 0:
        return
    lo = tl.load(offsets_ptr + e)
    hi = tl.load(offsets_ptr + e + 1)
    first = lo + (tile - (lo // BLOCK_M + e)) * BLOCK_M
    if first >= hi:
        return
    rows = first + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows of x and y
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] outputs
    row_ok = rows < hi
    col_ok = cols < n_out
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + e.to(tl.int64) * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        ks = k0 + offs_k
        k_ok = ks < k_in
        a = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xn + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        b = tl.load(w_base + cols[:, None] * stride_wm + ks[None, :],
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        if DOT_F32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, tl.trans(b), input_precision=DOT_PRECISION)
    y_off = rows[:, None].to(tl.int64) * stride_yn + cols[None, :]
    tl.store(y_ptr + y_off, acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def grouped_matmul(
    x: torch.Tensor,  # [N, K], rows sorted by expert
    w: torch.Tensor,  # [E, M, K], contiguous
    offsets: torch.Tensor,  # [E+1] int32, expert e's rows: offsets[e]:offsets[e+1]
) -> torch.Tensor:  # [N, M], x's dtype
    """y[rows of e] = x[rows of e] @ w[e]^T for every expert e, in one launch. offsets must
    start at 0, ascend and end at N (not checked: that would need a device sync)."""
    y, launches = plan_grouped_matmul(x, w, offsets)
    launch.run(launches)
    return y


def plan_grouped_matmul(x: torch.Tensor, w: torch.Tensor,
                        offsets: torch.Tensor) -> tuple[torch.Tensor, list[Launch]]:
    """The output of grouped_matmul and the launch that fills it."""
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2]:
        raise ValueError(f"grouped_matmul: x [N, K] and w [E, M, K] expected, got "
                         f"{tuple(x.shape)} and {tuple(w.shape)}")
    if x.dtype != w.dtype or x.stride(-1) != 1 or not w.is_contiguous():
        raise ValueError("grouped_matmul: x and w must share a dtype, x contiguous in K and w "
                         "contiguous")
    num_experts, n_out, k_in = w.shape
    check_index("offsets", offsets, (num_experts + 1,), torch.int32)
    check_device(_grouped_matmul_kernel, x=x, w=w, offsets=offsets)
    y = torch.empty(x.shape[0], n_out, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return y, []
    fp32 = x.dtype == torch.float32
    block_m, block_n, block_k = 32, 64, 32 if fp32 else 64
    grid = (x.shape[0] // block_m + num_experts, cdiv(n_out, block_n))
    return y, [Launch(_grouped_matmul_kernel, grid, (
        x, w, y, offsets, num_experts, n_out, k_in,
        x.stride(0), w.stride(0), w.stride(1), y.stride(0),
    ), {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k,
        "DOT_PRECISION": "ieee" if fp32 else None,
        "DOT_F32": dot_f32(_grouped_matmul_kernel, x.dtype), "num_warps": 4})]
