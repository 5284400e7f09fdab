"""The C projection kernel's own paths (kernels/cpu/linear.c), called directly, as built for this
machine and with AVX-512, then AVX2 switched off: every tile height (1 .. 24 rows with AVX-512,
1 .. 6 otherwise) and the even cuts past it, products small enough to run on one thread and
large enough to fork, odd N and K, bias or none; and the argmax entry that
the greedy rows' lm_head takes, which must return torch.argmax of the kernel's own logits exactly
(first maximum on ties, NaN highest), planted ties included."""

import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from batchllm_kernels.cpu import build
from batchllm_kernels.cpu import linear as cpu_linear

# The kernel as this machine builds it, and its narrower paths built here too (a machine without
# AVX-512, or without AVX2, runs those): extra compiler flags for each.
ISAS = {"native": (), "avx2": ("-mno-avx512f",), "plain": ("-mno-avx2", "-mno-fma")}


@pytest.fixture(autouse=True, params=list(ISAS))
def kernel(request, monkeypatch):
    if request.param != "native":
        monkeypatch.setattr(build, "_FLAGS", (*build._FLAGS, *ISAS[request.param]))
        monkeypatch.setattr(cpu_linear, "load", functools.cache(cpu_linear.load.__wrapped__))
    if cpu_linear.load() is None:
        pytest.skip("the C projection kernel cannot be built here")


def packed(w: torch.Tensor, b: torch.Tensor | None):
    return cpu_linear.pack_panels(w), cpu_linear.pack_bias(b, w.shape[0])


# (N, K): 4 panels + 5 columns and an odd K, 5 x 13 x 16 = ~1k multiply-adds a row (one thread
# below 256 rows); 13 panels + 3 columns and K = 333 (~70k a row: forked from 4 rows on)
SHAPES = [(69, 13), (211, 333)]
ROWS = [*range(1, 26), 31, 47, 48, 49, 70, 97]  # every tile height, then 2, 3 and 4-5 tiles


@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_every_row_count_matches_float64(n, k, bias):
    gen = torch.Generator().manual_seed(n + k + bias)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    panels, pb = packed(w, b)
    for m in ROWS:
        x = torch.randn(m, k + 3, generator=gen)[:, 1 : k + 1]  # rows apart, as qkv views are
        y = cpu_linear.linear(x, panels, pb, n)
        expected = F.linear(x.double(), w.double(), None if b is None else b.double())
        torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-4,
                                   msg=lambda s, m=m: f"{m} rows: {s}")


def exact(gen: np.random.Generator, shape: tuple[int, ...], lo: int, hi: int,
          scale: float) -> torch.Tensor:
    """Integers in [lo, hi] times a power of two, as float32: every product and partial sum of
    the tests' shapes is exact in float32, so the kernel's sums equal float64's in any order and
    on any instruction set. numpy's integer generator gives the same values on every machine
    (torch.randn's CPU kernels differ by instruction set, so its data did not)."""
    return torch.from_numpy(gen.integers(lo, hi + 1, size=shape).astype(np.float32) * scale)


def planted(m: int, n: int, k: int, gen: np.random.Generator, bias: bool):
    """x [m, k], w [n, k], b: row r's largest logit sits at two equal columns (weight rows equal
    to x[r]), the first in an early panel, the second in a late one (the other thread's half):
    the argmax must be the first. Values in quarters and eighths (`exact`), so every logit is
    the same number in float32 and float64 and no near tie can be read two ways; the planted
    maximum is checked to be strict in float64."""
    x = exact(gen, (m, k), -4, 4, 0.25)
    w = exact(gen, (n, k), -4, 4, 0.125)
    b = exact(gen, (n,), -8, 8, 0.25) if bias else None
    cols = torch.from_numpy(gen.permutation(n)[: 2 * m].reshape(m, 2)).sort(dim=1).values
    for r, (lo, hi) in enumerate(cols.tolist()):
        w[lo] = w[hi] = x[r]
        if b is not None:
            b[lo] = b[hi] = 0.5
    logits = F.linear(x.double(), w.double(), None if b is None else b.double())
    top2 = logits.topk(3, dim=-1).values
    assert torch.all(top2[:, 0] == top2[:, 1]) and torch.all(top2[:, 1] > top2[:, 2]), \
        "the planted pair is not each row's strict maximum: change the seed"
    return x, w, b, cols[:, 0]


@pytest.mark.parametrize("n, k", [(1000, 96), (4099, 37)])
@pytest.mark.parametrize("m", [1, 3, 8, 16, 24, 25, 40, 64, 130])
@pytest.mark.parametrize("bias", [False, True])
def test_argmax_is_torch_argmax_of_the_logits(n, k, m, bias):
    """On exact data (`planted`) the rule is equality, on every machine: the kernel's argmax is
    torch.argmax of its own logits, the planted first column, and float64's argmax."""
    gen = np.random.default_rng(n * m + bias)
    x, w, b, first = planted(m, n, k, gen, bias)
    panels, pb = packed(w, b)
    ids = cpu_linear.linear_argmax(x, panels, pb, n)
    logits = cpu_linear.linear(x, panels, pb, n)  # what the unfused path samples from
    expected = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert torch.equal(logits.double(), expected)  # exact data: the same sums in any order
    assert ids.dtype == torch.int64 and ids.shape == (m,)
    assert torch.equal(ids, logits.argmax(dim=-1))
    assert torch.equal(ids, first)  # the planted tie: its first column
    assert torch.equal(ids, expected.argmax(dim=-1))


def test_argmax_ties_everywhere_take_the_first_column():
    """Every weight row the same: all N logits of a row are equal, the answer is column 0."""
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(1, 64, generator=gen).expand(500, 64).contiguous()
    x = torch.randn(20, 64, generator=gen)
    assert torch.equal(cpu_linear.linear_argmax(x, *packed(w, None), 500), torch.zeros(20).long())


def test_argmax_nan_and_minus_inf_as_torch():
    """A NaN column wins over every number (the first NaN where there are two), as in
    torch.argmax; a row of -inf everywhere gives column 0."""
    gen = torch.Generator().manual_seed(6)
    n, k = 300, 40
    w = torch.randn(n, k, generator=gen)
    w[77, 3] = w[250, 5] = float("nan")
    x = torch.randn(4, k, generator=gen)
    panels, _ = packed(w, None)
    ids = cpu_linear.linear_argmax(x, panels, None, n)
    assert torch.equal(ids, cpu_linear.linear(x, panels, None, n).argmax(dim=-1))
    assert ids.tolist() == [77] * 4
    b = torch.full((n,), float("-inf"))
    w = torch.randn(n, k, generator=gen)
    logits = cpu_linear.linear(x, *packed(w, b), n)
    assert torch.equal(cpu_linear.linear_argmax(x, *packed(w, b), n), logits.argmax(dim=-1))
    assert cpu_linear.linear_argmax(x, *packed(w, b), n).tolist() == [0] * 4


def test_argmax_of_no_rows():
    panels, _ = packed(torch.randn(40, 8), None)
    assert cpu_linear.linear_argmax(torch.empty(0, 8), panels, None, 40).shape == (0,)
