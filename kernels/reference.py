"""Pure-torch twins of the Triton kernels: the CPU path of the engine and the kernels' references.

Cache layout (one pair per layer): k_cache, v_cache of shape [num_pages, page_size, Hkv, D].
A token at position p of a sequence lives in slot page_table[p // page_size] * page_size
+ p % page_size. Query head h reads KV head h // (Hq // Hkv), as in Hugging Face's repeat_kv.
Attention returns the output and the natural-log sum-exp of the scaled scores per query and
head, so that parts over disjoint key sets can be merged with `merge_states_ref`.
"""

from __future__ import annotations

import torch

_QUERY_BLOCK = 256  # query rows per product for long chunks, bounds the score matrix
_DECODE_BUCKET = 64  # one-query sequences padded together


def store_kv_ref(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    """Write each token's K and V into its slot of the paged cache."""
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _attend(
    q: torch.Tensor,  # [B, Tq, Hq, D]
    k: torch.Tensor,  # [B, Hkv, Tk, D]
    v: torch.Tensor,  # [B, Hkv, Tk, D]
    mask: torch.Tensor | None,  # [B, Tq, Tk] bool, True where the key is visible; None: all
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked grouped-query attention on padded batches -> (o [B,Tq,Hq,D], lse [B,Tq,Hq] fp32)."""
    b, tq, hq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    g = hq // hkv
    qg = (q * scale).view(b, tq, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * tq, d)
    s = torch.matmul(qg, k.transpose(-1, -2)).float()  # [B, Hkv, G*Tq, Tk]
    if mask is not None:
        s = s.view(b, hkv, g, tq, tk).masked_fill_(~mask[:, None, None], float("-inf"))
        s = s.view(b, hkv, g * tq, tk)
    m = s.amax(dim=-1, keepdim=True)  # [B, Hkv, G*Tq, 1]
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # a row with no visible key
    p = s.sub_(m).exp_()
    total = p.sum(dim=-1, keepdim=True)
    o = torch.matmul(p.to(v.dtype), v)  # [B, Hkv, G*Tq, D]
    o = o / torch.where(total > 0, total, torch.ones_like(total)).to(o.dtype)
    lse = (m + torch.log(total)).squeeze(-1)  # log 0 = -inf for an empty row
    o = o.view(b, hkv, g, tq, d).permute(0, 3, 1, 2, 4).reshape(b, tq, hq, d)
    lse = lse.view(b, hkv, g, tq).permute(0, 3, 1, 2).reshape(b, tq, hq)
    return o, lse


def _attend_one_query(
    q: torch.Tensor,  # [B, Hq, D]
    k: torch.Tensor,  # [B, Tk, Hkv, D]
    v: torch.Tensor,  # [B, Tk, Hkv, D]
    visible: torch.Tensor,  # [B, Tk] bool
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # o [B, Hq, D], lse [B, Hq] fp32
    """One query per sequence. Scores per KV head (K made heads-first), values by one product
    per sequence with the probabilities as [Hq, Tk], keeping the diagonal blocks (the query
    heads of KV head h against h's values): V is read in place."""
    b, hq, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    qt = (q * scale).view(b, hkv, g, d).transpose(-1, -2)  # [B, Hkv, D, G]
    s = torch.matmul(_heads_first(k), qt).float()  # [B, Hkv, Tk, G]
    s.masked_fill_(~visible[:, None, :, None], float("-inf"))
    m = s.amax(dim=2, keepdim=True)  # [B, Hkv, 1, G]
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = s.sub_(m).exp_()
    total = p.sum(dim=2).reshape(b, hq)  # [B, Hq]
    probs = p.permute(0, 1, 3, 2).reshape(b, hq, tk)  # [B, Hq, Tk]
    o_all = torch.bmm(probs.to(v.dtype), v.reshape(b, tk, hkv * d))  # [B, Hq, Hkv*D]
    o = torch.diagonal(o_all.view(b, hkv, g, hkv, d), dim1=1, dim2=3)  # [B, G, D, Hkv]
    o = o.permute(0, 3, 1, 2).reshape(b, hq, d)
    o = o / torch.where(total > 0, total, torch.ones_like(total))[..., None].to(o.dtype)
    return o, m.reshape(b, hq) + torch.log(total)


def _gather(
    cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    slots: torch.Tensor,  # [B, Tk] int64
) -> torch.Tensor:  # [B, Tk, Hkv, D]
    hkv, d = cache.shape[2], cache.shape[3]
    rows = cache.view(-1, hkv, d).index_select(0, slots.reshape(-1))  # index_select: fast path
    return rows.view(*slots.shape, hkv, d)


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[B, Tk, Hkv, D] -> [B, Hkv, Tk, D], contiguous."""
    return x.permute(0, 2, 1, 3).contiguous()


def _slots(
    page_table: torch.Tensor,  # [B, max_pages]
    positions: torch.Tensor,  # [B, Tk] int64, valid positions
    page_size: int,
) -> torch.Tensor:  # [B, Tk] int64
    pages = torch.gather(page_table.long(), 1, positions // page_size)
    return pages * page_size + positions % page_size


def paged_attention_ref(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,
    page_table: torch.Tensor,  # [B, max_pages] int32
    cu_q: torch.Tensor,  # [B+1] int32, query rows of sequence b: cu_q[b]:cu_q[b+1]
    context_lens: torch.Tensor,  # [B] int32, tokens in the cache after this step
    kv_start: torch.Tensor,  # [B] int32, first key position of this part
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # o [T, Hq, D], lse [T, Hq] fp32
    """Causal attention of a step that mixes prefill chunks and decodes over paged KV.

    The query at position p of sequence b sees keys at positions kv_start[b] <= j <= p, where the
    sequence's queries hold its last q_len positions before context_lens[b]. Decodes (one query)
    run as one padded batch; longer chunks one by one, in blocks of query rows.
    """
    t, hq, d = q.shape
    page_size = k_cache.shape[1]
    o = q.new_zeros(t, hq, d)
    lse = torch.full((t, hq), float("-inf"), dtype=torch.float32, device=q.device)
    if t == 0:
        return o, lse
    cu = cu_q.tolist()
    ctx = context_lens.tolist()
    start = kv_start.tolist()
    decodes = sorted((b for b in range(len(ctx)) if cu[b + 1] - cu[b] == 1),
                     key=lambda b: ctx[b] - start[b])
    for lo in range(0, len(decodes), _DECODE_BUCKET):  # similar lengths: little padding
        bucket = decodes[lo : lo + _DECODE_BUCKET]
        _decode_batch(q, k_cache, v_cache, page_table, cu, ctx, start, bucket, scale, o, lse)
    for b in range(len(ctx)):
        n = cu[b + 1] - cu[b]
        if n <= 1:
            continue
        keys = torch.arange(start[b], ctx[b], device=q.device)  # [Tk]
        slots = _slots(page_table[b : b + 1], keys[None], page_size)  # [1, Tk]
        k = _heads_first(_gather(k_cache, slots))  # [1, Hkv, Tk, D]
        v = _heads_first(_gather(v_cache, slots))
        first = ctx[b] - n
        for lo in range(0, n, _QUERY_BLOCK):
            hi = min(n, lo + _QUERY_BLOCK)
            qpos = torch.arange(first + lo, first + hi, device=q.device)  # [Tq]
            mask = keys[None, :] <= qpos[:, None]  # [Tq, Tk]
            ob, lb = _attend(q[None, cu[b] + lo : cu[b] + hi], k, v, mask[None], scale)
            o[cu[b] + lo : cu[b] + hi] = ob[0]
            lse[cu[b] + lo : cu[b] + hi] = lb[0]
    return o, lse


def _decode_batch(q, k_cache, v_cache, page_table, cu, ctx, start, seqs, scale, o, lse) -> None:
    """One-query sequences as one padded batch; writes into o and lse in place."""
    page_size = k_cache.shape[1]
    dev = q.device
    rows = torch.tensor([cu[b] for b in seqs], device=dev)  # [B]
    first = torch.tensor([start[b] for b in seqs], device=dev)  # [B]
    length = torch.tensor([ctx[b] - start[b] for b in seqs], device=dev)  # [B]
    tk = max(1, int(length.max()))
    offs = torch.arange(tk, device=dev)
    visible = offs[None, :] < length[:, None]  # [B, Tk]
    positions = torch.where(visible, first[:, None] + offs[None, :], 0)
    table = page_table[torch.tensor(seqs, device=dev)]
    slots = _slots(table, positions, page_size)  # [B, Tk]
    k = _gather(k_cache, slots)  # [B, Tk, Hkv, D]
    v = _gather(v_cache, slots)
    ob, lb = _attend_one_query(q[rows], k, v, visible, scale)
    o[rows] = ob
    lse[rows] = lb


def prefix_attention_ref(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,
    prefix_pages: torch.Tensor,  # [G, max_pages] int32
    prefix_lens: torch.Tensor,  # [G] int32
    cu_q: torch.Tensor,  # [G+1] int32, query rows of group g: cu_q[g]:cu_q[g+1]
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # o [T, Hq, D], lse [T, Hq] fp32
    """Each group's queries against its shared prefix, no mask: the prefix KV is read once per
    group and the product is matrix-matrix over all the group's queries."""
    t, hq, d = q.shape
    page_size = k_cache.shape[1]
    o = q.new_zeros(t, hq, d)
    lse = torch.full((t, hq), float("-inf"), dtype=torch.float32, device=q.device)
    cu = cu_q.tolist()
    for g, plen in enumerate(prefix_lens.tolist()):
        if plen == 0 or cu[g + 1] == cu[g]:
            continue
        pages = prefix_pages[g, : -(-plen // page_size)].tolist()
        k = _heads_first(_prefix_keys(k_cache, pages, plen)[None])  # [1, Hkv, P, D]
        v = _heads_first(_prefix_keys(v_cache, pages, plen)[None])
        # All queries of the group go in as one "sequence": one product per KV head.
        for lo in range(cu[g], cu[g + 1], _QUERY_BLOCK):
            hi = min(cu[g + 1], lo + _QUERY_BLOCK)
            ob, lb = _attend(q[None, lo:hi], k, v, None, scale)
            o[lo:hi], lse[lo:hi] = ob[0], lb[0]
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


def merge_states_ref(
    o_a: torch.Tensor,  # [T, H, D]
    lse_a: torch.Tensor,  # [T, H] fp32
    o_b: torch.Tensor,  # [T, H, D]
    lse_b: torch.Tensor,  # [T, H] fp32
) -> tuple[torch.Tensor, torch.Tensor]:  # o [T, H, D], lse [T, H] fp32
    """Merge attention over two disjoint key sets by the log-sum-exp rule.

    m = max(lse_a, lse_b); lse = m + log(e^(lse_a-m) + e^(lse_b-m));
    o = e^(lse_a-lse) o_a + e^(lse_b-lse) o_b. A part with lse = -inf contributes nothing;
    two empty parts give o = 0 and lse = -inf.
    """
    lse_a = lse_a.float()
    lse_b = lse_b.float()
    m = torch.maximum(lse_a, lse_b)
    empty = torch.isinf(m) & (m < 0)
    m = torch.where(empty, torch.zeros_like(m), m)
    wa = torch.exp(lse_a - m)
    wb = torch.exp(lse_b - m)
    total = wa + wb
    lse = torch.where(empty, torch.full_like(m, float("-inf")), m + torch.log(total))
    denom = torch.where(empty, torch.ones_like(total), total)
    o = (o_a.float() * (wa / denom)[..., None] + o_b.float() * (wb / denom)[..., None])
    return o.to(o_a.dtype), lse
