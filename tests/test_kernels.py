"""Each Triton launcher against its pure-torch twin.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set
before triton is imported), in float32 and float16 (the interpreter's tl.dot mishandles
bfloat16, so bfloat16 attention is checked on CUDA only). With CUDA they run compiled, in
float32 and bfloat16. The expected values are the twins run in float32 on the same inputs.
"""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import CUDA, load

_checks, _store, _paged, _prefix, _merge = (load(f"batchllm_kernels.triton.{n}") for n in (
    "checks", "store_kv", "paged_attention", "prefix_attention", "merge_states"))
from batchllm_kernels.reference.merge_states import merge_states_ref
from batchllm_kernels.reference.paged_attention import paged_attention_ref
from batchllm_kernels.reference.prefix_attention import prefix_attention_ref
from batchllm_kernels.reference.store_kv import store_kv_ref

DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if CUDA else [torch.float32, torch.float16]
ATOL = {torch.float32: 2e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
HKV = 2


def make_cache(lens, page_size, d, dtype, gen):
    """Random K/V caches with one -1 padded page table row per length, pages shuffled."""
    counts = [-(-n // page_size) for n in lens]
    perm = torch.randperm(sum(counts) + 1, generator=gen).int()
    table = torch.full((len(lens), max(max(counts), 1)), -1, dtype=torch.int32)
    pos = 0
    for b, n in enumerate(counts):
        table[b, :n] = perm[pos : pos + n]
        pos += n
    shape = (len(perm), page_size, HKV, d)
    k_cache, v_cache = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    return k_cache.to(DEVICE), v_cache.to(DEVICE), table.to(DEVICE)


def i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def cu(lengths) -> torch.Tensor:
    return torch.tensor([0, *lengths], device=DEVICE).cumsum(0).int()


def close(actual, expected, atol):
    """Equal within atol, -inf exactly where expected is -inf, never NaN."""
    assert not torch.isnan(actual).any()
    actual, expected = actual.float(), expected.float()
    inf = torch.isinf(expected)
    assert torch.equal(torch.isinf(actual), inf)
    excess = (actual - expected).abs() - atol * (1 + expected.abs())
    worst = float(excess.masked_fill(inf, 0).max()) if excess.numel() else 0.0
    assert worst <= 0, f"off by {worst:.3g} beyond atol={atol} (+ atol * |expected|)"


def f32(*tensors):
    return [t.float() for t in tensors]


# (query rows, context length, kv_start) per sequence; see test_reference_attention.py.
MIXED = [(1, 1, 0), (1, 17, 0), (1, 37, 0), (1, 129, 0), (17, 17, 0), (37, 129, 0),
         (17, 37, 5), (1, 129, 100), (1, 37, 37), (17, 37, 30), (0, 17, 0)]
DECODE = [(1, 1, 0), (1, 17, 0), (1, 37, 0), (1, 129, 0), (1, 129, 100), (1, 37, 37)]


def grid(variants, on_interpreter):
    """dtype x page size x GQA ratio x head size x variant; the interpreter (slow) runs only
    the cases where on_interpreter(dtype, page_size, d, variant) is true, and the fast lane
    (README: Run the tests) only those of head size 64 there."""
    return [
        pytest.param(dtype, ps, gqa, d, var, id=f"{dtype}-ps{ps}-gqa{gqa}-d{d}-{var}",
                     marks=[pytest.mark.slow] if not CUDA and d == 128 else [])
        for dtype in DTYPES for ps in (1, 16) for gqa in (1, 3) for d in (64, 128)
        for var in variants
        if CUDA or on_interpreter(dtype, ps, d, var)
    ]


@pytest.mark.parametrize(
    "dtype, page_size, gqa, d, step",
    # 16-bit on the interpreter: one mixed step per GQA ratio
    grid(["mixed", "decode"],
         lambda dt, ps, d, step: dt == torch.float32 or (ps, d, step) == (16, 64, "mixed")),
)
def test_paged_attention(dtype, page_size, gqa, d, step):
    seqs = MIXED if step == "mixed" else DECODE
    gen = torch.Generator().manual_seed(page_size * 7 + gqa * 5 + d)
    k_cache, v_cache, table = make_cache([c for _, c, _ in seqs], page_size, d, dtype, gen)
    q = torch.randn(sum(n for n, _, _ in seqs), HKV * gqa, d, generator=gen).to(dtype).to(DEVICE)
    args = (table, cu([n for n, _, _ in seqs]), i32([c for _, c, _ in seqs]),
            i32([s for _, _, s in seqs]), d**-0.5)
    o, lse = _paged.paged_attention(q, k_cache, v_cache, *args)
    o_ref, lse_ref = paged_attention_ref(*f32(q, k_cache, v_cache), *args)
    assert o.dtype == dtype and lse.dtype == torch.float32 and o.shape == q.shape
    close(o, o_ref, ATOL[dtype])
    close(lse, lse_ref, 1e-4 if dtype == torch.float32 else 2e-3)


@pytest.mark.parametrize(
    "dtype, page_size, gqa, d, num_splits",
    # the interpreter: fixed split counts with head size 64 only, 16-bit with 3 splits only
    grid([None, 1, 3], lambda dt, ps, d, splits: (splits is None or d == 64)
         and (dt == torch.float32 or splits == 3)),
)
def test_prefix_attention(dtype, page_size, gqa, d, num_splits):
    plens = [129, 1, 37, 0, 17]  # one group without a prefix
    qlens = [17, 3, 1, 2, 0]  # one group without queries
    gen = torch.Generator().manual_seed(page_size * 7 + gqa * 5 + d)
    k_cache, v_cache, pages = make_cache(plens, page_size, d, dtype, gen)
    q = torch.randn(sum(qlens), HKV * gqa, d, generator=gen).to(dtype).to(DEVICE)
    args = (pages, i32(plens), cu(qlens), d**-0.5)
    o, lse = _prefix.prefix_attention_split(q, k_cache, v_cache, *args, num_splits=num_splits)
    o_ref, lse_ref = prefix_attention_ref(*f32(q, k_cache, v_cache), *args)
    assert o.dtype == dtype and lse.dtype == torch.float32
    close(o, o_ref, ATOL[dtype])
    close(lse, lse_ref, 1e-4 if dtype == torch.float32 else 2e-3)
    if num_splits is None:
        o2, lse2 = _prefix.prefix_attention(q, k_cache, v_cache, *args)
        assert torch.equal(o2, o) and torch.equal(lse2, lse)


@pytest.mark.parametrize("window, softcap", [(1, 0.0), (7, 0.0), (40, 0.0), (0, 5.0), (13, 5.0)])
@pytest.mark.parametrize("page_size", [1, 16])
def test_paged_attention_window_and_softcap(page_size, window, softcap):
    """The sliding-window and soft-capping masks inside the online softmax, against the twin:
    windows shorter than a page, than a key block, and longer (odd lengths throughout)."""
    gen = torch.Generator().manual_seed(page_size + window)
    d, gqa = 64, 3
    k_cache, v_cache, table = make_cache([c for _, c, _ in MIXED], page_size, d, torch.float32,
                                         gen)
    q = torch.randn(sum(n for n, _, _ in MIXED), HKV * gqa, d, generator=gen).mul(2).to(DEVICE)
    args = (table, cu([n for n, _, _ in MIXED]), i32([c for _, c, _ in MIXED]),
            i32([s for _, _, s in MIXED]), d**-0.5)
    o, lse = _paged.paged_attention(q, k_cache, v_cache, *args, window=window, softcap=softcap)
    o_ref, lse_ref = paged_attention_ref(*f32(q, k_cache, v_cache), *args, window=window,
                                         softcap=softcap)
    close(o, o_ref, ATOL[torch.float32])
    close(lse, lse_ref, 1e-4)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_prefix_attention_softcap(num_splits):
    plens, qlens = [129, 1, 37], [17, 3, 1]
    gen = torch.Generator().manual_seed(num_splits)
    k_cache, v_cache, pages = make_cache(plens, 16, 64, torch.float32, gen)
    q = torch.randn(sum(qlens), HKV * 3, 64, generator=gen).mul(2).to(DEVICE)
    args = (pages, i32(plens), cu(qlens), 0.125)
    o, lse = _prefix.prefix_attention_split(q, k_cache, v_cache, *args, num_splits=num_splits,
                                            softcap=5.0)
    o_ref, lse_ref = prefix_attention_ref(*f32(q, k_cache, v_cache), *args, softcap=5.0)
    close(o, o_ref, ATOL[torch.float32])
    close(lse, lse_ref, 1e-4)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cascade_matches_full_paged_attention(dtype):
    """Prefix part + own part (kv_start = prefix length) merged == paged attention from 0."""
    gen = torch.Generator().manual_seed(11)
    d, page_size, plen = 64, 16, 32  # the prefix fills two pages, shared by all three tables
    lens, qlens = [plen + 5, plen + 1, plen + 20], [1, 1, 17]
    k_cache, v_cache, table = make_cache(lens, page_size, d, dtype, gen)
    for b in (1, 2):
        table[b, :2] = table[0, :2]
    q = torch.randn(sum(qlens), HKV * 3, d, generator=gen).to(dtype).to(DEVICE)
    cu_q, ctx, scale = cu(qlens), i32(lens), d**-0.5
    o_p, l_p = _prefix.prefix_attention(q, k_cache, v_cache, table[:1, :2].contiguous(),
                                        i32([plen]), cu([sum(qlens)]), scale)
    o_s, l_s = _paged.paged_attention(q, k_cache, v_cache, table, cu_q, ctx, i32([plen] * 3),
                                      scale)
    o, lse = _merge.merge_states(o_p, l_p, o_s, l_s)
    o_ref, lse_ref = paged_attention_ref(*f32(q, k_cache, v_cache), table, cu_q, ctx,
                                         i32([0] * 3), scale)
    close(o, o_ref, ATOL[dtype])
    close(lse, lse_ref, 1e-4 if dtype == torch.float32 else 2e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_merge_states(dtype):
    """Empty parts on either side and both; strided inputs (slices of bigger tensors)."""
    gen = torch.Generator().manual_seed(3)
    t, h, d = 7, 20, 64
    o_a, o_b = (torch.randn(t + 2, h, d, generator=gen).to(dtype).to(DEVICE) for _ in "ab")
    lse_a, lse_b = (torch.randn(t + 2, h, generator=gen).mul(4).to(DEVICE) for _ in "ab")
    for lse, o, rows in ((lse_a, o_a, [0, 2]), (lse_b, o_b, [1, 2])):
        lse[rows] = float("-inf")
        o[rows] = 0
    lse_a[3, :5] = float("-inf")
    o_a[3, :5] = 0
    args = (o_a[:t], lse_a[:t], o_b[:t], lse_b[:t])
    o, lse = _merge.merge_states(*args)
    o_ref, lse_ref = merge_states_ref(*args)
    assert o.dtype == dtype and lse.dtype == torch.float32
    close(o, o_ref, ATOL[dtype] / 4)
    close(lse, lse_ref, 1e-6)
    assert torch.equal(o[2], torch.zeros_like(o[2]))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("page_size", [1, 16])
def test_store_kv(page_size, cache_dtype):
    """A strided K/V (views of a fused qkv tensor), cast to the cache dtype; slot -1 skipped."""
    gen = torch.Generator().manual_seed(page_size)
    t, d = 37, 64
    qkv = torch.randn(t, 3, HKV, d, generator=gen).to(DEVICE)
    k, v = qkv[:, 1], qkv[:, 2]  # [T, Hkv, D], not contiguous
    slots = torch.randperm(4 * 16, generator=gen)[:t].to(DEVICE)
    shape = (64 // page_size, page_size, HKV, d)
    caches = [torch.zeros(shape, dtype=cache_dtype, device=DEVICE) for _ in range(4)]
    _store.store_kv(k, v, caches[0], caches[1], slots)
    store_kv_ref(k, v, caches[2], caches[3], slots)
    # Compiled Triton rounds float32 -> bfloat16 to nearest even like torch; the interpreter
    # truncates (one bfloat16 ulp at most).
    exact = CUDA or cache_dtype == torch.float32
    for a, b in ((caches[0], caches[2]), (caches[1], caches[3])):
        torch.testing.assert_close(a, b, atol=0, rtol=0 if exact else 2**-7)
    skipped = slots.clone()
    skipped[5] = -1
    flat = caches[0].view(-1, HKV, d)
    before = flat[slots[5]].clone()
    _store.store_kv(k + 1, v + 1, caches[0], caches[1], skipped)
    assert torch.equal(flat[slots[5]], before)
    torch.testing.assert_close(flat[slots[6]], (k[6] + 1).to(cache_dtype), atol=0,
                               rtol=0 if exact else 2**-7)


def test_launchers_reject_bad_inputs():
    k_cache = torch.zeros(4, 16, HKV, 64, device=DEVICE)
    q = torch.zeros(3, 6, 64, device=DEVICE)
    table, one = torch.zeros(3, 2, dtype=torch.int32, device=DEVICE), i32([1, 1, 1])
    good = (table, cu([1, 1, 1]), one, one * 0, 0.125)
    q_strided_d = q.transpose(1, 2).contiguous().transpose(1, 2)  # stride 1 not in D
    cases = [
        ((q.half(), k_cache, k_cache, *good), "share a dtype"),
        ((q[:, :5], k_cache, k_cache, *good), "multiple of Hkv"),
        ((q, k_cache.transpose(0, 1), k_cache.transpose(0, 1), *good), "contiguous"),
        ((q_strided_d, k_cache, k_cache, *good), "last dimension"),
        ((q, k_cache, k_cache, table.long(), *good[1:]), "page_table must be torch.int32"),
        ((q, k_cache, k_cache, table, cu([1, 1]), *good[2:]), "cu_q must be"),
        ((q, k_cache, k_cache[:, :, :1], *good), "k_cache and v_cache"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            _paged.paged_attention(*args)
    with pytest.raises(ValueError, match="slot_mapping"):
        _store.store_kv(q[:, :2], q[:, :2], k_cache, k_cache, i32([0, 1, 2]))
    with pytest.raises(ValueError, match="lse_b"):
        _merge.merge_states(q, q[:, :, 0], q, q[:2, :, 0])
    with pytest.raises(ValueError, match="need CUDA tensors"):
        _checks.check_device(object(), q=torch.zeros(1))
