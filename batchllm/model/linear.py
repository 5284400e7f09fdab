"""y = x W^T + b for the model's projections, with the weight laid out once for the CPU.

On the CPU (float32, torch built with oneDNN) the weight is reordered once, at load, into
oneDNN's blocked format (`torch.ops.mkldnn._reorder_linear_weight`, what torch.compile's
freezing pass does) and every call runs oneDNN's matmul on it. MKL's sgemm behind F.linear is
slow with a decode step's few rows when the weights come from memory (30 layers do not stay in
cache). Measured on this project's 2-core machine over 30 layers of SmolLM2-135M's four
projections, F.linear -> this: 39 rows 58-65 -> 95-103 GFLOP/s, 16 rows 38-45 -> 59-74, 256 rows
121-136 -> 135-153, 1,024-8,192 rows level (~145); the lm_head (49,152 x 576) at 39 rows 40 -> 65.
The reordered copy replaces the dense one (no extra memory). Elsewhere, or without oneDNN, plain
F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_ROWS_HINT = 64  # the batch size oneDNN picks its weight layout for: a decode step's rows


def _onednn_usable(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.float32
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class Linear:
    """A projection: [*, K] -> [*, N]. The dense weight is not kept where it is reordered."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        # weight [N, K], bias [N] or None
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.packed = None
        self.weight = weight
        if _onednn_usable(weight):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _ROWS_HINT)
            self.weight = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
