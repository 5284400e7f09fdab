"""Pure-torch twin of the Triton grouped product (kernels/triton/grouped_matmul.py): the rows of
a mixture-of-experts step, sorted by expert, each expert's run of rows times its own weight.
"""

from __future__ import annotations

import torch


def grouped_matmul_ref(
    x: torch.Tensor,  # [N, K], rows sorted by expert
    w: torch.Tensor,  # [E, M, K], one weight per expert
    offsets: torch.Tensor,  # [E+1] int32, expert e's rows: offsets[e]:offsets[e+1]
) -> torch.Tensor:  # [N, M], x's dtype
    """y[rows of e] = x[rows of e] @ w[e]^T: one product per expert that has rows."""
    y = x.new_empty(x.shape[0], w.shape[1])
    bounds = offsets.tolist()
    for e in range(w.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            y[lo:hi] = (x[lo:hi].float() @ w[e].float().T).to(x.dtype)
    return y
