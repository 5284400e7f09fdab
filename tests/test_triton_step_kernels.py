"""The CUDA step loop's Triton kernels against their torch twins: the fused pointwise kernels
(add+RMSNorm, rotary embedding with the KV store, SiLU-and-multiply), paged attention's decode
tile and split-KV decode, and the in-place merge.

Without CUDA they run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 first),
bfloat16 too: the launchers upcast the interpreter's bfloat16 products (launch.dot_f32), and
tests/triton_rounding.py rounds its float32 -> bfloat16 casts to nearest even, as a GPU does.
16-bit results may still differ from the twins by an ulp of the dtype (another order of operations).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from batchllm_kernels.reference.merge_states import merge_states_ref
from batchllm_kernels.reference.paged_attention import paged_attention_ref
from batchllm_kernels.reference.pointwise import (
    add_rms_norm_ref,
    gelu_tanh_mul_ref,
    rope_ref,
    silu_mul_ref,
)
from batchllm_kernels.reference.rope_store import rope_store_ref
from batchllm_kernels.triton import gated_mul, merge_states, paged_attention, rms_norm, rotary
from batchllm_kernels.triton import launch as triton_launch

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ULP = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}


def close(actual: torch.Tensor, expected: torch.Tensor, rel: float) -> None:
    """Within `rel` of the expected magnitude (elementwise, plus rel), -inf where expected is."""
    a, e = actual.float(), expected.float()
    inf = torch.isinf(e)
    assert torch.equal(torch.isinf(a), inf) and not torch.isnan(a).any()
    excess = ((a - e).abs() - rel * (1 + e.abs())).masked_fill(inf, 0)
    assert float(excess.max()) <= 0, f"off by {float(excess.max()):.3g} beyond rel={rel}"


def rand(*shape, dtype=torch.float32, gen) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


def rope_tables(d: int, positions: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.arange(positions).float()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(DEVICE), emb.sin().to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm(dtype, with_delta):
    gen = torch.Generator().manual_seed(1)
    h = rand(5, 200, dtype=dtype, gen=gen)[:, :96]  # rows apart (stride 200)
    delta = rand(5, 96, dtype=dtype, gen=gen) if with_delta else None
    w = rand(96, dtype=dtype, gen=gen)
    h_ref = h.clone()
    out = rms_norm.add_rms_norm(h, delta, w, 1e-5)
    expected = add_rms_norm_ref(h_ref, delta, w, 1e-5)
    assert out.dtype == dtype and out.shape == (5, 96)
    close(h, h_ref, ULP[dtype])
    close(out, expected, 2 * ULP[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gated_mul(dtype, act):
    gen = torch.Generator().manual_seed(2)
    gate_up = rand(3, 2 * 1100, dtype=dtype, gen=gen)  # two column blocks, the second partial
    gate_up[0, :8] = torch.tensor([-30.0, -9.0, -3.0, -0.5, 0.0, 0.5, 9.0, 30.0])  # both tails
    kernel, twin = {"silu": (gated_mul.silu_mul, silu_mul_ref),
                    "gelu_tanh": (gated_mul.gelu_tanh_mul, gelu_tanh_mul_ref)}[act]
    close(kernel(gate_up), twin(gate_up.clone()), 2 * ULP[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cache_dtype", [None, torch.float32], ids=["same", "f32cache"])
@pytest.mark.parametrize("d", [64, 80])  # 80: half a head is not a power of two
def test_rope_store(dtype, cache_dtype, d):
    """q and k rotated in place, k and v in their slots, a padding slot (-1) not stored."""
    gen = torch.Generator().manual_seed(d)
    hq, hkv, t = 6, 2, 7
    qkv = rand(t, (hq + 2 * hkv) * d, dtype=dtype, gen=gen)
    positions = torch.randint(0, 64, (t,), generator=gen).to(DEVICE)
    cos, sin = rope_tables(d)
    shape = (4, 4, hkv, d)
    caches = [torch.zeros(shape, dtype=cache_dtype or dtype, device=DEVICE) for _ in range(4)]
    slots = torch.tensor([0, 3, 5, -1, 9, 2, 15], device=DEVICE)
    qkv_ref = qkv.clone()
    rotary.rope_store(qkv, positions, cos, sin, hq, caches[0], caches[1], slots)
    keep = slots >= 0
    rope_ref(qkv_ref, positions, cos, sin, hq + hkv)
    k = qkv_ref[keep, hq * d : (hq + hkv) * d].reshape(-1, hkv, d)
    v = qkv_ref[keep, (hq + hkv) * d :].reshape(-1, hkv, d)
    caches[2].view(-1, hkv, d)[slots[keep]] = k.to(caches[2].dtype)
    caches[3].view(-1, hkv, d)[slots[keep]] = v.to(caches[3].dtype)
    close(qkv, qkv_ref, 2 * ULP[dtype])
    close(caches[0], caches[2], 2 * ULP[dtype])
    close(caches[1], caches[3], 0.0)  # v is copied, not computed


def test_rope_store_twin_is_rope_then_store():
    """The twin composes the rotation and the store exactly as the fused kernel defines them."""
    gen = torch.Generator().manual_seed(3)
    hq, hkv, d, t = 4, 2, 64, 5
    qkv = rand(t, (hq + 2 * hkv) * d, gen=gen)
    positions = torch.arange(t, device=DEVICE)
    cos, sin = rope_tables(d)
    k_cache, v_cache = (torch.zeros(2, 4, hkv, d, device=DEVICE) for _ in "kv")
    fused = qkv.clone()
    rotary.rope_store(fused, positions, cos, sin, hq, k_cache, v_cache, positions + 1)
    twin_k, twin_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    rope_store_ref(qkv, positions, cos, sin, hq, twin_k, twin_v, positions + 1)
    close(fused, qkv, 1e-6)
    close(k_cache, twin_k, 1e-6)
    assert torch.equal(v_cache, twin_v)
    rotary.rope_(fused, positions, cos, sin, hq)  # the q heads once more, nothing else
    rope_ref(qkv, positions, cos, sin, hq)
    close(fused, qkv, 1e-6)


def paged_inputs(lens, qlens, d, dtype, gqa, gen, page_size=16, hkv=2):
    """A shuffled paged cache holding `lens` tokens per sequence, queries for `qlens` of them."""
    counts = [-(-n // page_size) for n in lens]
    perm = torch.randperm(sum(counts) + 1, generator=gen).int()
    table = torch.zeros((len(lens), max(counts)), dtype=torch.int32)
    pos = 0
    for b, n in enumerate(counts):
        table[b, :n] = perm[pos : pos + n]
        pos += n
    shape = (len(perm), page_size, hkv, d)
    k_cache, v_cache = (rand(*shape, dtype=dtype, gen=gen) for _ in "kv")
    q = rand(sum(qlens), hkv * gqa, d, dtype=dtype, gen=gen)
    cu = torch.tensor([0, *qlens]).cumsum(0).int().to(DEVICE)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=DEVICE)
    return q, k_cache, v_cache, table.to(DEVICE), cu, i32(lens), i32([0] * len(lens)), i32


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["mixed", "decode", "split"])
def test_paged_attention_decode_tile(dtype, kind, monkeypatch):
    """Decodes in a decode tile of their own (mixed: plus the 64-row tiles of the chunks, which
    skip them), and split-KV decode (few long sequences) against the twin."""
    gen = torch.Generator().manual_seed(5)
    gqa, d = 3, 64
    if kind == "mixed":
        lens, qlens = [37, 17, 129, 20], [1, 17, 1, 5]
    elif kind == "decode":
        lens, qlens = [37, 1, 129], [1, 1, 1]
    else:
        lens, qlens = [700, 300], [1, 1]
    q, k_cache, v_cache, table, cu, ctx, start, i32 = paged_inputs(lens, qlens, d, dtype, gqa, gen)
    decodes = i32([b for b, n in enumerate(qlens) if n == 1])
    launched, run = [], triton_launch.run

    def record(launches):
        launched.extend(launches)
        run(launches)

    monkeypatch.setattr(triton_launch, "run", record)
    o, lse = paged_attention.paged_attention(q, k_cache, v_cache, table, cu, ctx, start,
                                             d**-0.5, decode_seqs=decodes,
                                             max_context=max(lens))
    names = [x.kernel.fn.__name__ for x in launched]
    expect = {"mixed": ["_paged_attention_kernel"] * 2, "decode": ["_paged_attention_kernel"],
              "split": ["_paged_attention_kernel", "_combine_splits_kernel"]}[kind]
    assert names == expect
    assert launched[0].constexprs["DECODE"] and launched[0].grid[0] == len(decodes)
    if kind == "split":
        assert launched[0].grid[2] > 1
    o_ref, lse_ref = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), table, cu,
                                         ctx, start, d**-0.5)
    atol = {torch.float32: 2e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
    close(o, o_ref, atol)
    close(lse, lse_ref, 1e-4 if dtype == torch.float32 else 2e-3)


def test_merge_states_in_place():
    """out = the second part itself (the attention's own rows): merged in place."""
    gen = torch.Generator().manual_seed(4)
    t, h, d = 6, 5, 32
    o_a, o_b = rand(t, h, d, gen=gen), rand(t, h, d, gen=gen)
    lse_a, lse_b = rand(t, h, gen=gen) * 3, rand(t, h, gen=gen) * 3
    lse_a[1] = float("-inf")
    expected = merge_states_ref(o_a, lse_a, o_b, lse_b)
    o, lse = merge_states.merge_states(o_a, lse_a, o_b, lse_b, out=(o_b, lse_b))
    assert o.data_ptr() == o_b.data_ptr() and lse.data_ptr() == lse_b.data_ptr()
    close(o_b, expected[0], 1e-6)
    close(lse_b, expected[1], 1e-6)
