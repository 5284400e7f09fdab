"""Triton kernel: each group's queries against its shared prefix pages (cascade attention).

One program per (query tile, KV head, key split). A tile packs TILE_Q query tokens of one group
times the GROUP query heads of a KV head (matrix-matrix products with tl.dot), so the prefix
K and V are read once per tile rather than once per request. When the tiles alone cannot fill
the GPU (a decode step: one query per request), each group's prefix keys are split into as
many ranges as the launch has splits, whose partial (o, lse) a second small kernel merges
(combine_splits.py). The split count depends on the launch's shape only, not on the lengths,
so a captured CUDA graph stays right whatever the prefixes. No causal mask: every query comes
after the prefix. The tile's pieces are in tiles.py, an FP8 cache's reading too.
Twin: `batchllm_kernels.reference.prefix_attention.prefix_attention_ref`.
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
from batchllm_kernels.triton.merge_states import plan_merge_states
from batchllm_kernels.triton.tiles import (
    LOG2E,
    attend_pages,
    find_seq,
    launch_options,
    store_tile,
    target_programs,
    tile_rows,
)


@triton.jit
def _prefix_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, o_ptr, lse_ptr,  # o, lse: [S, T, Hq, D], [S, T, Hq]
    prefix_pages_ptr, prefix_lens_ptr, cu_q_ptr,
    k_scale_ptr, v_scale_ptr,  # [Hkv] fp32, read with FP8 only
    num_groups, qk_scale,
    stride_qt, stride_qh, stride_os, stride_ot, stride_oh, stride_ls, stride_lt, stride_lh,
    stride_table, stride_slot, stride_kvh,
    GROUP: tl.constexpr, TILE_Q: tl.constexpr, PAGE_SIZE: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_F32: tl.constexpr, SOFTCAP: tl.constexpr,
    FP8: tl.constexpr,  # the caches are an FP8 cache's uint8 bits
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    g = find_seq(cu_q_ptr, tile, num_groups, TILE_Q)
    if g < 0:
        return
    q_begin = tl.load(cu_q_ptr + g)
    q_len = tl.load(cu_q_ptr + g + 1) - q_begin
    first = (tile - (q_begin // TILE_Q + g)) * TILE_Q
    if first >= q_len:
        return
    prefix_len = tl.load(prefix_lens_ptr + g)
    # This group's keys in num_splits ranges of whole key blocks (empty ranges store -inf).
    per_split = tl.cdiv(tl.cdiv(prefix_len, tl.num_programs(2)), BLOCK_N) * BLOCK_N
    kv_lo = split * per_split
    kv_hi = tl.minimum(prefix_len, kv_lo + per_split)

    offs_m = tl.arange(0, BLOCK_M)
    tok = offs_m // GROUP
    heads = kvh * GROUP + offs_m % GROUP
    row_ok = (tok < TILE_Q) & (first + tok < q_len)
    rows = q_begin + first + tok
    offs_d = tl.arange(0, BLOCK_D)
    q_off = rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    acc, m_i, l_i = attend_pages(
        q, k_cache_ptr, v_cache_ptr, prefix_pages_ptr + g * stride_table, kv_lo, kv_hi,
        kvh, rows, qk_scale, stride_slot, stride_kvh, k_scale_ptr, v_scale_ptr,
        False, PAGE_SIZE, D, BLOCK_M, BLOCK_N, BLOCK_D, DOT_PRECISION, DOT_F32,
        SOFTCAP=SOFTCAP, FP8=FP8,
    )
    store_tile(o_ptr + split * stride_os, lse_ptr + split * stride_ls, acc, m_i, l_i,
               rows, heads, row_ok, stride_ot, stride_oh, stride_lt, stride_lh, D, BLOCK_D)


def prefix_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,
    prefix_pages: torch.Tensor,  # [G, max_pages] int32
    prefix_lens: torch.Tensor,  # [G] int32
    cu_q: torch.Tensor,  # [G+1] int32, query rows of group g: cu_q[g]:cu_q[g+1]
    scale: float,
    *,
    softcap: float = 0.0,
    k_scale: torch.Tensor | None = None,  # [Hkv] fp32: an FP8 cache's scales
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # o [T, Hq, D] (q's dtype), lse [T, Hq] fp32
    """Each group's queries against all prefix_lens[g] keys of its pages, no mask; softcap > 0:
    scores s -> softcap * tanh(s / softcap). An FP8 cache is read as fp8 * its head's scale.

    A group with an empty prefix gives o = 0 and lse = -inf. cu_q must start at 0 and end at T
    (not checked: that would need a device sync); rows outside it are left unspecified.
    """
    return prefix_attention_split(q, k_cache, v_cache, prefix_pages, prefix_lens, cu_q, scale,
                                  softcap=softcap, k_scale=k_scale, v_scale=v_scale)


def prefix_attention_into(
    q: torch.Tensor,  # [T, Hq, D], the rows of the groups
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_pages: torch.Tensor,
    prefix_lens: torch.Tensor,
    cu_q: torch.Tensor,  # [G+1] int32, ending at T
    scale: float,
    o: torch.Tensor,  # [T, Hq, D] contiguous: the rows' own part in, both parts merged out
    lse: torch.Tensor,  # [T, Hq] fp32 contiguous, likewise
    *,
    softcap: float = 0.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """prefix_attention, merged into the state (o, lse) in place (merge_states.py)."""
    o_pre, lse_pre, launches = plan_prefix_attention(q, k_cache, v_cache, prefix_pages,
                                                     prefix_lens, cu_q, scale, softcap=softcap,
                                                     k_scale=k_scale, v_scale=v_scale)
    _, _, merge = plan_merge_states(o_pre, lse_pre, o, lse, out=(o, lse))
    launch.run(launches + merge)


def prefix_attention_split(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_pages: torch.Tensor,
    prefix_lens: torch.Tensor,
    cu_q: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    softcap: float = 0.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`prefix_attention` with the number of key splits chosen by the caller (tests, benchmarks);
    None: enough splits to give the GPU about two programs per SM."""
    o, lse, launches = plan_prefix_attention(q, k_cache, v_cache, prefix_pages, prefix_lens, cu_q,
                                             scale, num_splits, softcap=softcap, k_scale=k_scale,
                                             v_scale=v_scale)
    launch.run(launches)
    return o, lse


