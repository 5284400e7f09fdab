"""The projections (batchllm/model/linear.py) in the layout the model's ops pick on the CPU
(batchllm/model/ops.py): the C kernel on 16-column panels (kernels/cpu/linear.c) and, where it
cannot be built, oneDNN on a reordered weight, both checked against torch's F.linear in float64
for the row counts of decode steps and prefill chunks, the tails of the kernel's 6-row tiles
and 16-column panels, and its blocks of rows."""

import pytest
import torch
import torch.nn.functional as F

from batchllm.model.linear import Linear
from batchllm.model.ops import pick_ops
from batchllm_kernels.cpu import linear as cpu_linear

BACKENDS = ["panels", "onednn"]


@pytest.fixture
def backend(request, monkeypatch):
    """Linear built with the C kernel ("panels", skipped where it cannot be built) or without
    it ("onednn": the kernel reported unavailable)."""
    if request.param == "panels" and cpu_linear.load() is None:
        pytest.skip("the C projection kernel cannot be built here")
    if request.param == "onednn":
        monkeypatch.setattr(cpu_linear, "load", lambda: None)
    return request.param


def layout(dtype: torch.dtype = torch.float32) -> str:
    """The projection layout a model on the CPU in `dtype` gets."""
    return pick_ops(torch.device("cpu"), dtype, 4, 64).projection


def check(x, w, b, backend):
    layer = Linear(w, b, layout())
    assert (layer.panels is not None) == (backend == "panels")
    y = layer(x)
    expected = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert y.shape == expected.shape and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [0, 1, 5, 7, 39, 64, 300])
def test_matches_float64_linear(rows, bias, backend):
    gen = torch.Generator().manual_seed(rows * 2 + bias)
    w = torch.randn(100, 81, generator=gen)  # 6 panels + 4 columns; an odd K
    b = torch.randn(100, generator=gen) if bias else None
    wide = torch.randn(rows, 162, generator=gen)
    check(wide[:, ::2], w, b, backend)  # columns apart (copied for the kernel)
    check(wide[:, 7:88], w, b, backend)  # rows apart: a view of a wider projection


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_rows_in_blocks(backend):
    """K = 1,000: the kernel takes x in blocks of 96 rows; 250 rows end in a partial block."""
    gen = torch.Generator().manual_seed(3)
    check(torch.randn(250, 1000, generator=gen), torch.randn(40, 1000, generator=gen) / 30,
          torch.randn(40, generator=gen), backend)


def test_panels_layout():
    w = torch.arange(40 * 3, dtype=torch.float32).view(40, 3)  # [N=40, K=3]
    panels = cpu_linear.pack_panels(w)
    assert panels.shape == (3, 3, 16)
    assert torch.equal(panels[1, 2], w[16:32, 2])
    assert torch.equal(panels[2, 0, :8], w[32:, 0]) and not panels[2, :, 8:].any()


def test_other_dtypes_run_dense():
    bf16 = Linear(torch.randn(8, 4, dtype=torch.bfloat16), None, layout(torch.bfloat16))
    assert bf16.panels is None and bf16.packed is None
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    torch.testing.assert_close(bf16(x), F.linear(x, bf16.weight))
