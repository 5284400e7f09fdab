"""The projections (batchllm/model/linear.py): oneDNN on a weight reordered once, checked against
torch's own F.linear in float64 for the row counts of decode steps and prefill chunks."""

import pytest
import torch
import torch.nn.functional as F

from batchllm.model.linear import Linear


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [0, 1, 7, 39, 300])
def test_matches_float64_linear(rows, bias):
    gen = torch.Generator().manual_seed(rows * 2 + bias)
    w = torch.randn(96, 80, generator=gen)
    b = torch.randn(96, generator=gen) if bias else None
    wide = torch.randn(rows, 160, generator=gen)
    x = wide[:, ::2]  # not contiguous, as the MLP's gate half is
    y = Linear(w, b)(x)
    expected = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert y.shape == (rows, 96) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5)


def test_float32_cpu_weight_is_reordered_once():
    layer = Linear(torch.randn(8, 4))
    if torch.backends.mkldnn.is_available():
        assert layer.packed is not None and layer.weight is None
    bf16 = Linear(torch.randn(8, 4, dtype=torch.bfloat16))
    assert bf16.packed is None  # only float32 is reordered; others run F.linear
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    torch.testing.assert_close(bf16(x), F.linear(x, bf16.weight))
