"""The FP8 KV cache in the kernels: the e4m3 codec, the store (bit for bit), and every attention
kernel (paged with its decode tile and split-KV and their combine, shared-prefix with its
splits, and the in-place merge) against their torch twins; the twins against the definition
(an FP8 cache reads as fp8 * its KV head's scale). Tiny shapes, odd lengths, page sizes 1 and
16, scales that are not powers of two (a power of two would round like 1.0). Without CUDA in
Triton's interpreter, whose bfloat16 tl.dot the launchers upcast (launch.dot_f32).
"""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import CUDA, load

_fp8, _store, _rotary, _paged, _prefix = (load(f"batchllm_kernels.triton.{n}") for n in (
    "fp8", "store_kv", "rotary", "paged_attention", "prefix_attention"))
import triton
import triton.language as tl

from batchllm_kernels.reference.paged_attention import paged_attention_ref
from batchllm_kernels.reference.prefix_attention import prefix_attention_ref
from batchllm_kernels.reference.rope_store import rope_store_ref
from batchllm_kernels.reference.store_kv import store_kv_ref

DEVICE = "cuda" if CUDA else "cpu"
# queries in float32 and bfloat16; in the interpreter the fast lane (README: Run the tests) keeps
# float32's, the full suite runs both
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=[] if CUDA else [pytest.mark.slow])]
FP8 = torch.float8_e4m3fn
HKV = 2
SCALES = (torch.tensor([0.37, 1.3]), torch.tensor([0.61, 0.23]))  # k, v per KV head
ATOL = {torch.float32: 2e-4, torch.bfloat16: 3e-2}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def scales():
    return tuple(s.to(DEVICE) for s in SCALES)


