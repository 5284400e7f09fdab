"""Pure-torch twin of the Triton prefix attention (kernels/triton/prefix_attention.py): each
group's queries against its shared prefix pages, no mask (cascade attention).

Cache layout (one pair per layer): k_cache, v_cache of shape [num_pages, page_size, Hkv, D].
A token at position p of a sequence lives in slot page_table[p // page_size] * page_size
+ p % page_size. An FP8 cache is read as fp8 * the KV head's scale (kv_fp8.py), in q's dtype.
"""

from __future__ import annotations

import torch

from batchllm_kernels.reference.attend import attend_rows
from batchllm_kernels.reference.kv_fp8 import dequantize_kv


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[B, Tk, Hkv, D] -> [B, Hkv, Tk, D], a view."""
    return x.permute(0, 2, 1, 3)


def prefix_attention_ref(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,
    prefix_pages: torch.Tensor,  # [G, max_pages] int32
    prefix_lens: torch.Tensor,  # [G] int32
    cu_q: torch.Tensor,  # [G+1] int32, query rows of group g: cu_q[g]:cu_q[g+1]
    scale: float,
    *,
    softcap: float = 0.0,
    k_scale: torch.Tensor | None = None,  # [Hkv] fp32: the scales of an FP8 cache
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # o [T, Hq, D], lse [T, Hq] fp32
    """Each group's queries against its shared prefix, no mask: the prefix KV is read once per
    group and the product is matrix-matrix over all the group's queries. softcap c > 0: scores
    s -> c * tanh(s / c) after scaling. (No window: a windowed layer does not split off its
    shared prefix, batchllm/model/attention.py.)"""
    t, hq, d = q.shape
    page_size = k_cache.shape[1]
    o = q.new_zeros(t, hq, d)
    lse = torch.full((t, hq), float("-inf"), dtype=torch.float32, device=q.device)
    cu = cu_q.tolist()
    for g, plen in enumerate(prefix_lens.tolist()):
        if plen == 0 or cu[g + 1] == cu[g]:
            continue
        pages = prefix_pages[g, : -(-plen // page_size)].tolist()
        k = _prefix_keys(k_cache, pages, plen)  # [P, Hkv, D]
        v = _prefix_keys(v_cache, pages, plen)
        if k_scale is not None:
            k = dequantize_kv(k, k_scale, q.dtype, heads_dim=1)
            v = dequantize_kv(v, v_scale, q.dtype, heads_dim=1)
        k, v = _heads_first(k[None]), _heads_first(v[None])  # [1, Hkv, P, D]
        # All queries of the group go in as one "sequence": the prefix is read once.
        rows = slice(cu[g], cu[g + 1])
        o[rows], lse[rows] = attend_rows(q[rows], k, v, None, scale,
                                         softcap=softcap)
    return o, lse


def _prefix_keys(
    cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    pages: list[int],
    length: int,
) -> torch.Tensor:  # [length, Hkv, D]
    """A prefix's keys (or values): a view of the cache when its pages are consecutive (a prefix
    computed in one step usually is), else a gathered copy."""
    hkv, d = cache.shape[2], cache.shape[3]
    if pages == list(range(pages[0], pages[0] + len(pages))):
        run = cache[pages[0] : pages[0] + len(pages)]
    else:
        run = cache.index_select(0, torch.tensor(pages, device=cache.device))
    return run.view(-1, hkv, d)[:length]
