"""The jitted pieces both attention kernels are made of (paged_attention.py, prefix_attention.py)
and the launch settings they share.

A program attends one tile: TILE_Q query tokens times the GROUP query heads that share a KV
head, BLOCK_M rows in all, so a decode under grouped-query attention is still a matrix product.
`find_seq` finds a tile's sequence (or group) without a host sync, `attend_pages` runs the
online softmax over its keys block by block through a page table, `store_tile` normalises and
writes (o, lse). The options of kernels/reference/attend.py live in `attend_pages` as
constexprs: WINDOW > 0 masks keys before p - WINDOW + 1, SOFTCAP > 0 caps the scores; at 0 (the
Llama path) they compile away. FP8: the caches are an FP8 cache's uint8 bits, decoded exactly
into q's dtype (fp8.py), the KV head's scales folded into the score scale and the output.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from batchllm_kernels.triton.checks import pow2
from batchllm_kernels.triton.fp8 import DECODE_SCALE, decode_e4m3
from batchllm_kernels.triton.launch import dot_f32

LOG2E = math.log2(math.e)
_LOG2E = tl.constexpr(LOG2E)  # the same, readable inside the jitted functions
_DECODE_SCALE = tl.constexpr(DECODE_SCALE)


@triton.jit
def find_seq(cu_q_ptr, tile, num_seqs, TILE_Q: tl.constexpr):
    """The last sequence b whose first tile, cu_q[b] // TILE_Q + b, is <= tile (-1 if none)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(cu_q_ptr + mid) // TILE_Q + mid
        if first <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def attend_pages(
    q,  # [BLOCK_M, BLOCK_D] query rows of one KV head
    k_cache_ptr, v_cache_ptr, table_ptr,  # table_ptr: this sequence's row of page ids
    kv_lo, kv_hi,  # key positions [kv_lo, kv_hi)
    kvh, q_pos, qk_scale,  # q_pos [BLOCK_M]: query positions (CAUSAL); qk_scale in log2 units
    stride_slot, stride_kvh,
    k_scale_ptr, v_scale_ptr,  # [Hkv] fp32, read with FP8 only
    CAUSAL: tl.constexpr, PAGE_SIZE: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
    WINDOW: tl.constexpr = 0, SOFTCAP: tl.constexpr = 0.0, FP8: tl.constexpr = False,
):
    """Online softmax over keys -> (acc [BLOCK_M, BLOCK_D] unnormalised, m_i and l_i [BLOCK_M]),
    m_i in log2 units; a row with no visible key keeps m_i = -inf and l_i = 0. WINDOW > 0
    (CAUSAL): a query sees the keys after q_pos - WINDOW only; SOFTCAP > 0: natural-unit scores
    s -> SOFTCAP * tanh(s / SOFTCAP) before the mask. DOT_F32: the products in float32 (the
    interpreter's bfloat16 tl.dot is wrong: launch.dot_f32). FP8: k and v are e4m3 bits, read
    as bits * k_scale (v_scale) of KV head kvh."""
    model_dtype = q.dtype
    if DOT_F32:
        q = q.to(tl.float32)
    if FP8:  # decoded keys are k / (DECODE_SCALE * k_scale): the factor goes to the scores
        qk_scale = qk_scale * (tl.load(k_scale_ptr + kvh) * _DECODE_SCALE)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(kv_lo, kv_hi, BLOCK_N):
        pos = start + offs_n  # [BLOCK_N] key positions
        key_ok = pos < kv_hi
        page = tl.load(table_ptr + pos // PAGE_SIZE, mask=key_ok, other=0).to(tl.int64)
        slot = page * PAGE_SIZE + pos % PAGE_SIZE
        kv_off = slot[:, None] * stride_slot + kvh * stride_kvh + offs_d[None, :]
        kv_mask = key_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        if FP8:
            k = decode_e4m3(k).to(q.dtype)
            v = decode_e4m3(v).to(q.dtype)
        elif DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [M, N]
        if SOFTCAP > 0:
            s = soft_cap(s, SOFTCAP * _LOG2E)  # log2 units: capped at SOFTCAP * log2(e)
        visible = key_ok[None, :]
        if CAUSAL:
            visible = visible & (pos[None, :] <= q_pos[:, None])
        if WINDOW > 0:
            visible = visible & (pos[None, :] > q_pos[:, None] - WINDOW)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no -inf - -inf
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p_in = p.to(model_dtype)  # rounded to q's dtype, as on a GPU
        if DOT_F32:
            p_in = p_in.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p_in, v, input_precision=DOT_PRECISION)
        m_i = m_new
    if FP8:  # decoded values are v / (DECODE_SCALE * v_scale)
        acc = acc * (tl.load(v_scale_ptr + kvh) * _DECODE_SCALE)
    return acc, m_i, l_i


