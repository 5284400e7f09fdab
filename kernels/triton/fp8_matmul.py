"""Triton kernels: a projection y = x W^T + b with an FP8 weight (e4m3 [N, K], float32 scales).

The weight's scales are [R, G]: scale row r covers weight rows r*ROW_BLOCK .. (r+1)*ROW_BLOCK-1,
scale group g the columns g*COL_BLOCK .. (g+1)*COL_BLOCK-1 (per channel: ROW_BLOCK 1 and one
group; 128x128 blocks: both 128), so W = e4m3 * scale elementwise (batchllm/model/fp8_weights.py).

Two paths, by what the GPU multiplies:
  W8A8  (sm_89 and later: FP8 tensor cores) x is quantized per token first, x = e4m3 * x_scale
        with x_scale = max|x_t| / 448 (_quantize_rows_kernel), then FP8 x FP8 products in
        float32, each group's times its weight scale, and the row's x_scale at the end.
  W8A16 (sm_80: no FP8 products, and no float8 type in Triton) the weight's bits are decoded
        exactly into x's dtype (fp8.py) and multiplied with x as it is.
One program per (BLOCK_M rows, BLOCK_N outputs) tile, looping over K in BLOCK_K steps (BLOCK_K
divides COL_BLOCK, so a step lies in one scale group). Twins:
`batchllm_kernels.reference.fp8_matmul.quantize_rows_ref`, `fp8_matmul_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchllm_kernels.triton import launch
from batchllm_kernels.triton.checks import cdiv, check_device, pow2
from batchllm_kernels.triton.fp8 import DECODE_SCALE, decode_e4m3, encode_e4m3
from batchllm_kernels.triton.launch import Launch, interpreted

FP8 = torch.float8_e4m3fn
_DECODE_SCALE = tl.constexpr(DECODE_SCALE)


@triton.jit
def _quantize_rows_kernel(
    x_ptr, q_ptr, s_ptr,  # x [M, K] (rows strided), q [M, K] uint8 (e4m3 bits), s [M] fp32
    K, stride_xm, scale_ub,  # scale_ub: the rows' max |x| is capped there (fbgemm's); 0: none
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], tl.float32)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=k0 + offs < K, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    top = tl.max(amax, 0)
    if scale_ub > 0:
        top = tl.minimum(top, scale_ub)
    scale = tl.maximum(top, 1e-12) / 448.0
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=k0 + offs < K, other=0.0)
        q = encode_e4m3(tl.math.div_rn(x.to(tl.float32), scale))
        tl.store(q_ptr + row * K + k0 + offs, q, mask=k0 + offs < K)


@triton.jit
def _fp8_matmul_kernel(
    x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, b_ptr, y_ptr,  # x [M, K]; w [N, K]; y [M, N]
    M, N, K, stride_xm, stride_wn, stride_ym, stride_sr,
    ROW_BLOCK: tl.constexpr, COL_BLOCK: tl.constexpr,
    ONE_GROUP: tl.constexpr,  # one scale per row (G = 1): applied once, after the loop
    FP8_DOT: tl.constexpr,  # W8A8: x and w float8e4nv, x_scale [M]; else W8A16: w uint8 bits
    HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    scale_rows = w_scale_ptr + (offs_n // ROW_BLOCK) * stride_sr  # [BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + (k0 + offs_k)[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        if not FP8_DOT:  # decoded: w / DECODE_SCALE, exact in x's dtype
            w = decode_e4m3(w).to(x.dtype)
        if DOT_F32:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        part = tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N] fp32
        if ONE_GROUP:
            acc += part
        else:
            s = tl.load(scale_rows + k0 // COL_BLOCK, mask=n_ok, other=0.0)
            acc += part * s[None, :]
    if ONE_GROUP:
        acc = acc * tl.load(scale_rows, mask=n_ok, other=0.0)[None, :]
    if FP8_DOT:
        acc = acc * tl.load(x_scale_ptr + offs_m, mask=m_ok, other=0.0)[:, None]
    else:
        acc = acc * _DECODE_SCALE
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y,
             mask=m_ok[:, None] & n_ok[None, :])


def fp8_linear(
    x: torch.Tensor,  # [M, K], contiguous in K
    weight: torch.Tensor,  # [N, K] float8_e4m3fn, contiguous
    scale: torch.Tensor,  # [R, G] float32, contiguous
    row_block: int,
    col_block: int,
    bias: torch.Tensor | None = None,  # [N]
    *,
    fp8_dot: bool,  # W8A8 (sm_89+) or W8A16 (module docstring)
    scale_ub: float = 0.0,  # W8A8: cap of the rows' max |x| (0: none)
) -> torch.Tensor:  # [M, N], x's dtype
    """x W^T + b with W = weight * scale (each weight element times its block's scale)."""
    y, launches = plan_fp8_linear(x, weight, scale, row_block, col_block, bias,
                                  fp8_dot=fp8_dot, scale_ub=scale_ub)
    launch.run(launches)
    return y


def plan_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, row_block: int,
                    col_block: int, bias: torch.Tensor | None = None, *, fp8_dot: bool,
                    scale_ub: float = 0.0) -> tuple[torch.Tensor, list[Launch]]:
    """The output of fp8_linear and the launches that fill it."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be [M, K] and weight [N, K], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    m, k = x.shape
    n = weight.shape[0]
    if weight.dtype != FP8 or not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous float8_e4m3fn, got {weight.dtype}")
    groups = cdiv(k, col_block)
    if (scale.dtype != torch.float32 or not scale.is_contiguous()
            or tuple(scale.shape) != (cdiv(n, row_block), groups)):
        raise ValueError(f"scale must be contiguous float32 [{cdiv(n, row_block)}, {groups}] "
                         f"for blocks of {row_block}x{col_block}, got {scale.dtype} "
                         f"{tuple(scale.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or (m and x.stride(1) != 1):
        raise ValueError(f"x must be float32, bfloat16 or float16, contiguous in K: {x.dtype}")
    if bias is not None and (tuple(bias.shape) != (n,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be contiguous [{n}], got {tuple(bias.shape)}")
    check_device(_fp8_matmul_kernel, x=x, weight=weight, scale=scale,
                 **({} if bias is None else {"bias": bias}))
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y, []
    # W8A16 decodes its weight tile in registers: 64 columns a step (with 128, sm_80's 64-row
    # tiles in 128x128 blocks spilled 12 bytes: scripts/compile_check.py)
    widest = 128 if fp8_dot else 64
    block_k = widest if groups == 1 else min(widest, col_block)
    if groups > 1 and (col_block % block_k or block_k < 16 or block_k != pow2(block_k)):
        raise ValueError(f"blocks of {col_block} columns: a multiple of 16, a power of two "
                         "up to 128 or a multiple of 128")
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    launches = []
    operand, x_scale = x, scale  # W8A16 reads no x_scale (scale in its place)
    if fp8_dot:
        bits = torch.empty(m, k, dtype=torch.uint8, device=x.device)
        x_scale = torch.empty(m, dtype=torch.float32, device=x.device)
        launches.append(Launch(_quantize_rows_kernel, (m,), (
            x, bits, x_scale, k, x.stride(0), float(scale_ub)),
            {"BLOCK": min(1024, pow2(k))}))
        operand = bits.view(FP8)
    launches.append(Launch(_fp8_matmul_kernel, (cdiv(m, block_m), cdiv(n, 64)), (
        operand, x_scale, weight if fp8_dot else weight.view(torch.uint8), scale,
        bias if bias is not None else scale, y,
        m, n, k, x.stride(0), weight.stride(0), y.stride(0), scale.stride(0),
    ), {"ROW_BLOCK": row_block, "COL_BLOCK": col_block if groups > 1 else 1,
        "ONE_GROUP": groups == 1, "FP8_DOT": fp8_dot, "HAS_BIAS": bias is not None,
        # the interpreter's bfloat16 tl.dot is wrong (launch.dot_f32); its FP8 one is right
        "DOT_F32": not fp8_dot and interpreted(_fp8_matmul_kernel) and x.dtype == torch.bfloat16,
        "DOT_PRECISION": "ieee" if x.dtype == torch.float32 and not fp8_dot else None,
        "BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": block_k,
        "num_warps": 4, "num_stages": 3}))
    return y, launches