def plan_prefix_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_pages: torch.Tensor,
    prefix_lens: torch.Tensor,
    cu_q: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    softcap: float = 0.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[Launch]]:
    """The outputs (o, lse) of prefix_attention_split and the launches that fill them."""
    t, hq, hkv, d, page_size = check_attention(q, k_cache, v_cache)
    if prefix_pages.dim() != 2:
        raise ValueError(f"prefix_pages must be [G, max_pages], got {tuple(prefix_pages.shape)}")
    groups, max_pages = prefix_pages.shape
    check_index("prefix_pages", prefix_pages, (groups, max_pages), torch.int32)
    check_index("prefix_lens", prefix_lens, (groups,), torch.int32)
    check_index("cu_q", cu_q, (groups + 1,), torch.int32)
    check_device(_prefix_attention_kernel, q=q, k_cache=k_cache, v_cache=v_cache,
                 prefix_pages=prefix_pages, prefix_lens=prefix_lens, cu_q=cu_q)
    kc, vc, ks, vs, fp8 = kv_operands(k_cache, v_cache, k_scale, v_scale)
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(t, hq, dtype=torch.float32, device=q.device)
    if t == 0 or groups == 0 or max_pages == 0:
        return o.zero_(), lse.fill_(float("-inf")), []
    group = hq // hkv
    block_m, tile_q, tiles = tile_rows(t, groups, group, 64)
    options = launch_options(q.dtype, _prefix_attention_kernel, block_m, d)
    key_blocks = cdiv(max_pages * page_size, options["BLOCK_N"])
    if num_splits is None:
        num_splits = target_programs(q.device) // (tiles * hkv)
    num_splits = max(1, min(num_splits, key_blocks))
    o_part, lse_part = split_buffers(num_splits, o, lse)
    stride_os = o_part.stride(0) if num_splits > 1 else 0
    stride_ls = lse_part.stride(0) if num_splits > 1 else 0
    launches = [Launch(_prefix_attention_kernel, (tiles, hkv, num_splits), (
        q, kc, vc, o_part, lse_part, prefix_pages, prefix_lens, cu_q, ks, vs,
        groups, scale * LOG2E,
        q.stride(0), q.stride(1), stride_os, o_part.stride(-3), o_part.stride(-2),
        stride_ls, lse_part.stride(-2), lse_part.stride(-1),
        prefix_pages.stride(0), k_cache.stride(1), k_cache.stride(2),
    ), dict(GROUP=group, TILE_Q=tile_q, PAGE_SIZE=page_size, D=d,
            BLOCK_M=block_m, BLOCK_D=max(16, pow2(d)), SOFTCAP=float(softcap), FP8=fp8,
            **options))]
    if num_splits > 1:
        launches.append(plan_combine(o_part, lse_part, o, lse))
    return o, lse, launches