@triton.jit
def _codec_kernel(x_ptr, bits_ptr, back_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    b = _fp8.encode_e4m3(tl.load(x_ptr + offs))
    tl.store(bits_ptr + offs, b)
    tl.store(back_ptr + offs, _fp8.decode_e4m3(b).to(tl.float32) * _fp8.DECODE_SCALE)


def test_codec_rounds_and_decodes_like_torch():
    """Every e4m3 value, every midpoint between neighbours (ties to even), values past +-448
    and far below the smallest subnormal: the bits torch gives the clamped value, and back."""
    values = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    values = values[~values.isnan()].sort().values
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([values, (values[1:] + values[:-1]) / 2, torch.tensor([460.0, -9e3, 1e-9]),
                   torch.randn(600, generator=gen) * 40])
    n = 1 << (x.numel() - 1).bit_length()
    x = torch.cat([x, torch.zeros(n - x.numel())]).to(DEVICE)
    out, back = torch.empty(n, dtype=torch.uint8, device=DEVICE), torch.empty(n, device=DEVICE)
    _codec_kernel[(1,)](x, out, back, N=n)
    expected = x.clamp(-448, 448).to(FP8)
    assert torch.equal(out, bits(expected))
    assert torch.equal(back, expected.float())


@pytest.mark.parametrize("page_size", [1, 16])
def test_store_writes_the_twins_bits(page_size):
    """store_kv and the rotary embedding's store: e4m3(x / scale) per KV head, the same bits as
    the twins (and a padding slot -1 writes nothing)."""
    gen = torch.Generator().manual_seed(page_size)
    hq, d, t = 6, 64, 13
    pages = -(-40 // page_size)
    caches = [torch.zeros(pages, page_size, HKV, d, dtype=FP8, device=DEVICE) for _ in range(8)]
    slots = torch.randperm(pages * page_size, generator=gen)[:t].to(DEVICE)
    slots[4] = -1
    keep = slots >= 0
    k, v = (torch.randn(t, HKV, d, generator=gen).mul(5).to(DEVICE) for _ in "kv")
    _store.store_kv(k, v, caches[0], caches[1], slots, k_scale=scales()[0], v_scale=scales()[1])
    store_kv_ref(k[keep], v[keep], caches[2], caches[3], slots[keep], k_scale=scales()[0],
                 v_scale=scales()[1])
    assert torch.equal(bits(caches[0]), bits(caches[2]))
    assert torch.equal(bits(caches[1]), bits(caches[3]))
    row = caches[2].view(-1, HKV, d)[slots[0]]
    assert torch.equal(bits(row), bits((k[0] / scales()[0][:, None]).to(FP8)))
    qkv = torch.randn(t, (hq + 2 * HKV) * d, generator=gen).mul(5).to(DEVICE)
    positions = torch.randint(0, 64, (t,), generator=gen).to(DEVICE)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.arange(64).float()[:, None] * inv[None, :]
    cos, sin = (f(torch.cat((emb, emb), -1)).to(DEVICE) for f in (torch.cos, torch.sin))
    twin = qkv.clone()
    _rotary.rope_store(qkv, positions, cos, sin, hq, caches[4], caches[5], slots,
                       k_scale=scales()[0], v_scale=scales()[1])
    rope_store_ref(twin[keep], positions[keep], cos, sin, hq, caches[6], caches[7], slots[keep],
                   k_scale=scales()[0], v_scale=scales()[1])
    assert torch.equal(bits(caches[5]), bits(caches[7]))  # v: copied, then rounded
    k_diff = caches[4].float() - caches[6].float()  # k: rotated; the rotation may round apart
    assert float(k_diff.abs().max()) <= 2 ** -4 * float(caches[6].float().abs().max())


def fp8_case(lens, qlens, page_size, dtype, gen, gqa=3, d=64):
    """Shuffled FP8 caches holding `lens` tokens per sequence, queries for the last `qlens`."""
    counts = [-(-n // page_size) for n in lens]
    perm = torch.randperm(sum(counts) + 1, generator=gen).int()
    table = torch.zeros(len(lens), max(counts), dtype=torch.int32)
    pos = 0
    for b, n in enumerate(counts):
        table[b, :n] = perm[pos : pos + n]
        pos += n
    shape = (len(perm), page_size, HKV, d)
    k_cache, v_cache = ((torch.randn(shape, generator=gen) * 4).to(FP8) for _ in "kv")
    q = torch.randn(sum(qlens), HKV * gqa, d, generator=gen).to(dtype)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=DEVICE)
    cu = torch.tensor([0, *qlens]).cumsum(0).int().to(DEVICE)
    return (q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), table.to(DEVICE), cu,
            i32(lens), i32([0] * len(lens)), i32)


def close(actual, expected, atol):
    a, e = actual.float(), expected.float()
    inf = torch.isinf(e)
    assert torch.equal(torch.isinf(a), inf) and not torch.isnan(a).any()
    excess = ((a - e).abs() - atol * (1 + e.abs())).masked_fill(inf, 0)
    assert float(excess.max()) <= 0, f"off by {float(excess.max()):.3g} beyond {atol}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kind", ["mixed", "decode-tile", "split-kv"])
def test_paged_attention_reads_fp8(kind, page_size, dtype):
    gen = torch.Generator().manual_seed(page_size + len(kind))
    lens, qlens = {"mixed": ([37, 17, 129, 20], [1, 17, 1, 5]),
                   "decode-tile": ([37, 1, 129], [1, 1, 1]),
                   "split-kv": ([701, 301], [1, 1])}[kind]
    q, k_cache, v_cache, table, cu, ctx, start, i32 = fp8_case(lens, qlens, page_size, dtype, gen)
    k_s, v_s = scales()
    extra = {}
    if kind != "mixed":
        extra = {"decode_seqs": i32(list(range(len(lens)))), "max_context": max(lens)}
    o, lse = _paged.paged_attention(q, k_cache, v_cache, table, cu, ctx, start, 0.125,
                                    k_scale=k_s, v_scale=v_s, **extra)
    if kind == "split-kv":  # the plan really splits (and combines)
        plan = _paged.plan_paged_attention(q, k_cache, v_cache, table, cu, ctx, start, 0.125,
                                           k_scale=k_s, v_scale=v_s, **extra)[2]
        assert plan[0].grid[2] > 1 and plan[1].kernel.fn.__name__ == "_combine_splits_kernel"
    o_ref, lse_ref = paged_attention_ref(q.float(), k_cache, v_cache, table, cu, ctx, start,
                                         0.125, k_scale=k_s, v_scale=v_s)
    close(o, o_ref, ATOL[dtype])
    close(lse, lse_ref, 1e-4 if dtype == torch.float32 else 2e-3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("splits", [1, 3])
def test_prefix_attention_reads_fp8(splits, page_size, dtype):
    """Two groups against their shared prefixes (17 and 70 keys), split by key range or not;
    and merged in place into an own part (prefix_attention_into)."""
    gen = torch.Generator().manual_seed(splits + page_size)
    q, k_cache, v_cache, table, _, _, _, i32 = fp8_case([17, 70], [3, 5], page_size, dtype, gen)
    cu_g, lens = i32([0, 3, 8]), i32([17, 70])
    k_s, v_s = scales()
    o, lse = _prefix.prefix_attention_split(q, k_cache, v_cache, table, lens, cu_g, 0.125,
                                            splits, k_scale=k_s, v_scale=v_s)
    o_ref, lse_ref = prefix_attention_ref(q.float(), k_cache, v_cache, table, lens, cu_g, 0.125,
                                          k_scale=k_s, v_scale=v_s)
    close(o, o_ref, ATOL[dtype])
    close(lse, lse_ref, 1e-4 if dtype == torch.float32 else 2e-3)
    own_o, own_lse = torch.zeros_like(q), torch.full(lse.shape, float("-inf"), device=DEVICE)
    _prefix.prefix_attention_into(q, k_cache, v_cache, table, lens, cu_g, 0.125, own_o, own_lse,
                                  k_scale=k_s, v_scale=v_s)
    close(own_o, o_ref, ATOL[dtype])  # merged with an empty own part: the prefix part alone


@pytest.mark.parametrize("page_size", [1, 16])
def test_twins_read_an_fp8_cache_as_its_scaled_values(page_size):
    """The twins over an FP8 cache equal the twins over the float32 cache holding fp8 * scale
    (the definition, kernels/reference/kv_fp8.py), causal part and shared prefix alike."""
    gen = torch.Generator().manual_seed(7)
    q, k_cache, v_cache, table, cu, ctx, start, i32 = fp8_case([37, 20], [1, 20], page_size,
                                                               torch.float32, gen)
    k_s, v_s = scales()
    k32 = k_cache.float() * k_s[:, None]
    v32 = v_cache.float() * v_s[:, None]
    got = paged_attention_ref(q, k_cache, v_cache, table, cu, ctx, start, 0.125, k_scale=k_s,
                              v_scale=v_s)
    want = paged_attention_ref(q, k32, v32, table, cu, ctx, start, 0.125)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    got = prefix_attention_ref(q, k_cache, v_cache, table, ctx, i32([0, 1, 21]), 0.125,
                               k_scale=k_s, v_scale=v_s)
    want = prefix_attention_ref(q, k32, v32, table, ctx, i32([0, 1, 21]), 0.125)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_an_fp8_cache_needs_its_scales():
    gen = torch.Generator().manual_seed(1)
    q, k_cache, v_cache, table, cu, ctx, start, _ = fp8_case([5], [5], 16, torch.float32, gen)
    with pytest.raises(ValueError, match="needs k_scale"):
        _paged.paged_attention(q, k_cache, v_cache, table, cu, ctx, start, 0.125)
    with pytest.raises(ValueError, match="k_scale must be contiguous float32 of shape"):
        _paged.paged_attention(q, k_cache, v_cache, table, cu, ctx, start, 0.125,
                               k_scale=torch.ones(3, device=DEVICE), v_scale=scales()[1])
