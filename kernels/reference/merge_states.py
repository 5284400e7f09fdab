"""Pure-torch twin of the Triton merge (kernels/triton/merge_states.py): two attention states
over disjoint key sets merged by the log-sum-exp rule.
"""

from __future__ import annotations

import torch


def merge_states_ref(
    o_a: torch.Tensor,  # [T, H, D]
    lse_a: torch.Tensor,  # [T, H] fp32
    o_b: torch.Tensor,  # [T, H, D]
    lse_b: torch.Tensor,  # [T, H] fp32
) -> tuple[torch.Tensor, torch.Tensor]:  # o [T, H, D], lse [T, H] fp32
    """Merge attention over two disjoint key sets by the log-sum-exp rule.

    m = max(lse_a, lse_b); lse = m + log(e^(lse_a-m) + e^(lse_b-m));
    o = e^(lse_a-lse) o_a + e^(lse_b-lse) o_b. A part with lse = -inf contributes nothing;
    two empty parts give o = 0 and lse = -inf.
    """
    lse_a = lse_a.float()
    lse_b = lse_b.float()
    m = torch.maximum(lse_a, lse_b)
    empty = torch.isinf(m) & (m < 0)
    m = torch.where(empty, torch.zeros_like(m), m)
    wa = torch.exp(lse_a - m)
    wb = torch.exp(lse_b - m)
    total = wa + wb
    lse = torch.where(empty, torch.full_like(m, float("-inf")), m + torch.log(total))
    denom = torch.where(empty, torch.ones_like(total), total)
    o = (o_a.float() * (wa / denom)[..., None] + o_b.float() * (wb / denom)[..., None])
    return o.to(o_a.dtype), lse
