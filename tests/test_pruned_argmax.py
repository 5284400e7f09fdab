"""The greedy rows' argmax from W's high parts first (kernels/cpu/amx_argmax.h): on columns so
close that the high parts rank them wrongly, it must still return the index of the whole exact
product (linear(...).argmax, the first maximum on ties), however many columns its bound leaves
in the running and however the rows fall into tiles; where its bound cannot hold (a NaN, an
infinity) the whole product answers. On the tile unit only (a CPU with AMX-BF16)."""

import pytest
import torch

from kernels.cpu import linear as cpu_linear

pytestmark = pytest.mark.skipif(cpu_linear.load() is None or not cpu_linear.uses_amx(),
                                reason="the tile unit's pruned argmax: a CPU with AMX-BF16")


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).double()


def crowded(m: int, n: int, k: int, gen: torch.Generator):
    """x [m, k], w [n, k]: every column a shared direction plus noise at 2^-9 of it, below what
    bfloat16 resolves, so that a row's logits crowd within the high parts' error of each other"""
    base = torch.randn(k, generator=gen)
    w = base + torch.randn(n, k, generator=gen) * 2.0**-9 * base.abs()
    x = base * (1 + 0.1 * torch.randn(m, k, generator=gen))
    return x, w


def high_logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # [m, n] float64
    """(xh + xm) . wh, what the first pass ranks by (exact arithmetic: its rounding aside)"""
    xh = _bf16(x)
    return (xh + _bf16(x.double() - xh)) @ _bf16(w).T


def argmax_of(x, w):
    panels = cpu_linear.pack_panels(w)
    parts = cpu_linear.split_parts(panels)
    bounds = cpu_linear.argmax_bounds(panels)
    n = w.shape[0]
    pruned = cpu_linear.linear_argmax(x, panels, None, n, parts, bounds)
    whole = cpu_linear.linear_argmax(x, panels, None, n, parts)
    logits = cpu_linear.linear(x, panels, None, n, parts)
    return pruned, whole, logits


@pytest.mark.parametrize("m", [1, 7, 16, 17, 40, 64, 97])
def test_crowded_columns_give_the_whole_products_argmax(m):
    gen = torch.Generator().manual_seed(100 + m)
    n, k = 1000, 96
    x, w = crowded(m, n, k, gen)
    pruned, whole, logits = argmax_of(x, w)
    assert torch.equal(whole, logits.argmax(dim=-1))
    assert torch.equal(pruned, whole)
    # the case is one where the first pass alone would answer wrongly on many rows
    wrong = (high_logits(x, w).argmax(dim=-1) != whole).sum().item()
    assert wrong >= max(1, m // 5), f"only {wrong} of {m} rows ranked wrongly by the high parts"


def test_planted_ties_beyond_the_high_parts_take_the_first_column():
    """Two columns with equal high parts whose low parts make the later one larger (the first
    pass sees a tie and would keep the first); and exact ties, which keep the first."""
    gen = torch.Generator().manual_seed(9)
    m, n, k = 20, 700, 64
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k**0.5
    cols = torch.randperm(n, generator=gen)[: 3 * m].view(m, 3).sort(dim=1).values
    for r, (lo, mid, hi) in enumerate(cols.tolist()):
        top = 2 * _bf16(x[r] / x[r].norm()).float()  # exact in bfloat16: its h is itself
        w[lo] = top
        w[mid] = top + torch.sign(x[r]) * top.abs() * 2.0**-12  # same h, a larger logit
        w[hi] = w[mid]  # an exact tie with mid, later
    pruned, whole, logits = argmax_of(x, w)
    assert torch.equal(_bf16(w[cols[:, 0]]), _bf16(w[cols[:, 1]]))
    assert torch.equal(whole, cols[:, 1])
    assert torch.equal(logits.argmax(dim=-1), cols[:, 1])
    assert torch.equal(pruned, cols[:, 1])


def test_rows_apart_and_real_scale_logits():
    """x rows with a stride (a view, as the decoder's last positions are), a vocabulary of
    SmolLM2's width whose last panel is partial, logits at a trained model's scale"""
    gen = torch.Generator().manual_seed(3)
    n, k = 49_157, 64
    w = torch.randn(n, k, generator=gen) * 0.05
    x = (torch.randn(24, k + 5, generator=gen) * 3)[:, 2 : k + 2]
    pruned, whole, logits = argmax_of(x, w)
    assert torch.equal(whole, logits.argmax(dim=-1))
    assert torch.equal(pruned, whole)


def test_non_finite_values_take_the_whole_product():
    """A NaN or an infinity in x or W leaves no bound: the same index as torch.argmax of the
    whole product's logits (NaN highest, the first of them)"""
    gen = torch.Generator().manual_seed(4)
    n, k = 300, 40
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(6, k, generator=gen)
    x[2, 5] = float("inf")
    x[4, 1] = float("nan")
    pruned, _, logits = argmax_of(x, w)
    assert torch.equal(pruned, logits.argmax(dim=-1))
    w[77, 3] = w[250, 5] = float("nan")
    w[100, 0] = float("inf")
    x = torch.randn(6, k, generator=gen)
    pruned, _, logits = argmax_of(x, w)
    assert torch.equal(pruned, logits.argmax(dim=-1))


def test_bounds_of_another_shape_are_refused():
    panels = cpu_linear.pack_panels(torch.randn(40, 8))
    parts = cpu_linear.split_parts(panels)
    with pytest.raises(ValueError, match="bounds"):
        cpu_linear.linear_argmax(torch.randn(2, 8), panels, None, 40, parts,
                                 torch.zeros(2, 16))
