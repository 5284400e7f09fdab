"""The pure-torch twins (kernels/reference/) against plain torch attention.

The reference gathers nothing: each sequence's K and V are drawn contiguous, scattered by the
test into randomly permuted pages, and torch's scaled_dot_product_attention runs over the
contiguous originals with an explicit mask (float64); lse is a direct logsumexp of the scores.
"""

from __future__ import annotations

import functools
import importlib
import sys

import pytest
import torch
import torch.nn.functional as F

from batchllm_kernels.cpu import attention as cpu_attention
from batchllm_kernels.cpu import build
from batchllm_kernels.cpu import decode as cpu_decode
from batchllm_kernels.cpu import ops as cpu_ops
from batchllm_kernels.cpu import prefill as cpu_prefill
from batchllm_kernels.reference.merge_states import merge_states_ref
from batchllm_kernels.reference.paged_attention import paged_attention_ref
from batchllm_kernels.reference.prefix_attention import prefix_attention_ref
from batchllm_kernels.reference.step_index import index_step
from batchllm_kernels.reference.store_kv import store_kv_ref

HKV = 2


def scatter_sequences(kv: list[torch.Tensor], page_size: int, gen: torch.Generator):
    """Contiguous per-sequence K (or V) [n_b, Hkv, D] -> (cache [P, page_size, Hkv, D],
    page_table [B, max_pages] int32, -1 padded) over randomly permuted pages."""
    counts = [-(-x.shape[0] // page_size) for x in kv]
    perm = torch.randperm(sum(counts) + 2, generator=gen).int()  # + 2 pages never used
    table = torch.full((len(kv), max(max(counts), 1)), -1, dtype=torch.int32)
    pos = 0
    for b, n in enumerate(counts):
        table[b, :n] = perm[pos : pos + n]
        pos += n
    hkv, d = kv[0].shape[1:]
    cache = torch.randn(len(perm), page_size, hkv, d, generator=gen, dtype=kv[0].dtype)
    for b, x in enumerate(kv):
        p = torch.arange(x.shape[0])
        slots = table[b, p // page_size].long() * page_size + p % page_size
        cache.view(-1, hkv, d)[slots] = x
    return cache, table


def rescatter(kv, table, page_size, cache):
    """Write per-sequence tensors into `cache` at the pages of an existing table."""
    hkv, d = cache.shape[2:]
    for b, x in enumerate(kv):
        p = torch.arange(x.shape[0])
        cache.view(-1, hkv, d)[table[b, p // page_size].long() * page_size + p % page_size] = x
    return cache


def sdpa_reference(q, k, v, q_pos, kv_lo, scale):
    """q [n, Hq, D] at positions q_pos [n]; k, v [ctx, Hkv, D]; keys kv_lo <= j <= q_pos.
    -> (o [n, Hq, D] float64, lse [n, Hq] float64); o = 0 and lse = -inf with no visible key."""
    g = q.shape[1] // k.shape[1]
    qd, kd, vd = (x.double().transpose(0, 1) for x in (q, k, v))  # [H, n, D]
    kd, vd = kd.repeat_interleave(g, 0), vd.repeat_interleave(g, 0)
    j = torch.arange(k.shape[0])
    mask = (j[None, :] >= kv_lo) & (j[None, :] <= q_pos[:, None])  # [n, ctx]
    any_key = mask.any(1)
    safe = mask | ~any_key[:, None]  # sdpa gives NaN on fully masked rows
    o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=safe, scale=scale)
    scores = (qd @ kd.transpose(1, 2) * scale).masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, -1)  # [H, n]
    o = torch.where(any_key[None, :, None], o, 0.0)
    return o.transpose(0, 1), lse.transpose(0, 1)


def close(actual, expected, atol):
    """Equal within atol, with -inf exactly where expected is -inf (and never NaN)."""
    assert not torch.isnan(actual).any()
    actual, expected = actual.double(), expected.double()
    inf = torch.isinf(expected)
    assert torch.equal(torch.isinf(actual), inf)
    excess = (actual - expected).abs() - atol * (1 + expected.abs())
    worst = float(excess.masked_fill(inf, 0).max()) if excess.numel() else 0.0
    assert worst <= 0, f"off by {worst:.3g} beyond atol={atol} (+ atol * |expected|)"


# (query rows, context length, kv_start): decodes, whole prefills, chunks over earlier pages,
# parts that start later (kv_start > 0), an empty part, a chunk partly before its kv_start,
# a sequence without queries this step, and a decode and a chunk over several of the C kernels'
# key blocks (128 and 64) from a start inside a page, the chunk over several 32-query blocks.
STEP = [(1, 1, 0), (1, 17, 0), (1, 37, 0), (1, 129, 0), (17, 17, 0), (37, 129, 0),
        (129, 129, 0), (17, 37, 5), (1, 129, 100), (1, 37, 37), (17, 37, 30), (0, 17, 0),
        (1, 300, 7), (70, 300, 9)]


def c_kernels(decodes: bool, chunks: bool):
    """The CPU path with its decodes and/or its prefill chunks in C (kernels/cpu/attention.py)."""

    def attend(q, k_cache, v_cache, table, cu_q, ctx, start, scale, **options):
        if (decodes and cpu_decode.load() is None) or (chunks and cpu_prefill.load() is None):
            pytest.skip("the C kernels could not be built here")
        step = index_step(table, cu_q, ctx, start, k_cache.shape[1], k_cache.shape[2],
                          gather_decodes=not decodes, gather_chunks=not chunks)
        t, hq, d = q.shape
        wide = torch.zeros(t, hq * d + 5)  # q as the engine passes it: rows of the qkv buffer
        wide[:, : hq * d] = q.reshape(t, hq * d)
        q = wide[:, : hq * d].view(t, hq, d)
        return cpu_attention.paged_attention_cpu(q, k_cache, v_cache, table, cu_q, ctx, start,
                                                 scale, step, **options)

    return attend


@pytest.mark.parametrize("impl", [paged_attention_ref, c_kernels(True, False),
                                  c_kernels(False, True), c_kernels(True, True)],
                         ids=["torch", "c-decode", "c-prefill", "c-both"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("gqa", [1, 3])
@pytest.mark.parametrize("page_size", [1, 5, 16])
def test_paged_attention_matches_sdpa(page_size, gqa, d, impl):
    gen = torch.Generator().manual_seed(page_size * 1000 + gqa * 100 + d)
    hq = HKV * gqa
    ks = [torch.randn(ctx, HKV, d, generator=gen) for _, ctx, _ in STEP]
    vs = [torch.randn(ctx, HKV, d, generator=gen) for _, ctx, _ in STEP]
    k_cache, table = scatter_sequences(ks, page_size, gen)
    v_cache = rescatter(vs, table, page_size, torch.randn(k_cache.shape, generator=gen))
    qs = [torch.randn(n, hq, d, generator=gen) for n, _, _ in STEP]
    cu_q = torch.tensor([0] + [n for n, _, _ in STEP], dtype=torch.int32).cumsum(0).int()
    ctx = torch.tensor([c for _, c, _ in STEP], dtype=torch.int32)
    start = torch.tensor([s for _, _, s in STEP], dtype=torch.int32)
    scale = d**-0.5
    o, lse = impl(torch.cat(qs), k_cache, v_cache, table, cu_q, ctx, start, scale)
    assert o.dtype == torch.float32 and lse.dtype == torch.float32
    for b, (n, c, s) in enumerate(STEP):
        eo, el = sdpa_reference(qs[b], ks[b], vs[b], torch.arange(c - n, c), s, scale)
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        close(o[rows], eo, 1e-5)
        close(lse[rows], el, 1e-5)


def test_paged_attention_bfloat16_close_to_float32():
    gen = torch.Generator().manual_seed(7)
    step = [(1, 37, 0), (17, 129, 0), (5, 17, 3)]
    ks = [torch.randn(c, HKV, 64, generator=gen) for _, c, _ in step]
    k_cache, table = scatter_sequences(ks, 16, gen)
    v_cache = torch.randn(k_cache.shape, generator=gen)
    q = torch.randn(23, HKV * 3, 64, generator=gen)
    cu_q = torch.tensor([0, 1, 18, 23], dtype=torch.int32)
    ctx = torch.tensor([37, 129, 17], dtype=torch.int32)
    start = torch.tensor([0, 0, 3], dtype=torch.int32)
    args = (table, cu_q, ctx, start, 0.125)
    o32, l32 = paged_attention_ref(q, k_cache, v_cache, *args)
    bf = [x.bfloat16() for x in (q, k_cache, v_cache)]
    o16, l16 = paged_attention_ref(*bf, *args)
    assert o16.dtype == torch.bfloat16
    close(o16.float(), o32, 3e-2)
    close(l16, l32, 3e-2)


def cascade_case(page_size, prefix_lens, d, gen, own=((3, 20), (1, 9, 40)),
                 qlen=((1, 5), (1, 1, 17)), hkv=HKV):
    """Groups of requests sharing a prefix each (two by default); every request has own tokens
    after it (`own`, per request per group) and queries (`qlen`: a decode or a chunk) at its end.
    Shared full pages appear in every table of the group; a partial last prefix page is copied
    into each request's own first page. `hkv` KV heads."""
    prefixes = [torch.randn(p, hkv, d, generator=gen) for p in prefix_lens]
    vprefixes = [torch.randn(p, hkv, d, generator=gen) for p in prefix_lens]
    ks, vs, reqs = [], [], []
    for g, p in enumerate(prefix_lens):
        for n, m in zip(own[g], qlen[g]):
            ks.append(torch.cat([prefixes[g], torch.randn(n, hkv, d, generator=gen)]))
            vs.append(torch.cat([vprefixes[g], torch.randn(n, hkv, d, generator=gen)]))
            reqs.append((g, p + n, m))
    k_cache, table = scatter_sequences(ks, page_size, gen)
    full_pages = [p // page_size for p in prefix_lens]
    first = [next(i for i, r in enumerate(reqs) if r[0] == g) for g in range(len(prefix_lens))]
    for i, (g, _, _) in enumerate(reqs):  # share the group's full prefix pages
        table[i, : full_pages[g]] = table[first[g], : full_pages[g]]
    k_cache = rescatter(ks, table, page_size, k_cache)
    v_cache = rescatter(vs, table, page_size, torch.randn(k_cache.shape, generator=gen))
    width = max(-(-p // page_size) for p in prefix_lens) or 1
    prefix_pages = torch.full((len(prefix_lens), width), -1, dtype=torch.int32)
    for g, p in enumerate(prefix_lens):
        n = -(-p // page_size)
        prefix_pages[g, :n] = table[first[g], :n]
    return ks, vs, reqs, k_cache, v_cache, table, prefix_pages


def cascade_args(reqs, plens):
    """-> cu_q, context_lens, kv_start (= the group's prefix length) per request; cu_q of the
    groups; prefix lengths."""
    qlens = [m for _, _, m in reqs]
    cu_q = torch.tensor([0] + qlens).cumsum(0).int()
    ctx = torch.tensor([c for _, c, _ in reqs], dtype=torch.int32)
    start = torch.tensor([plens[g] for g, _, _ in reqs], dtype=torch.int32)
    per_group = [sum(m for g, _, m in reqs if g == i) for i in range(len(plens))]
    cu_g = torch.tensor([0] + per_group).cumsum(0).int()
    return cu_q, ctx, start, cu_g, torch.tensor(plens, dtype=torch.int32)


def run_cascade(paged, prefix, merge, q, k_cache, v_cache, table, prefix_pages, reqs, plens,
                scale):
    """Cascade (prefix part + own part from kv_start = prefix_len, merged) and the full paged
    attention from 0 -> ((o, lse), (o, lse))."""
    cu_q, ctx, start, cu_g, lens = cascade_args(reqs, plens)
    o_p, l_p = prefix(q, k_cache, v_cache, prefix_pages, lens, cu_g, scale)
    o_s, l_s = paged(q, k_cache, v_cache, table, cu_q, ctx, start, scale)
    full = paged(q, k_cache, v_cache, table, cu_q, ctx, torch.zeros_like(start), scale)
    return merge(o_p, l_p, o_s, l_s), full

def assert_full_attention(o, lse, q, ks, vs, reqs, scale):
    """Each request's rows equal SDPA over all its keys from position 0 (float64)."""
    row = 0
    for b, (_, c, m) in enumerate(reqs):
        eo, el = sdpa_reference(q[row : row + m], ks[b], vs[b], torch.arange(c - m, c), 0, scale)
        close(o[row : row + m], eo, 1e-5)
        close(lse[row : row + m], el, 1e-5)
        row += m


@pytest.mark.parametrize("prefix_lens", [(1, 129), (17, 37), (0, 16)])
@pytest.mark.parametrize("gqa", [1, 3])
@pytest.mark.parametrize("page_size", [1, 16])
def test_cascade_equals_full_attention(page_size, prefix_lens, gqa):
    gen = torch.Generator().manual_seed(page_size + gqa + sum(prefix_lens))
    d, hq = 64, HKV * gqa
    ks, vs, reqs, k_cache, v_cache, table, prefix_pages = cascade_case(
        page_size, prefix_lens, d, gen)
    q = torch.randn(sum(m for _, _, m in reqs), hq, d, generator=gen)
    (o, lse), (o_full, lse_full) = run_cascade(
        paged_attention_ref, prefix_attention_ref, merge_states_ref, q, k_cache, v_cache,
        table, prefix_pages, reqs, list(prefix_lens), d**-0.5)
    close(o, o_full, 1e-5)
    close(lse, lse_full, 1e-5)
    assert_full_attention(o, lse, q, ks, vs, reqs, d**-0.5)



@pytest.mark.parametrize("prefix_lens", [(1, 129), (17, 37), (0, 16), (200, 70)])
@pytest.mark.parametrize("gqa", [1, 3])
@pytest.mark.parametrize("page_size", [1, 16])
def test_c_cascade_equals_full_attention(page_size, prefix_lens, gqa):
    """The C path: own parts by the C kernels, then each group's prefix part merged into them in
    place (cpu_prefill.prefix_attention_into) = full attention from position 0."""
    if cpu_prefill.load() is None or cpu_decode.load() is None:
        pytest.skip("the C kernels could not be built here")
    gen = torch.Generator().manual_seed(page_size + gqa + sum(prefix_lens))
    d, hq = 64, HKV * gqa
    ks, vs, reqs, k_cache, v_cache, table, prefix_pages = cascade_case(
        page_size, prefix_lens, d, gen)
    q = torch.randn(sum(m for _, _, m in reqs), hq, d, generator=gen)
    cu_q, ctx, start, cu_g, lens = cascade_args(reqs, list(prefix_lens))
    o, lse = c_kernels(True, True)(q, k_cache, v_cache, table, cu_q, ctx, start, d**-0.5)
    cpu_prefill.prefix_attention_into(q, k_cache, v_cache, prefix_pages, lens, cu_g, d**-0.5,
                                      o, lse)
    assert_full_attention(o, lse, q, ks, vs, reqs, d**-0.5)


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("decodes", [1, 7, 8, 23, 33, 70])
def test_c_prefix_of_one_group_of_decodes(decodes, threads):
    """One group of decodes, as every decode step under a shared prefix makes: the kernel cuts a
    lone group's queries finer so that its KV heads x blocks split evenly between the threads (3
    KV heads x 2 blocks of 4 to 16 queries for 8 to 32 decodes on 2 threads); every row still
    equals full attention from position 0."""
    if cpu_prefill.load() is None or cpu_decode.load() is None:
        pytest.skip("the C kernels could not be built here")
    gen = torch.Generator().manual_seed(decodes + threads)
    d, hkv = 64, 3  # as SmolLM2: 9 query heads on 3 KV heads
    own = tuple(int(n) for n in torch.randint(1, 30, (decodes,), generator=gen))
    ks, vs, reqs, k_cache, v_cache, table, prefix_pages = cascade_case(
        16, (45,), d, gen, own=(own,), qlen=((1,) * decodes,), hkv=hkv)
    q = torch.randn(decodes, 3 * hkv, d, generator=gen)
    cu_q, ctx, start, cu_g, lens = cascade_args(reqs, [45])
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        o, lse = c_kernels(True, True)(q, k_cache, v_cache, table, cu_q, ctx, start, d**-0.5)
        cpu_prefill.prefix_attention_into(q, k_cache, v_cache, prefix_pages, lens, cu_g,
                                          d**-0.5, o, lse)
    finally:
        torch.set_num_threads(saved)
    assert_full_attention(o, lse, q, ks, vs, reqs, d**-0.5)


@pytest.mark.parametrize("d", [64, 80])
def test_c_prefill_builds_agree(d, monkeypatch):
    """The prefill kernel as this machine builds it (with AVX-512: 32-key score tiles, 64-wide
    value tiles, then 16-wide ones for the rest of d or of a block's keys) and built without
    AVX-512 (8-wide tiles): every score and output the same chain of FMAs, so the same bits;
    both equal full attention (chunks over several key blocks, prefixes of 1-200 keys)."""
    if cpu_prefill.load() is None or cpu_decode.load() is None:
        pytest.skip("the C kernels could not be built here")
    gen = torch.Generator().manual_seed(d)
    ks, vs, reqs, k_cache, v_cache, table, prefix_pages = cascade_case(
        16, (200, 37), d, gen, own=((3, 70), (1, 9, 40)), qlen=((1, 70), (1, 1, 17)))
    q = torch.randn(sum(m for _, _, m in reqs), HKV * 3, d, generator=gen)
    cu_q, ctx, start, cu_g, lens = cascade_args(reqs, [200, 37])

    def run():
        o, lse = c_kernels(False, True)(q, k_cache, v_cache, table, cu_q, ctx, start, d**-0.5)
        cpu_prefill.prefix_attention_into(q, k_cache, v_cache, prefix_pages, lens, cu_g,
                                          d**-0.5, o, lse)
        return o, lse

    native = run()
    assert_full_attention(*native, q, ks, vs, reqs, d**-0.5)
    monkeypatch.setattr(build, "_FLAGS", (*build._FLAGS, "-mno-avx512f"))
    monkeypatch.setattr(cpu_prefill, "load", functools.cache(cpu_prefill.load.__wrapped__))
    narrow = run()
    assert torch.equal(native[0], narrow[0]) and torch.equal(native[1], narrow[1])


def merge_case(t, h, d, dtype, gen):
    """Random states with lse = -inf (o = 0) in a, in b, and in both, on some rows."""
    o_a, o_b = (torch.randn(t, h, d, generator=gen).to(dtype) for _ in range(2))
    lse_a, lse_b = (torch.randn(t, h, generator=gen) * 4 for _ in range(2))
    for lse, o, rows in ((lse_a, o_a, [0, 2]), (lse_b, o_b, [1, 2])):
        lse[rows] = float("-inf")
        o[rows] = 0
    lse_a[3, 0] = float("-inf")
    o_a[3, 0] = 0
    return o_a, lse_a, o_b, lse_b


def test_merge_states_matches_logaddexp():
    gen = torch.Generator().manual_seed(3)
    o_a, lse_a, o_b, lse_b = merge_case(6, 5, 64, torch.float32, gen)
    o, lse = merge_states_ref(o_a, lse_a, o_b, lse_b)
    expected_lse = torch.logaddexp(lse_a.double(), lse_b.double())
    w_a = torch.exp(lse_a.double() - expected_lse).nan_to_num(0.0)[..., None]
    w_b = torch.exp(lse_b.double() - expected_lse).nan_to_num(0.0)[..., None]
    close(lse, expected_lse, 1e-6)
    close(o, w_a * o_a.double() + w_b * o_b.double(), 1e-6)
    assert torch.equal(o[2], torch.zeros_like(o[2])) and torch.isinf(lse[2]).all()
    torch.testing.assert_close(o[0], o_b[0])  # a empty: b unchanged
    torch.testing.assert_close(o[1], o_a[1])


def test_c_store_kv_equals_the_twin():
    if cpu_ops.load() is None:
        pytest.skip("the C kernels could not be built here")
    gen = torch.Generator().manual_seed(6)
    qkv = torch.randn(5, (3 + 2 * 2) * HKV * 8, generator=gen)  # rows of a qkv projection
    k = qkv[:, 3 * HKV * 8 : 4 * HKV * 8].view(5, HKV, 8)  # rows apart, heads contiguous
    v = qkv[:, 4 * HKV * 8 : 5 * HKV * 8].view(5, HKV, 8)
    slots = torch.tensor([0, 17, 63, 5, 40])
    caches = [torch.randn(4, 16, HKV, 8, generator=gen) for _ in range(2)]
    expected = [c.clone() for c in caches]
    store_kv_ref(k, v, *expected, slots)
    cpu_ops.store_kv_c(k, v, *caches, slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


def test_store_kv_writes_slots():
    gen = torch.Generator().manual_seed(5)
    k_cache = torch.zeros(4, 16, HKV, 8, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    k, v = torch.randn(3, HKV, 8, generator=gen), torch.randn(3, HKV, 8, generator=gen)
    store_kv_ref(k, v, k_cache, v_cache, torch.tensor([0, 17, 63]))
    assert torch.equal(k_cache[1, 1], k[1].bfloat16())
    assert torch.equal(v_cache[3, 15], v[2].bfloat16())
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 3


def test_import_kernels_without_triton(monkeypatch):
    """kernels, its twins and its C path import without triton (and do not import it); the
    Triton launchers raise ImportError saying they need it."""
    for name in list(sys.modules):
        if name.split(".")[0] in ("batchllm_kernels", "triton"):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "triton", None)  # "import triton" raises ImportError
    importlib.import_module("batchllm_kernels")
    for name in ("attention", "build", "decode", "linear", "ops", "prefill"):
        importlib.import_module(f"batchllm_kernels.cpu.{name}")
    fresh = importlib.import_module("batchllm_kernels.reference.paged_attention")
    assert callable(fresh.paged_attention_ref)
    with pytest.raises(ImportError, match="needs triton"):
        importlib.import_module("batchllm_kernels.triton.paged_attention")
