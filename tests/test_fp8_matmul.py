"""The FP8 projection's kernels (kernels/triton/fp8_matmul.py) against their torch twins, and
the twins against the definition: W8A8 (per-token e4m3 activations, FP8 x FP8 products) and
W8A16 (the weight decoded in the kernel), weights per channel and in blocks (partial ones
too), with and without a bias, odd row counts (a decode step's 1, a chunk's 37). Without CUDA
in Triton's interpreter.
"""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import CUDA, load

_mm = load("batchllm_kernels.triton.fp8_matmul")
from batchllm.model.fp8_weights import Fp8Weight, quantize
from batchllm_kernels.reference.fp8_matmul import (
    dequantize_weight,
    fp8_matmul_ref,
    quantize_rows_ref,
)

DEVICE = "cuda" if CUDA else "cpu"
FP8 = torch.float8_e4m3fn


def blocked(w: torch.Tensor, rb: int, cb: int) -> Fp8Weight:
    """w in blocks of rb x cb, each scaled by its max / 448 (the format's definition)."""
    n, k = w.shape
    rows, cols = -(-n // rb), -(-k // cb)
    padded = torch.zeros(rows * rb, cols * cb)
    padded[:n, :k] = w.abs()
    scale = padded.view(rows, rb, cols, cb).amax(dim=(1, 3)) / 448.0
    full = scale.repeat_interleave(rb, 0)[:n].repeat_interleave(cb, 1)[:, :k]
    return Fp8Weight((w / full).clamp(-448, 448).to(FP8), scale, rb, cb)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 37])
@pytest.mark.parametrize("blocks", ["channel", "32x32", "128x128"])
@pytest.mark.parametrize("path", ["w8a8", "w8a16"])
def test_fp8_linear_against_its_twin(path, blocks, rows, dtype):
    gen = torch.Generator().manual_seed(rows)
    n, k = 96, 160  # partial blocks of 32 and of 128
    w = torch.randn(n, k, generator=gen)
    rec = quantize(w) if blocks == "channel" else blocked(w, *map(int, blocks.split("x")))
    x = (torch.randn(rows, k, generator=gen) * 3).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    args = (rec.weight.to(DEVICE), rec.scale.to(DEVICE), rec.row_block, rec.col_block)
    for b in (None, bias.to(DEVICE)):
        y = _mm.fp8_linear(x.to(DEVICE), *args, b, fp8_dot=path == "w8a8")
        want = fp8_matmul_ref(x.float(), rec.weight, rec.scale, rec.row_block, rec.col_block,
                              None if b is None else bias.float(), fp8_dot=path == "w8a8")
        assert y.dtype == dtype and y.shape == (rows, n)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        err = (y.cpu().float() - want).abs() / (1 + want.abs())
        assert float(err.max()) <= tol, float(err.max())


def test_per_token_quantization_and_the_cap():
    """_quantize_rows_kernel: scale = max |x_row| / 448 (capped: fbgemm's activation_scale_ub),
    e4m3(x / scale): the twin's bits."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 1500, generator=gen) * torch.tensor([1e-3, 1.0, 30.0, 500.0, 2e4])[:, None]
    for ub in (0.0, 1200.0):
        launches = _mm.plan_fp8_linear(x.to(DEVICE), torch.zeros(8, 1500, dtype=FP8,
                                                                 device=DEVICE),
                                       torch.ones(8, 1, device=DEVICE), 1, 1500, fp8_dot=True,
                                       scale_ub=ub)[1]
        quant = launches[0]
        quant.kernel[quant.grid](*quant.args, **quant.constexprs)
        bits, scale = quant.args[1], quant.args[2]
        q, s = quantize_rows_ref(x, ub)
        assert torch.equal(scale.cpu(), s)
        assert torch.equal(bits.cpu(), q.view(torch.uint8))
    assert float(s[-1]) == float(torch.tensor(1200.0) / 448.0)  # the cap, in float32


def test_the_twin_is_the_dequantized_product():
    """fp8_matmul_ref without activation quantization is x (e4m3 * scale)^T in float32."""
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(40, 70, generator=gen)
    rec = blocked(w, 16, 32)
    x = torch.randn(3, 70, generator=gen)
    w_deq = rec.dequantize(torch.float32)
    assert torch.equal(w_deq, dequantize_weight(rec.weight, rec.scale, 16, 32, torch.float32))
    assert float((w_deq - w).abs().max()) <= 2 ** -4 * float(w.abs().max())  # e4m3's step
    y = fp8_matmul_ref(x, rec.weight, rec.scale, 16, 32)
    assert torch.allclose(y, x @ w_deq.T, atol=1e-5)


def test_records_split_and_join_back():
    """A fused weight's parts (qkv) split and joined again keep every value and scale; parts
    whose rows do not fill their blocks are joined one scale row per weight row."""
    gen = torch.Generator().manual_seed(5)
    rec = blocked(torch.randn(96, 64, generator=gen), 32, 32)
    parts = rec.split([64, 32])
    assert [p.row_block for p in parts] == [32, 32]
    joined = Fp8Weight.cat(parts)
    assert torch.equal(joined.dequantize(torch.float32), rec.dequantize(torch.float32))
    odd = Fp8Weight.cat([blocked(torch.randn(20, 64, generator=gen), 32, 32),
                         blocked(torch.randn(12, 64, generator=gen), 32, 32)])
    assert odd.row_block == 1 and odd.scale.shape == (32, 2)
