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


def argmax_of(x, w, *, ran: bool = True):
    """(the pruned argmax, the whole product's, its logits, the pruned call's exact panel tiles);
    ran: assert that the pruned pass answered (no fallback to the whole product)"""
    panels = cpu_linear.pack_panels(w)
    parts = cpu_linear.split_parts(panels)
    bounds = cpu_linear.argmax_bounds(panels)
    n = w.shape[0]
    pruned = cpu_linear.linear_argmax(x, panels, None, n, parts, bounds)
    exact = cpu_linear.argmax_exact_panels()
    if ran:
        assert exact >= 0, "the whole product ran instead"
    whole = cpu_linear.linear_argmax(x, panels, None, n, parts)
    assert cpu_linear.argmax_exact_panels() == -1
    logits = cpu_linear.linear(x, panels, None, n, parts)
    return pruned, whole, logits, exact


@pytest.mark.parametrize("m", [1, 7, 16, 17, 40, 64, 97])
def test_crowded_columns_give_the_whole_products_argmax(m):
    """Many columns left in the running, many second-pass panels over several row tiles"""
    gen = torch.Generator().manual_seed(100 + m)
    n, k = 1000, 96
    x, w = crowded(m, n, k, gen)
    pruned, whole, logits, _ = argmax_of(x, w)
    assert torch.equal(whole, logits.argmax(dim=-1))
    assert torch.equal(pruned, whole)
    # the case is one where the first pass alone would answer wrongly on many rows
    wrong = (high_logits(x, w).argmax(dim=-1) != whole).sum().item()
    assert wrong >= max(1, m // 5), f"only {wrong} of {m} rows ranked wrongly by the high parts"


@pytest.mark.parametrize("scale", [0.25, 1.0, 4.0])
def test_rounding_errors_aligned_with_x_are_inside_the_bound(scale):
    """The bound's worst case: x all equal and positive, a column B whose every value rounds down
    to its bfloat16 h by 0.49 of a unit in the last place (its error lined up with x: Cauchy-
    Schwarz is tight), and an earlier column A exact in bfloat16 whose high value beats B's by
    over half of B's bound while B's exact value beats A's. The first pass ranks A first; the
    answer must be B. B's error is 0.98 of the kernel's bound before its 1.25 margin; a bound
    under about half of the kernel's (measured: a margin of 0.5 fails, 0.7 passes) or without
    its ||w - wh|| term prunes B's panel and fails here."""
    k, n = 256, 500
    gen = torch.Generator().manual_seed(12)
    x = torch.full((3, k), scale)
    w = torch.randn(n, k, generator=gen) * 0.01
    a_col, b_col = 37, 300
    w[a_col] = 1.0
    w[a_col, torch.randperm(k, generator=gen)[: int(0.3 * k)]] = 1 + 2.0**-7  # bfloat16 values
    w[b_col] = 1 + 0.49 * 2.0**-7  # bfloat16 1.0 plus 0.49 ulp: its h is 1.0
    assert torch.equal(_bf16(w[b_col]), torch.ones(k, dtype=torch.float64))
    assert torch.equal(high_logits(x, w).argmax(dim=-1), torch.full((3,), a_col))
    pruned, whole, logits, _ = argmax_of(x, w)
    assert torch.equal(whole, torch.full((3,), b_col))
    assert torch.equal(logits.argmax(dim=-1), whole)
    assert torch.equal(pruned, whole)


def test_negative_logits_and_a_partial_last_panel():
    """Every logit below zero, the maximum in the last panel's 5 columns: the panel's padded
    columns (a = 0 there) must not enter a row's best a - E"""
    gen = torch.Generator().manual_seed(13)
    n, k = 69, 40
    x = torch.rand(8, k, generator=gen) + 0.5
    w = -(torch.rand(n, k, generator=gen) + 0.5)
    w[66] = -0.01  # the largest (least negative) logit, in the partial last panel
    pruned, whole, logits, _ = argmax_of(x, w)
    assert torch.equal(whole, torch.full((8,), 66))
    assert torch.equal(logits.argmax(dim=-1), whole)
    assert torch.equal(pruned, whole)


def test_spread_logits_are_mostly_pruned():
    """Logits spread as random weights give them: the second pass takes a few panels a row tile
    (SmolLM2's real rows: ~6 of 3,072), not the whole product, or the first pass is all cost"""
    gen = torch.Generator().manual_seed(14)
    n, k, m = 8_000, 128, 32
    w = torch.randn(n, k, generator=gen) * 0.05
    x = torch.randn(m, k, generator=gen) * 3
    pruned, whole, _, exact = argmax_of(x, w)
    assert torch.equal(pruned, whole)
    tiles, panels = m // 16, -(-n // 16)
    assert tiles <= exact <= tiles * panels // 10, f"{exact} of {tiles * panels} panel tiles"


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
    pruned, whole, logits, _ = argmax_of(x, w)
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
    pruned, whole, logits, _ = argmax_of(x, w)
    assert torch.equal(whole, logits.argmax(dim=-1))
    assert torch.equal(pruned, whole)


def test_values_without_a_bound_take_the_whole_product():
    """A NaN or an infinity in x or W, or an x too large for the bound's float32 coefficients,
    leaves no bound: the same index as torch.argmax of the whole product's logits (NaN
    highest, the first of them)"""
    gen = torch.Generator().manual_seed(4)
    n, k = 300, 40
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(6, k, generator=gen)
    x[2, 5] = float("inf")
    x[4, 1] = float("nan")
    pruned, _, logits, _ = argmax_of(x, w, ran=False)
    assert torch.equal(pruned, logits.argmax(dim=-1))
    huge = torch.randn(6, k, generator=gen) * 1e31  # ||x|| past 2^100, its logits finite
    pruned, _, logits, exact = argmax_of(huge, w, ran=False)
    assert exact == -1
    assert torch.equal(pruned, logits.argmax(dim=-1))
    w[77, 3] = w[250, 5] = float("nan")
    w[100, 0] = float("inf")
    x = torch.randn(6, k, generator=gen)
    pruned, _, logits, _ = argmax_of(x, w, ran=False)
    assert torch.equal(pruned, logits.argmax(dim=-1))


def test_bounds_of_another_shape_are_refused():
    panels = cpu_linear.pack_panels(torch.randn(40, 8))
    parts = cpu_linear.split_parts(panels)
    with pytest.raises(ValueError, match="bounds"):
        cpu_linear.linear_argmax(torch.randn(2, 8), panels, None, 40, parts,
                                 torch.zeros(2, 16))
