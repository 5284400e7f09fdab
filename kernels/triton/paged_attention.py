"""Triton kernel: causal attention of one step (prefill chunks and decodes) over paged KV.

One program per (query tile, KV head). A tile packs TILE_Q query tokens of one sequence times
the GROUP query heads that share the KV head, so a decode under grouped-query attention is
still a matrix product, and loops over the sequence's keys block by block through its page
table with an online softmax. Tiles are numbered without a host sync (as in vLLM's unified
attention): sequence b owns tiles cu_q[b] // TILE_Q + b onwards, at most T // TILE_Q + B in all;
a program finds its sequence by binary search over cu_q.

Decodes get a tile of their own. Given `decode_seqs` (the sequences with one query), a first
launch runs one small tile per decode (DECODE) and the 64-row tiles of a second launch skip
them (SKIP_DECODES), so a mixed step's decodes do not each fill a 64-row prefill tile. A
decode-only step with few, long sequences also splits each sequence's keys into ranges
(split-KV, like the prefix kernel), folded by combine_splits.py. The split count depends on the
launch's shape and the `max_context` hint only, so a captured CUDA graph stays right.
An FP8 cache (float8_e4m3fn with k_scale and v_scale per KV head) is read through tiles.py's
FP8 path. Twin: `batchllm_kernels.reference.paged_attention.paged_attention_ref`.

The tile's pieces (find_seq, attend_pages, store_tile) are in tiles.py, shared with
prefix_attention.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchllm_kernels.triton import launch
from batchllm_kernels.triton.checks import (
    cdiv,
    check_attention,
    check_device,
    check_index,
    kv_operands,
    pow2,
)
from batchllm_kernels.triton.combine_splits import plan_combine, split_buffers
from batchllm_kernels.triton.launch import Launch
from batchllm_kernels.triton.tiles import (
    LOG2E,
    attend_pages,
    find_seq,
    launch_options,
    store_tile,
    target_programs,
    tile_rows,
)

_MIN_SPLIT_KEYS = 256  # keys per split below which splitting a decode costs more than it gains


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, o_ptr, lse_ptr,
    page_table_ptr, cu_q_ptr, context_lens_ptr, kv_start_ptr, decode_seqs_ptr,
    k_scale_ptr, v_scale_ptr,  # [Hkv] fp32, read with FP8 only
    num_seqs, qk_scale,  # o, lse: [S, T, Hq, D], [S, T, Hq] with S key splits (stride 0: one)
    stride_qt, stride_qh, stride_os, stride_ot, stride_oh, stride_ls, stride_lt, stride_lh,
    stride_table, stride_slot, stride_kvh,
    GROUP: tl.constexpr, TILE_Q: tl.constexpr, PAGE_SIZE: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    FP8: tl.constexpr,  # the caches are an FP8 cache's uint8 bits
    DECODE: tl.constexpr,  # program i: sequence decode_seqs[i], all its queries in one tile
    SKIP_DECODES: tl.constexpr,  # tiles over all sequences but those with one query
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if DECODE:
        b = tl.load(decode_seqs_ptr + tile)
        first = 0
        q_begin = tl.load(cu_q_ptr + b)
        q_len = tl.load(cu_q_ptr + b + 1) - q_begin
    else:
        b = find_seq(cu_q_ptr, tile, num_seqs, TILE_Q)
        if b < 0:
            return
        q_begin = tl.load(cu_q_ptr + b)
        q_len = tl.load(cu_q_ptr + b + 1) - q_begin
        if SKIP_DECODES and q_len == 1:
            return
        first = (tile - (q_begin // TILE_Q + b)) * TILE_Q  # the tile's first token in the seq
        if first >= q_len:
            return
    ctx = tl.load(context_lens_ptr + b)
    kv_lo = tl.load(kv_start_ptr + b)
    kv_hi = tl.minimum(ctx, ctx - q_len + first + TILE_Q)  # past the tile's last query position
    if WINDOW > 0:  # nothing before the tile's first query's window
        kv_lo = tl.maximum(kv_lo, ctx - q_len + first - WINDOW + 1)
    # The keys in num_splits ranges of whole key blocks (one split: all of them).
    per_split = tl.cdiv(tl.cdiv(kv_hi - kv_lo, tl.num_programs(2)), BLOCK_N) * BLOCK_N
    kv_lo = kv_lo + split * per_split
    kv_hi = tl.minimum(kv_hi, kv_lo + per_split)

    offs_m = tl.arange(0, BLOCK_M)
    tok = offs_m // GROUP
    heads = kvh * GROUP + offs_m % GROUP
    row_ok = (tok < TILE_Q) & (first + tok < q_len)
    rows = q_begin + first + tok
    q_pos = ctx - q_len + first + tok
    offs_d = tl.arange(0, BLOCK_D)
    q_off = rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    acc, m_i, l_i = attend_pages(
        q, k_cache_ptr, v_cache_ptr, page_table_ptr + b * stride_table, kv_lo, kv_hi,
        kvh, q_pos, qk_scale, stride_slot, stride_kvh, k_scale_ptr, v_scale_ptr,
        True, PAGE_SIZE, D, BLOCK_M, BLOCK_N, BLOCK_D, DOT_PRECISION, DOT_F32,
        WINDOW=WINDOW, SOFTCAP=SOFTCAP, FP8=FP8,
    )
    store_tile(o_ptr + split * stride_os, lse_ptr + split * stride_ls, acc, m_i, l_i,
               rows, heads, row_ok, stride_ot, stride_oh, stride_lt, stride_lh, D, BLOCK_D)


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,
    page_table: torch.Tensor,  # [B, max_pages] int32
    cu_q: torch.Tensor,  # [B+1] int32, query rows of sequence b: cu_q[b]:cu_q[b+1]
    context_lens: torch.Tensor,  # [B] int32, tokens in the cache after this step
    kv_start: torch.Tensor,  # [B] int32, first key position of this part
    scale: float,
    *,
    window: int = 0,
    softcap: float = 0.0,
    decode_seqs: torch.Tensor | None = None,  # [n] int32, the sequences with one query
    max_context: int = 0,  # the step's longest context_lens (a hint for split-KV; 0: no split)
    k_scale: torch.Tensor | None = None,  # [Hkv] fp32: an FP8 cache's scales
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # o [T, Hq, D] (q's dtype), lse [T, Hq] fp32
    """Causal attention of a step that mixes prefill chunks and decodes over paged KV.

    The query at position p of sequence b (its queries hold the last q_len positions before
    context_lens[b]) sees keys kv_start[b] <= j <= p (and j > p - window when window > 0);
    softcap > 0: scores s -> softcap * tanh(s / softcap); query head h reads KV head h // (Hq/Hkv).
    An empty key range gives o = 0 and lse = -inf. cu_q must start at 0 and end at T (not
    checked: that would need a device sync); rows outside it are left unwritten.
    `decode_seqs`: the one-query sequences, attended by a decode tile of their own (None: one
    launch whose tile size suits the step as a whole); listing every sequence of a step with
    T = B makes it decode-only, and with `max_context` its keys may then be split. An FP8
    cache (float8_e4m3fn) is read as fp8 * k_scale (v_scale) of its KV head.
    """
    o, lse, launches = plan_paged_attention(q, k_cache, v_cache, page_table, cu_q, context_lens,
                                            kv_start, scale, window=window, softcap=softcap,
                                            decode_seqs=decode_seqs, max_context=max_context,
                                            k_scale=k_scale, v_scale=v_scale)
    launch.run(launches)
    return o, lse


def plan_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_q: torch.Tensor,
    context_lens: torch.Tensor,
    kv_start: torch.Tensor,
    scale: float,
    *,
    window: int = 0,
    softcap: float = 0.0,
    decode_seqs: torch.Tensor | None = None,
    max_context: int = 0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[Launch]]:
    """The outputs (o, lse) of paged_attention and the launches that fill them."""
    t, hq, hkv, d, page_size = check_attention(q, k_cache, v_cache)
    if page_table.dim() != 2:
        raise ValueError(f"page_table must be [B, max_pages], got shape {tuple(page_table.shape)}")
    b = page_table.shape[0]
    check_index("page_table", page_table, tuple(page_table.shape), torch.int32)
    check_index("cu_q", cu_q, (b + 1,), torch.int32)
    check_index("context_lens", context_lens, (b,), torch.int32)
    check_index("kv_start", kv_start, (b,), torch.int32)
    decodes = 0 if decode_seqs is None else decode_seqs.shape[0]
    if decode_seqs is not None:
        check_index("decode_seqs", decode_seqs, (decodes,), torch.int32)
        if decodes > min(b, t):
            raise ValueError(f"decode_seqs lists {decodes} sequences, more than the step's "
                             f"{b} sequences and {t} query rows")
    check_device(_paged_attention_kernel, q=q, k_cache=k_cache, v_cache=v_cache,
                 page_table=page_table, cu_q=cu_q, context_lens=context_lens, kv_start=kv_start,
                 **({} if decode_seqs is None else {"decode_seqs": decode_seqs}))
    kc, vc, ks, vs, fp8 = kv_operands(k_cache, v_cache, k_scale, v_scale)
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(t, hq, dtype=torch.float32, device=q.device)
    if t == 0 or b == 0:
        return o.zero_(), lse.fill_(float("-inf")), []
    group = hq // hkv

    def tiles(block_m: int, grid: tuple[int, ...], tile_q: int, o_part: torch.Tensor,
              lse_part: torch.Tensor, decode: bool, skip_decodes: bool) -> Launch:
        split_strides = (o_part.stride(0), lse_part.stride(0)) if o_part.dim() == 4 else (0, 0)
        options = launch_options(q.dtype, _paged_attention_kernel, block_m, d)
        return Launch(_paged_attention_kernel, grid, (
            q, kc, vc, o_part, lse_part, page_table, cu_q, context_lens, kv_start,
            cu_q if decode_seqs is None else decode_seqs,  # read only by the DECODE launch
            ks, vs, b, scale * LOG2E,
            q.stride(0), q.stride(1), split_strides[0], o_part.stride(-3), o_part.stride(-2),
            split_strides[1], lse_part.stride(-2), lse_part.stride(-1),
            page_table.stride(0), k_cache.stride(1), k_cache.stride(2),
        ), dict(GROUP=group, TILE_Q=tile_q, PAGE_SIZE=page_size, D=d, BLOCK_M=block_m,
                BLOCK_D=max(16, pow2(d)), WINDOW=int(window), SOFTCAP=float(softcap),
                FP8=fp8, DECODE=decode, SKIP_DECODES=skip_decodes, **options))

    if decode_seqs is None:
        # Decode-like steps (about one query per sequence) get small tiles, chunks bigger ones.
        block_m, tile_q, count = tile_rows(t, b, group, 16 if t <= b else 64)
        return o, lse, [tiles(block_m, (count, hkv, 1), tile_q, o, lse, False, False)]
    launches = []
    if decodes:
        block_m, tile_q, _ = tile_rows(decodes, decodes, group, 16)
        splits = decode_splits(decodes, hkv, max_context, q.device) if decodes == t else 1
        o_part, lse_part = split_buffers(splits, o, lse)
        launches.append(tiles(block_m, (decodes, hkv, splits), tile_q, o_part, lse_part,
                              True, False))
        if splits > 1:
            launches.append(plan_combine(o_part, lse_part, o, lse))
    if decodes < b:
        block_m, tile_q, count = tile_rows(t, b, group, 64)
        launches.append(tiles(block_m, (count, hkv, 1), tile_q, o, lse, False, decodes > 0))
    return o, lse, launches


def decode_splits(num_decodes: int, num_kv_heads: int, max_context: int,
                  device: torch.device) -> int:
    """Key splits per decode in a decode-only step: enough programs for the GPU (two per SM),
    each split at least _MIN_SPLIT_KEYS keys of the longest context."""
    programs = num_decodes * num_kv_heads
    wanted = target_programs(device) // max(programs, 1)
    return max(1, min(wanted, cdiv(max_context, _MIN_SPLIT_KEYS)))
