"""The attention options every kernel takes (kernels/reference/attend.py): a sliding window
(a query at p sees keys p-W+1 .. p) and soft-capped scores (s -> c * tanh(s / c)), for the torch
twins and the C kernels, against dense float64 attention; and the Llama path (no window, no cap)
left as it was: the same results as without the options, bit for bit."""

from __future__ import annotations

import pytest
import torch
from test_reference_attention import (
    HKV,
    STEP,
    c_kernels,
    cascade_args,
    cascade_case,
    close,
    rescatter,
    scatter_sequences,
)

from batchllm_kernels.cpu import decode as cpu_decode
from batchllm_kernels.cpu import prefill as cpu_prefill
from batchllm_kernels.reference.merge_states import merge_states_ref
from batchllm_kernels.reference.paged_attention import paged_attention_ref
from batchllm_kernels.reference.prefix_attention import prefix_attention_ref

# (window, softcap): a window shorter than a page, one that spans pages and a key block,
# soft-capping alone and with a window (Gemma 2's sliding layers).
OPTIONS = [(1, 0.0), (7, 0.0), (70, 0.0), (0, 5.0), (13, 5.0)]


def dense(q, k, v, q_pos, kv_lo, scale, window=0, softcap=0.0):
    """q [n, Hq, D] at positions q_pos [n]; k, v [ctx, Hkv, D]; keys kv_lo <= j <= q_pos (and
    j > q_pos - window) -> (o [n, Hq, D], lse [n, Hq]) in float64; o = 0, lse = -inf if none."""
    g = q.shape[1] // k.shape[1]
    qd, kd, vd = (x.double().transpose(0, 1) for x in (q, k, v))  # [H, n, D]
    kd, vd = kd.repeat_interleave(g, 0), vd.repeat_interleave(g, 0)
    s = qd @ kd.transpose(1, 2) * scale  # [H, n, ctx]
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    j = torch.arange(k.shape[0])
    mask = (j[None, :] >= kv_lo) & (j[None, :] <= q_pos[:, None])
    if window:
        mask &= j[None, :] > q_pos[:, None] - window
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)  # [H, n]
    p = torch.where(mask, torch.exp(s - lse[..., None].clamp_min(-1e300)), 0.0)
    o = torch.nan_to_num(p) @ vd
    return o.transpose(0, 1), lse.transpose(0, 1)


def step_case(page_size, gqa, d, seed):
    gen = torch.Generator().manual_seed(seed)
    ks = [torch.randn(ctx, HKV, d, generator=gen) for _, ctx, _ in STEP]
    vs = [torch.randn(ctx, HKV, d, generator=gen) for _, ctx, _ in STEP]
    k_cache, table = scatter_sequences(ks, page_size, gen)
    v_cache = rescatter(vs, table, page_size, torch.randn(k_cache.shape, generator=gen))
    qs = [torch.randn(n, HKV * gqa, d, generator=gen) * 2 for n, _, _ in STEP]
    cu_q = torch.tensor([0] + [n for n, _, _ in STEP], dtype=torch.int32).cumsum(0).int()
    ctx = torch.tensor([c for _, c, _ in STEP], dtype=torch.int32)
    start = torch.tensor([s for _, _, s in STEP], dtype=torch.int32)
    return ks, vs, qs, (k_cache, v_cache, table, cu_q, ctx, start)


IMPLS = {"torch": paged_attention_ref, "c-decode": c_kernels(True, False),
         "c-prefill": c_kernels(False, True), "c-both": c_kernels(True, True)}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("window, softcap", OPTIONS)
@pytest.mark.parametrize("gqa, d", [(3, 64)])
@pytest.mark.parametrize("page_size", [1, 16])
def test_paged_attention_window_and_softcap(page_size, gqa, d, window, softcap, impl):
    ks, vs, qs, (k_cache, v_cache, table, cu_q, ctx, start) = step_case(
        page_size, gqa, d, page_size + gqa + d + window)
    scale = d**-0.5
    o, lse = IMPLS[impl](torch.cat(qs), k_cache, v_cache, table, cu_q, ctx, start, scale,
                         window=window, softcap=softcap)
    for b, (n, c, s) in enumerate(STEP):
        eo, el = dense(qs[b], ks[b], vs[b], torch.arange(c - n, c), s, scale, window, softcap)
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        close(o[rows], eo, 2e-5)
        close(lse[rows], el, 2e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_no_window_no_cap_is_the_plain_path(impl):
    """window=0, softcap=0 give the very bits of a call without them."""
    _, _, qs, args = step_case(16, 3, 64, 5)
    q = torch.cat(qs)
    plain = IMPLS[impl](q, *args, 0.125)
    again = IMPLS[impl](q, *args, 0.125, window=0, softcap=0.0)
    assert all(torch.equal(a, b) for a, b in zip(plain, again))


@pytest.mark.parametrize("c_prefix", [False, True], ids=["torch", "c"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_soft_capped_cascade_equals_full_attention(page_size, c_prefix):
    """The shared-prefix part with soft-capped scores, merged with the own part, equals
    soft-capped attention over all keys (a global layer of Gemma 2 under prefix sharing)."""
    if c_prefix and (cpu_prefill.load() is None or cpu_decode.load() is None):
        pytest.skip("the C kernels could not be built here")
    gen = torch.Generator().manual_seed(page_size)
    d, cap, plens = 64, 5.0, [17, 70]
    ks, vs, reqs, k_cache, v_cache, table, prefix_pages = cascade_case(page_size, plens, d, gen)
    q = torch.randn(sum(m for _, _, m in reqs), HKV * 3, d, generator=gen) * 2
    cu_q, ctx, start, cu_g, lens = cascade_args(reqs, plens)
    scale = d**-0.5
    if c_prefix:
        o, lse = c_kernels(True, True)(q, k_cache, v_cache, table, cu_q, ctx, start, scale,
                                       softcap=cap)
        cpu_prefill.prefix_attention_into(q, k_cache, v_cache, prefix_pages, lens, cu_g, scale,
                                          o, lse, softcap=cap)
    else:
        o_p, l_p = prefix_attention_ref(q, k_cache, v_cache, prefix_pages, lens, cu_g, scale,
                                        softcap=cap)
        o_s, l_s = paged_attention_ref(q, k_cache, v_cache, table, cu_q, ctx, start, scale,
                                       softcap=cap)
        o, lse = merge_states_ref(o_p, l_p, o_s, l_s)
    row = 0
    for b, (_, c, m) in enumerate(reqs):
        eo, el = dense(q[row : row + m], ks[b], vs[b], torch.arange(c - m, c), 0, scale,
                       softcap=cap)
        close(o[row : row + m], eo, 2e-5)
        close(lse[row : row + m], el, 2e-5)
        row += m
