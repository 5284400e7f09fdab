"""y = x W^T + b for the model's projections, with the weight laid out once, at load, as the
model's ops record says (ops.py picks the layout; its reasons are there).

  "panels"  CPU, float32: cut into the 16-column panels of the C kernel (kernels/cpu/linear.py:
            decode steps' few rows at 1.2-1.4x oneDNN's speed, larger products 1.1-1.2x);
            on a CPU with AMX-BF16 also split into the tile unit's bf16 parts (kernels/cpu/amx.h:
            exact to float32), which every product then takes: 1.4-2x the FMA tiles from 32
            rows; below, as fast where the weight needs two parts (4 bytes a weight streamed, as
            the panels: SmolLM2's dequantized Q4_1 layers), a little slower where it needs three,
            ~1.6x faster where it needs one (a bfloat16 checkpoint: 2 bytes a weight); where
            the values are Q4_1's 4-bit blocks, those are found again and kept too, and steps
            of up to 48 rows stream them (kernels/cpu/amx_q4.h: 0.625 bytes a weight, the same
            sums bit for bit; 1-16 rows ~1.4x faster)
  "onednn"  CPU, float32, where that kernel cannot be built (no compiler, BATCHLLM_CPU_KERNEL=0):
            reordered into oneDNN's blocked format (`torch.ops.mkldnn._reorder_linear_weight`,
            what torch.compile's freezing pass does) and run with oneDNN's matmul. MKL's sgemm
            behind F.linear is slow with few rows when the weights come from memory (30 layers
            do not stay in cache); over 30 layers of SmolLM2-135M's four projections, F.linear
            -> oneDNN: 39 rows 58-65 -> 95-103 GFLOP/s, 16 rows 38-45 -> 59-74, 256 rows
            121-136 -> 135-153.
  "dense"   the weight as loaded, F.linear (CUDA, other dtypes)
Either CPU layout replaces the dense weight (no extra memory; the AMX parts add 0.5x, 1x or
1.5x the panels, the 4-bit blocks 0.16x). A model built through its panel file
(panel_cache.py) maps panels, parts and blocks from it on a warm start instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchllm.model import panel_cache
from batchllm.model.fp8_linear import Fp8Linear
from batchllm.model.fp8_weights import holds_fp8
from batchllm.model.ops import Projection
from kernels.cpu import linear as cpu_linear

_ROWS_HINT = 64  # the batch size oneDNN picks its weight layout for: a decode step's rows


Weight = torch.Tensor | list[torch.Tensor]  # [N, K], or its row blocks [N_i, K] in order


def _laid_out(weight: Weight, bias: torch.Tensor | None, tiles: bool) -> panel_cache.Packed:
    """The kernel's layout of (weight, bias), with the tile unit's parts and blocks where
    `tiles`: from the model's panel file while a model is built through one
    (panel_cache.serving), else made here."""
    store = panel_cache.active()
    if store is not None:
        return store.take(weight, bias, tiles)
    return panel_cache.pack(weight, bias, tiles)


class Linear:
    """A projection: [T, K] -> [T, N]. The dense weight is not kept where it is laid out anew.

    The weight may come as its row blocks (q, k, v; gate, up): they are joined only where the
    layout needs the dense weight, so that a model whose panels come from the panel file never
    reads them (the blocks are the checkpoint's mapped tensors). An FP8 weight makes an
    Fp8Linear instead (model/fp8_linear.py), whatever the layout."""

    def __new__(cls, weight: Weight, bias: torch.Tensor | None, layout: Projection):
        if holds_fp8(weight):
            return Fp8Linear(weight, bias)
        return super().__new__(cls)

    def __init__(self, weight: Weight, bias: torch.Tensor | None,
                 layout: Projection) -> None:
        # weight [N, K] (or row blocks), bias [N] or None
        parts = weight if isinstance(weight, list) else [weight]
        first = parts[0]
        if layout != "dense" and (first.device.type != "cpu" or first.dtype != torch.float32):
            raise ValueError(f"Linear: the {layout!r} layout takes a float32 weight on the CPU, "
                             f"got {first.dtype} on {first.device}")
        self.out_features, self.in_features = cpu_linear.rows(parts), first.shape[1]
        self.bias = bias
        self.weight = None
        self.panels = self.panel_bias = None  # the C kernel's layout, where it runs
        self.parts = None  # the panels split for the tile unit, where it runs
        self.blocks = None  # the weight's 4-bit blocks, where its values are (small steps)
        self.bounds = None  # the pruned argmax's column norms, made by the first argmax()
        self.packed = None  # oneDNN's blocked weight, where it runs instead
        if layout == "panels":
            # The parts and blocks only where the products take them (the tile unit): made at
            # load with the panels (for SmolLM2's 538 MB ~2.5 s of packing, ~0.2 s of splitting,
            # ~0.09 s of finding the blocks), or all mapped from the panel file on a warm start.
            laid = _laid_out(weight, bias, cpu_linear.uses_amx())
            self.panels, self.panel_bias = laid.panels, laid.bias
            self.parts, self.blocks = laid.parts, laid.blocks
            return
        dense = torch.cat(parts) if len(parts) > 1 else first
        if layout == "onednn":
            self.packed = torch.ops.mkldnn._reorder_linear_weight(dense.contiguous(), _ROWS_HINT)
        else:
            self.weight = dense

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None:
            return cpu_linear.linear(x, self.panels, self.panel_bias, self.out_features,
                                     self.parts, self.blocks)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:  # [T, K] -> [T] int64, or None
        """self(x).argmax(-1), the product never written, on the C kernel's panels (the same
        values, so the same first maximum); None in the other layouts."""
        if self.panels is None:
            return None
        if self.bounds is None and self.parts is not None and self.panel_bias is None:
            # once (~10 ms for SmolLM2's lm_head): only the lm_head asks for an argmax
            self.bounds = cpu_linear.argmax_bounds(self.panels)
        return cpu_linear.linear_argmax(x, self.panels, self.panel_bias, self.out_features,
                                        self.parts, self.bounds)
