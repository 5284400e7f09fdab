"""A projection whose weight is FP8 (fp8_weights.py's record): what linear.Linear becomes when
it is given one. The weight stays FP8 in memory on every path; the product:

  CUDA, sm_89+  W8A8: activations quantized per token, FP8 x FP8 products (Triton,
                kernels/triton/fp8_matmul.py)
  CUDA, sm_80   W8A16: the weight decoded into the activations' dtype in the kernel
  the CPU       the weight dequantized at each call, then F.linear (kernels/reference/
                fp8_matmul.py: correct, not fast), as transformers runs a dequantized
                checkpoint
BATCHLLM_BACKEND=triton runs the CUDA path's kernels anywhere (Triton's interpreter without a
GPU), W8A8 unless BATCHLLM_FP8_MATMUL=w8a16 asks for the sm_80 path.
"""

from __future__ import annotations

import os

import torch

from batchllm.model.errors import ModelError
from batchllm.model.fp8_weights import Fp8Weight
from batchllm.model.ops import backend
from batchllm_kernels.reference.fp8_matmul import fp8_matmul_ref

PATHS = ("reference", "w8a8", "w8a16")


def fp8_path(device: torch.device) -> str:
    """Which product an FP8 weight on `device` runs (module docstring)."""
    device = torch.device(device)
    if device.type != "cuda" and backend() != "triton":
        return "reference"
    asked = os.environ.get("BATCHLLM_FP8_MATMUL", "")
    if asked:
        if asked not in ("w8a8", "w8a16"):
            raise ModelError(f"BATCHLLM_FP8_MATMUL: expected w8a8 or w8a16, got {asked!r}")
        return asked
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        return "w8a16"
    return "w8a8"


class Fp8Linear:
    """y = x W^T + b, W an FP8 weight: [T, K] -> [T, N]. Linear's surface (out_features,
    in_features, bias, __call__, argmax) and none of its CPU layouts."""

    panels = parts = blocks = packed = weight = None  # no C kernel layout (cpu_layers.py)

    def __init__(self, weight: Fp8Weight | list[Fp8Weight], bias: torch.Tensor | None) -> None:
        self.fp8 = Fp8Weight.cat(weight) if isinstance(weight, list) else weight
        self.out_features, self.in_features = self.fp8.shape
        self.bias = bias
        self.path = fp8_path(self.fp8.weight.device)
        self._kernel = None
        if self.path != "reference":
            from batchllm_kernels.triton.fp8_matmul import (  # the CUDA path only needs triton
                fp8_linear,
            )

            self._kernel = fp8_linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
        w = self.fp8
        if self._kernel is None:
            return fp8_matmul_ref(x, w.weight, w.scale, w.row_block, w.col_block, self.bias)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        y = self._kernel(x2, w.weight, w.scale, w.row_block, w.col_block, self.bias,
                         fp8_dot=self.path == "w8a8", scale_ub=w.scale_ub)
        return y.view(*lead, self.out_features)

    def argmax(self, x: torch.Tensor) -> None:
        return None  # no fused argmax: the caller takes the logits
