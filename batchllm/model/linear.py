"""y = x W^T + b for the model's projections, with the weight laid out once for the CPU.

On the CPU in float32 the weight is cut once, at load, into the 16-column panels of the C kernel
(kernels/cpu_linear.py: decode steps' few rows at 1.2-1.4x oneDNN's speed, larger products
1.1-1.2x). Where the kernel cannot be built (no compiler, BATCHLLM_CPU_KERNEL=0) it is reordered
into oneDNN's blocked format instead (`torch.ops.mkldnn._reorder_linear_weight`, what
torch.compile's freezing pass does) and run with oneDNN's matmul: MKL's sgemm behind F.linear is
slow with few rows when the weights come from memory (30 layers do not stay in cache); over 30
layers of SmolLM2-135M's four projections, F.linear -> oneDNN: 39 rows 58-65 -> 95-103 GFLOP/s,
16 rows 38-45 -> 59-74, 256 rows 121-136 -> 135-153. Either layout replaces the dense weight (no
extra memory). Elsewhere plain F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu_linear

_ROWS_HINT = 64  # the batch size oneDNN picks its weight layout for: a decode step's rows


def _cpu_float32(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32


def _onednn_usable() -> bool:
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class Linear:
    """A projection: [T, K] -> [T, N]. The dense weight is not kept where it is laid out anew."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        # weight [N, K], bias [N] or None
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.weight = weight
        self.panels = self.panel_bias = None  # the C kernel's layout, where it runs
        self.packed = None  # oneDNN's blocked weight, where it runs instead
        if _cpu_float32(weight) and cpu_linear.load() is not None:
            self.panels = cpu_linear.pack_panels(weight)
            self.panel_bias = cpu_linear.pack_bias(bias, self.out_features)
            self.weight = None
        elif _cpu_float32(weight) and _onednn_usable():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _ROWS_HINT)
            self.weight = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None:
            return cpu_linear.linear(x, self.panels, self.panel_bias, self.out_features)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
