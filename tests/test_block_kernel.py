"""The block kernel (kernels/cpu/blocks.c) on real .gguf files (gguf's GGUFWriter, weights
quantized by gguf.quants.quantize): its dequantization is gguf.quants.dequantize's, bit for bit,
and its products and argmaxes equal, bit for bit, linear.c's float32 panel kernel's over those
dequantized weights (the same chain of FMAs over k), for Q8_0, Q4_0 and Q4_1, every tile
height and several cuts past it, N not a multiple of 16, bias or none; as this machine builds
it, with BATCHLLM_CPU_ISA=avx2, and in plain C."""

import functools

import numpy as np
import pytest
import torch
from gguf import GGUFReader

from batchllm_kernels.cpu import blocks as cpu_blocks
from batchllm_kernels.cpu import build
from batchllm_kernels.cpu import linear as cpu_linear
from tests.gguf_files import KINDS, dequantized, random_weight, write_gguf

SHAPES = [(37, 32), (64, 96), (211, 576)]  # (N, K)
ROWS = [*range(1, 26), 31, 49, 97]  # every tile height, then 2 to 5 tiles
LONG = 461  # at K = 576: two blocks of rows, each dequantizing the panels again (blocks.c)


@pytest.fixture(autouse=True, params=["native", "avx2", "plain"])
def kernel(request, monkeypatch):
    if request.param == "avx2":
        monkeypatch.setenv("BATCHLLM_CPU_ISA", "avx2")
    elif request.param == "plain":
        monkeypatch.setattr(build, "_FLAGS", (*build._FLAGS, "-mno-avx2", "-mno-fma"))
    for module in (cpu_blocks, cpu_linear):
        monkeypatch.setattr(module, "load", functools.cache(module.load.__wrapped__))
    if cpu_blocks.load() is None or cpu_linear.load() is None:
        pytest.skip("the C kernels cannot be built here")


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    gen = np.random.default_rng(30)
    tensors = {f"{kind}.{n}x{k}": (random_weight(gen, n, k), kind)
               for kind in KINDS for n, k in SHAPES}
    return write_gguf(tmp_path_factory.mktemp("gguf") / "blocks.gguf", tensors)


def weights(path):
    """(name, kind, blocks uint8 [N, row bytes], gguf's dequantized [N, K]) of each tensor."""
    reference = dequantized(path)
    for t in GGUFReader(path).tensors:
        blocks = torch.from_numpy(np.array(t.data))
        yield t.name, t.tensor_type.name, blocks, torch.from_numpy(reference[t.name])


def test_the_kernel_dequantizes_as_gguf(gguf_file):
    for name, kind, blocks, reference in weights(gguf_file):
        got = cpu_blocks.dequantize(blocks, kind, reference.shape[1])
        assert torch.equal(got, reference), name


@pytest.mark.parametrize("bias", [False, True])
def test_products_equal_the_panel_kernel_on_the_dequantized_weights(gguf_file, bias):
    gen = torch.Generator().manual_seed(int(bias))
    for name, kind, blocks, w in weights(gguf_file):
        n, k = w.shape
        b = cpu_linear.pack_bias(torch.randn(n, generator=gen), n) if bias else None
        panels = cpu_linear.pack_panels(w)
        for m in ROWS + [LONG] * (k == 576):
            x = torch.randn(m, k + 3, generator=gen)[:, 1 : k + 1]  # rows apart, as views are
            got = cpu_blocks.linear(x, blocks, kind, b)
            want = cpu_linear.linear(x, panels, b, n)
            assert torch.equal(got, want), f"{name}, {m} rows"
            assert torch.equal(cpu_blocks.linear_argmax(x, blocks, kind, b),
                               cpu_linear.linear_argmax(x, panels, b, n)), f"{name}, {m} rows"


def test_wrong_blocks_are_refused(gguf_file):
    _, kind, blocks, w = next(weights(gguf_file))
    x = torch.randn(2, w.shape[1])
    with pytest.raises(ValueError, match="blocks of K"):
        cpu_blocks.linear(x[:, :-1].contiguous(), blocks, kind, None)
    with pytest.raises(ValueError, match="not supported"):
        cpu_blocks.linear(x, blocks, "Q5_K", None)
