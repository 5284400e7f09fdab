"""Triton kernel: causal attention of one step (prefill chunks and decodes) over paged KV.

One program per (query tile, KV head). A tile packs TILE_Q query tokens of one sequence times
the GROUP query heads that share the KV head, so a decode under grouped-query attention is
still a matrix product, and loops over the sequence's keys block by block through its page
table with an online softmax. Tiles are numbered without a host sync (as in vLLM's unified
attention): sequence b owns tiles cu_q[b] // TILE_Q + b onwards, at most T // TILE_Q + B in all;
a program finds its sequence by binary search over cu_q.
Twin: `kernels.reference.paged_attention.paged_attention_ref`.

The tile's pieces (find_seq, attend_pages, store_tile) are in tiles.py, shared with
prefix_attention.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.checks import check_attention, check_device, check_index, pow2
from kernels.triton.tiles import (
    LOG2E,
    attend_pages,
    find_seq,
    launch_options,
    store_tile,
    tile_rows,
)


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, o_ptr, lse_ptr,
    page_table_ptr, cu_q_ptr, context_lens_ptr, kv_start_ptr,
    num_seqs, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh,
    stride_table, stride_slot, stride_kvh,
    GROUP: tl.constexpr, TILE_Q: tl.constexpr, PAGE_SIZE: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    b = find_seq(cu_q_ptr, tile, num_seqs, TILE_Q)
    if b < 0:
        return
    q_begin = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_begin
    first = (tile - (q_begin // TILE_Q + b)) * TILE_Q  # first token of the tile in the sequence
    if first >= q_len:
        return
    ctx = tl.load(context_lens_ptr + b)
    kv_lo = tl.load(kv_start_ptr + b)
    kv_hi = tl.minimum(ctx, ctx - q_len + first + TILE_Q)  # past the tile's last query position
    if WINDOW > 0:  # nothing before the tile's first query's window
        kv_lo = tl.maximum(kv_lo, ctx - q_len + first - WINDOW + 1)

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
        kvh, q_pos, qk_scale, stride_slot, stride_kvh,
        True, PAGE_SIZE, D, BLOCK_M, BLOCK_N, BLOCK_D, DOT_PRECISION,
        WINDOW=WINDOW, SOFTCAP=SOFTCAP,
    )
    store_tile(o_ptr, lse_ptr, acc, m_i, l_i, rows, heads, row_ok,
               stride_ot, stride_oh, stride_lt, stride_lh, D, BLOCK_D)


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
) -> tuple[torch.Tensor, torch.Tensor]:  # o [T, Hq, D] (q's dtype), lse [T, Hq] fp32
    """Causal attention of a step that mixes prefill chunks and decodes over paged KV.

    The query at position p of sequence b (its queries hold the last q_len positions before
    context_lens[b]) sees keys kv_start[b] <= j <= p (and j > p - window when window > 0);
    softcap > 0: scores s -> softcap * tanh(s / softcap); query head h reads KV head h // (Hq/Hkv).
    An empty key range gives o = 0 and lse = -inf. cu_q must start at 0 and end at T (not
    checked: that would need a device sync); rows outside it are left unwritten.
    """
    t, hq, hkv, d, page_size = check_attention(q, k_cache, v_cache)
    if page_table.dim() != 2:
        raise ValueError(f"page_table must be [B, max_pages], got shape {tuple(page_table.shape)}")
    b = page_table.shape[0]
    check_index("page_table", page_table, tuple(page_table.shape), torch.int32)
    check_index("cu_q", cu_q, (b + 1,), torch.int32)
    check_index("context_lens", context_lens, (b,), torch.int32)
    check_index("kv_start", kv_start, (b,), torch.int32)
    check_device(_paged_attention_kernel, q=q, k_cache=k_cache, v_cache=v_cache,
                 page_table=page_table, cu_q=cu_q, context_lens=context_lens, kv_start=kv_start)
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(t, hq, dtype=torch.float32, device=q.device)
    group = hq // hkv
    # Decode-like steps (about one query per sequence) get small tiles, chunks bigger ones.
    block_m, tile_q, tiles = tile_rows(t, b, group, 16 if t <= b else 64)
    if t == 0 or b == 0:
        return o.zero_(), lse.fill_(float("-inf"))
    _paged_attention_kernel[(tiles, hkv)](
        q, k_cache, v_cache, o, lse, page_table, cu_q, context_lens, kv_start,
        b, scale * LOG2E,
        q.stride(0), q.stride(1), o.stride(0), o.stride(1), lse.stride(0), lse.stride(1),
        page_table.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=group, TILE_Q=tile_q, PAGE_SIZE=page_size, D=d,
        BLOCK_M=block_m, BLOCK_D=max(16, pow2(d)), WINDOW=int(window), SOFTCAP=float(softcap),
        **launch_options(q.dtype),
    )
    return o, lse

