"""The tile unit's products from a weight's 4-bit blocks (kernels/cpu/q4_blocks.h, amx_q4.h):
found again in the float32 values of a weight quantized as llama.cpp's Q4_1 (and in the real
SmolLM2 checkpoint's layers), refused for any other weight, and the same values, bit for bit, as
the products from the weight's parts for every row count, with and without bias, on shapes
whose last panel is partial."""

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu import linear as cpu_linear


@pytest.fixture(autouse=True)
def tile_unit():
    if cpu_linear.load() is None or not cpu_linear.uses_amx():
        pytest.skip("no tile unit here (a CPU without AMX-BF16, or no C kernel)")


def q4_1(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """W [n, k] of normal values quantized as llama.cpp's quantize_row_q4_1_ref does and
    dequantized as gguf does: per 32 along K, d = (max - min) / 15 and m = min as float16,
    q = min(15, int((w - min) / d + 0.5)); the value d * q + m in float32."""
    w = torch.randn(n, k // 32, 32, generator=gen) / k**0.5
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    d = (hi - lo) / 15
    q = ((w - lo) / d + 0.5).floor().clamp(max=15)
    return (d.half().float() * q + lo.half().float()).reshape(n, k)


# (N, K): 13 panels + 3 columns over 10 steps of K; 4 panels + 5 columns (the last group of
# four panels short) over 48 steps; one panel of 16; 13 panels (two groups a thread) over K of
# 4,096, where x's parts of 48 rows exceed the kernel's block of rows (32 at this K), so that
# each block makes its groups' parts again
SHAPES = [(211, 320), (69, 1536), (16, 32), (200, 4096)]

ROWS = [*range(1, 19), 31, 32, 33, 47, 48, 49, 64, 97]  # 1-3 row tiles, then the parts'


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, the sign of a zero too (torch.equal takes -0 == +0)."""
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_products_from_the_blocks_are_the_parts_sums(n, k, bias):
    gen = torch.Generator().manual_seed(n + k)
    w = q4_1(n, k, gen)
    b = torch.randn(n, generator=gen) if bias else None
    panels, pb = cpu_linear.pack_panels(w), cpu_linear.pack_bias(b, n)
    parts = cpu_linear.split_parts(panels)
    blocks = cpu_linear.pack_q4(panels)
    assert parts.shape[1] == 2 and blocks is not None
    x = torch.randn(97, k + 8, generator=gen)[:, 3 : k + 3]  # rows k + 8 floats apart
    expected = F.linear(x.double(), w.double(), None if b is None else b.double())
    for m in ROWS:
        from_parts = cpu_linear.linear(x[:m], panels, pb, n, parts)
        from_blocks = cpu_linear.linear(x[:m], panels, pb, n, parts, blocks)
        assert same_bits(from_blocks, from_parts), f"{m} rows"
        torch.testing.assert_close(from_blocks.double(), expected[:m], rtol=1e-5, atol=1e-5)


def test_a_weight_of_other_values_keeps_its_parts():
    """pack_q4 refuses, and the product keeps the parts: a float32 weight; a Q4_1 weight with
    one value moved by one ulp; K not a multiple of 32; a block of -0 (made again as +0);
    values that are bfloat16 (their one part skips the m products that the blocks would add)."""
    gen = torch.Generator().manual_seed(3)
    assert cpu_linear.pack_q4(cpu_linear.pack_panels(torch.randn(64, 64, generator=gen))) is None
    w = q4_1(64, 64, gen)
    assert cpu_linear.pack_q4(cpu_linear.pack_panels(w)) is not None
    moved = w.clone()
    moved[37, 45] = torch.nextafter(moved[37, 45], torch.tensor(1.0))
    assert cpu_linear.pack_q4(cpu_linear.pack_panels(moved)) is None
    assert cpu_linear.pack_q4(cpu_linear.pack_panels(w[:, :48].contiguous())) is None
    zeros = w.clone()
    zeros[5, :32] = -0.0  # d 0, m -0: fma(0, 0, -0) is +0, not the same bits
    assert cpu_linear.pack_q4(cpu_linear.pack_panels(zeros)) is None
    zeros[5, :32] = 0.0
    assert cpu_linear.pack_q4(cpu_linear.pack_panels(zeros)) is not None
    q = torch.randint(0, 16, (64, 2, 32), generator=gen).float()
    q[..., 0], q[..., 1] = 0, 15
    coarse = (q / 64 - 0.125).reshape(64, 64)  # d = 2^-6, m = -2^-3: bfloat16 values
    panels = cpu_linear.pack_panels(coarse)
    assert cpu_linear.split_parts(panels).shape[1] == 1
    assert cpu_linear.pack_q4(panels) is None


def test_blocks_of_another_weight_or_without_the_parts_are_refused():
    """Blocks of another shape, and blocks without the weight's two parts (its larger products
    would then take other sums than its small ones), are a ValueError."""
    gen = torch.Generator().manual_seed(5)
    panels = cpu_linear.pack_panels(q4_1(64, 64, gen))
    parts, blocks = cpu_linear.split_parts(panels), cpu_linear.pack_q4(panels)
    other = cpu_linear.pack_q4(cpu_linear.pack_panels(q4_1(64, 96, gen)))
    with pytest.raises(ValueError, match="blocks of panels"):
        cpu_linear.linear(torch.randn(2, 64), panels, None, 64, parts, other)
    with pytest.raises(ValueError, match="beside the weight's two parts"):
        cpu_linear.linear(torch.randn(2, 64), panels, None, 64, None, blocks)
    three = torch.cat([parts, torch.zeros_like(parts[:, :1])], dim=1).contiguous()
    with pytest.raises(ValueError, match="beside the weight's two parts"):
        cpu_linear.linear(torch.randn(2, 64), panels, None, 64, three, blocks)


@pytest.mark.slow  # loads the real SmolLM2 model
def test_smollm2s_layers_are_found_as_blocks(smollm2_folder):
    """Every projection of the real checkpoint (Q4_1 in its GGUF) is taken as blocks at load,
    and the lm_head (Q8_0) is not; a layer's product from them is its parts' bit for bit."""
    from batchllm.model.linear import Linear
    from batchllm.model.loader import load_model

    model = load_model(str(smollm2_folder)).model
    layers = [p for layer in model.layers
              for p in (layer.attn.qkv, layer.attn.o, layer.mlp.gate_up, layer.mlp.down)]
    assert all(isinstance(p, Linear) for p in layers) and len(layers) == 120
    assert all(p.blocks is not None for p in layers)
    assert model.lm_head.blocks is None
    down = model.layers[7].mlp.down
    x = torch.randn(20, down.in_features, generator=torch.Generator().manual_seed(1))
    from_parts = cpu_linear.linear(x, down.panels, down.panel_bias, down.out_features,
                                   down.parts)
    assert same_bits(down(x), from_parts)


def test_products_of_up_to_block_rows_stream_the_blocks():
    """Given the blocks of another weight of the same shape, products of 1 to BLOCK_ROWS (48)
    rows return that weight's values (they read the blocks, not the parts), and from one row
    more the parts': the Python constant is the kernel's."""
    gen = torch.Generator().manual_seed(9)
    w, other = q4_1(80, 128, gen), q4_1(80, 128, gen)
    panels = cpu_linear.pack_panels(w)
    parts = cpu_linear.split_parts(panels)
    others = cpu_linear.pack_panels(other)
    blocks = cpu_linear.pack_q4(others)
    x = torch.randn(64, 128, generator=gen)
    last = cpu_linear.BLOCK_ROWS
    for m in (1, 16, 17, last, last + 1, 64):
        y = cpu_linear.linear(x[:m], panels, None, 80, parts, blocks)
        source = others if m <= last else panels
        expected = cpu_linear.linear(x[:m], source, None, 80, cpu_linear.split_parts(source))
        assert same_bits(y, expected), f"{m} rows"
