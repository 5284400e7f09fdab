"""Pure-torch twin of the Triton paged attention (kernels/triton/paged_attention.py): causal
attention of a step that mixes prefill chunks and decodes over paged KV. The CPU path's twin too:
kernels/cpu/attention.py runs a part in C where its kernel builds, the rest here.

Cache layout (one pair per layer): k_cache, v_cache of shape [num_pages, page_size, Hkv, D].
A token at position p of a sequence lives in slot page_table[p // page_size] * page_size
+ p % page_size. The keys each sequence reads are indexed once per step (step_index.py). An FP8
cache (float8_e4m3fn) is read as fp8 * the KV head's scale (kv_fp8.py), in q's dtype.
"""

from __future__ import annotations

import torch

from batchllm_kernels.reference.attend import attend_rows, soft_cap, visible_keys
from batchllm_kernels.reference.kv_fp8 import dequantize_kv
from batchllm_kernels.reference.step_index import StepIndex, index_step


def _attend_one_query(
    q: torch.Tensor,  # [B, Hq, D]
    k: torch.Tensor,  # [B, Hkv, Tk, D]
    v: torch.Tensor,  # [B, Hkv, Tk, D]
    bias: torch.Tensor,  # [B, 1, 1, Tk] fp32, 0 where visible, -inf elsewhere
    scale: float,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # o [B, Hq, D], lse [B, Hq] fp32
    """One query per sequence: the G query heads of KV head h against h's keys in one product
    per (sequence, KV head)."""
    b, hq, d = q.shape
    hkv = k.shape[1]
    qg = (q * scale).view(b, hkv, hq // hkv, d)  # [B, Hkv, G, D]
    s = soft_cap(torch.matmul(qg, k.transpose(-1, -2)).float(), softcap)  # [B, Hkv, G, Tk]
    s.add_(bias)
    m = s.amax(dim=-1, keepdim=True)  # [B, Hkv, G, 1]
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # a sequence with no visible key
    p = s.sub_(m).exp_()
    total = p.sum(dim=-1, keepdim=True)
    o = torch.matmul(p.to(v.dtype), v)  # [B, Hkv, G, D]
    o = o / torch.where(total > 0, total, torch.ones_like(total)).to(o.dtype)
    return o.view(b, hq, d), (m + torch.log(total)).view(b, hq)


def _gather_heads_first(
    cache: torch.Tensor,  # [num_pages, page_size, Hkv, D], contiguous
    rows: torch.Tensor,  # [B * Hkv * Tk] int64, from step_index.py
    shape: tuple[int, int, int],  # (B, Hkv, Tk)
    scale: torch.Tensor | None = None,  # [Hkv] fp32: an FP8 cache, read as fp8 * scale
    dtype: torch.dtype | None = None,  # what an FP8 cache is read into
) -> torch.Tensor:  # [B, Hkv, Tk, D]
    d = cache.shape[-1]
    x = cache.view(-1, d).index_select(0, rows).view(*shape, d)
    return x if scale is None else dequantize_kv(x, scale, dtype, heads_dim=1)


def paged_attention_ref(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,
    page_table: torch.Tensor,  # [B, max_pages] int32
    cu_q: torch.Tensor,  # [B+1] int32, query rows of sequence b: cu_q[b]:cu_q[b+1]
    context_lens: torch.Tensor,  # [B] int32, tokens in the cache after this step
    kv_start: torch.Tensor,  # [B] int32, first key position of this part
    scale: float,
    step: StepIndex | None = None,  # index_step(...) of these arguments, shared by all layers
    *,
    window: int = 0,
    softcap: float = 0.0,
    k_scale: torch.Tensor | None = None,  # [Hkv] fp32: the scales of an FP8 cache
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # o [T, Hq, D], lse [T, Hq] fp32
    """Causal attention of a step that mixes prefill chunks and decodes over paged KV.

    The query at position p of sequence b sees keys at positions kv_start[b] <= j <= p, where the
    sequence's queries hold its last q_len positions before context_lens[b]; with window W > 0
    only those > p - W. softcap c > 0: scores s -> c * tanh(s / c) after scaling. Decodes (one
    query) run as padded batches of similar lengths; longer chunks one by one.
    """
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    o = q.new_zeros(t, hq, d)
    lse = torch.full((t, hq), float("-inf"), dtype=torch.float32, device=q.device)
    if t == 0:
        return o, lse
    if step is None:
        step = index_step(page_table, cu_q, context_lens, kv_start, k_cache.shape[1], hkv)
    if (len(step.decode_seqs) and not step.decodes) or (len(step.chunk_seqs) and not step.chunks):
        raise ValueError("paged_attention_ref: the step was indexed without gather rows")
    scales = None if k_scale is None else (k_scale, v_scale)
    attend_decodes(q, k_cache, v_cache, step, scale, o, lse, window, softcap, scales)
    attend_chunks(q, k_cache, v_cache, step, scale, o, lse, window, softcap, scales)
    return o, lse


def attend_decodes(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,
    step: StepIndex,
    scale: float,
    o: torch.Tensor,  # [T, Hq, D], written at the decodes' rows
    lse: torch.Tensor,  # [T, Hq] fp32, written at the decodes' rows
    window: int = 0,
    softcap: float = 0.0,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # (k, v) [Hkv]: an FP8 cache
) -> None:
    """The one-query sequences of a step, as padded batches of similar lengths."""
    ks, vs = (None, None) if scales is None else scales
    for bucket in step.decodes:
        # [B, Hkv, Tk, D]
        k = _gather_heads_first(k_cache, bucket.kv_rows, bucket.shape, ks, q.dtype)
        v = _gather_heads_first(v_cache, bucket.kv_rows, bucket.shape, vs, q.dtype)
        bias = bucket.bias
        if window > 0:  # keys before the window: out, as the padding is
            seen = visible_keys(bucket.query_pos, bucket.key_pos, window)  # [B, Tk]
            bias = bias.masked_fill(~seen[:, None, None, :], float("-inf"))
        ob, lb = _attend_one_query(q[bucket.rows], k, v, bias, scale, softcap)
        o[bucket.rows], lse[bucket.rows] = ob, lb


def attend_chunks(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,
    step: StepIndex,
    scale: float,
    o: torch.Tensor,  # [T, Hq, D], written at the chunks' rows
    lse: torch.Tensor,  # [T, Hq] fp32, written at the chunks' rows
    window: int = 0,
    softcap: float = 0.0,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # (k, v) [Hkv]: an FP8 cache
) -> None:
    """The sequences of a step with several queries (prefill chunks), one by one."""
    hkv = k_cache.shape[2]
    ks, vs = (None, None) if scales is None else scales
    for chunk in step.chunks:
        shape = (1, hkv, chunk.key_pos.shape[0])
        k = _gather_heads_first(k_cache, chunk.kv_rows, shape, ks, q.dtype)  # [1, Hkv, Tk, D]
        v = _gather_heads_first(v_cache, chunk.kv_rows, shape, vs, q.dtype)
        causal = (chunk.query_pos, chunk.key_pos)
        o[chunk.rows], lse[chunk.rows] = attend_rows(q[chunk.rows], k, v, causal, scale,
                                                     window, softcap)