@triton.jit
def soft_cap(s, cap):
    """cap * tanh(s / cap), with tanh(x) = sign(x) (1 - e^(-2|x|)) / (1 + e^(-2|x|))."""
    e = tl.exp2(tl.abs(s) * (-2.0 * _LOG2E / cap))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(s < 0, -t, t) * cap


@triton.jit
def store_tile(
    o_ptr, lse_ptr, acc, m_i, l_i,
    rows, heads, row_ok,  # [BLOCK_M] token row, query head, valid
    stride_ot, stride_oh, stride_lt, stride_lh,
    D: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """o = acc / l (0 where l = 0), lse = ln(l) + m (-inf where l = 0)."""
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    o = acc / l_safe[:, None]
    offs_d = tl.arange(0, BLOCK_D)
    o_off = rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    o_mask = row_ok[:, None] & (offs_d[None, :] < D)
    tl.store(o_ptr + o_off, o.to(o_ptr.dtype.element_ty), mask=o_mask)
    tl.store(lse_ptr + rows * stride_lt + heads * stride_lh, lse, mask=row_ok)


def launch_options(dtype: torch.dtype, kernel: object, block_m: int, head_dim: int) -> dict:
    """Key block, dot precision, warps and pipelining of a tile of block_m rows. float32: exact
    products (no TF32) and smaller key blocks, which keep its shared memory under 100 KB and its
    compile time short; 8 warps for 64-row tiles and head sizes over 64 (4 spilled up to 40 KB).
    16-bit 64-row tiles of head size 128 take 32-key blocks: with 64, sm_80's registers spilled
    (8-160 bytes with 4 or 8 warps, 2 or 3 stages; scripts/compile_check.py's full matrix).
    DOT_F32: bfloat16 products upcast, in the interpreter only (launch.dot_f32)."""
    f32 = {"DOT_F32": dot_f32(kernel, dtype)}
    if dtype == torch.float32:
        warps = 8 if block_m >= 64 or head_dim > 64 else 4
        return {"BLOCK_N": 32, "DOT_PRECISION": "ieee", "num_warps": warps, "num_stages": 2,
                **f32}
    block_n = 32 if block_m >= 64 and head_dim > 64 else 64
    return {"BLOCK_N": block_n, "DOT_PRECISION": None, "num_warps": 4, "num_stages": 3, **f32}


def tile_rows(t: int, num_seqs: int, group: int, block_m: int) -> tuple[int, int, int]:
    """-> (BLOCK_M, TILE_Q, number of tiles): a block of at least 16 rows holding whole groups."""
    block_m = max(block_m, 16, pow2(group))
    tile_q = block_m // group
    return block_m, tile_q, t // tile_q + num_seqs


@functools.cache
def target_programs(device: torch.device) -> int:
    """Programs worth launching for one attention call: two per SM on a GPU, a few elsewhere
    (the interpreter; meta tensors planned for scripts/compile_check.py)."""
    if device.type != "cuda":
        return 8
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count
