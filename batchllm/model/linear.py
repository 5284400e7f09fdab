"""y = x W^T + b for the model's projections, with the weight laid out once, at load, as the
model's ops record says (ops.py picks the layout; its reasons are there).

  "panels"  CPU, float32: cut into the 16-column panels of the C kernel (kernels/cpu/linear.py:
            decode steps' few rows at 1.2-1.4x oneDNN's speed, larger products 1.1-1.2x)
  "onednn"  CPU, float32, where that kernel cannot be built (no compiler, BATCHLLM_CPU_KERNEL=0):
            reordered into oneDNN's blocked format (`torch.ops.mkldnn._reorder_linear_weight`,
            what torch.compile's freezing pass does) and run with oneDNN's matmul. MKL's sgemm
            behind F.linear is slow with few rows when the weights come from memory (30 layers
            do not stay in cache); over 30 layers of SmolLM2-135M's four projections, F.linear
            -> oneDNN: 39 rows 58-65 -> 95-103 GFLOP/s, 16 rows 38-45 -> 59-74, 256 rows
            121-136 -> 135-153.
  "dense"   the weight as loaded, F.linear (CUDA, other dtypes)
A GGUF file's Q8_0/Q4_0/Q4_1 weight (model/gguf_blocks.py) runs in the "panels" layout from its
own blocks (kernels/cpu/blocks.py: the same sums as the panels over its dequantized values, from
5/32 to 17/64 of their bytes); in the other layouts, or where that kernel cannot be built, it is
dequantized at load and laid out as a float32 weight.
Either CPU layout replaces the dense weight (no extra memory). A model built through its panel
file (panel_cache.py) maps the panels from it on a warm start instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchllm.model import panel_cache
from batchllm.model.fp8_linear import Fp8Linear
from batchllm.model.fp8_weights import holds_fp8
from batchllm.model.gguf_blocks import BlockWeight
from batchllm.model.ops import Projection
from batchllm_kernels.cpu import blocks as cpu_blocks
from batchllm_kernels.cpu import linear as cpu_linear

_ROWS_HINT = 64  # the batch size oneDNN picks its weight layout for: a decode step's rows


Weight = torch.Tensor | list[torch.Tensor]  # [N, K], or its row blocks [N_i, K] in order


def _laid_out(weight: Weight, bias: torch.Tensor | None) -> panel_cache.Packed:
    """The kernel's layout of (weight, bias): from the model's panel file while a model is
    built through one (panel_cache.serving), else made here."""
    store = panel_cache.active()
    if store is not None:
        return store.take(weight, bias)
    return panel_cache.pack(weight, bias)


class Linear:
    """A projection: [T, K] -> [T, N]. The dense weight is not kept where it is laid out anew.

    The weight may come as its row blocks (q, k, v; gate, up): they are joined only where the
    layout needs the dense weight, so that a model whose panels come from the panel file never
    reads them (the blocks are the checkpoint's mapped tensors). An FP8 weight makes an
    Fp8Linear instead (model/fp8_linear.py), whatever the layout; a GGUF weight (BlockWeight,
    or its row blocks of one kind) keeps its blocks in the "panels" layout."""

    def __new__(cls, weight: Weight | BlockWeight, bias: torch.Tensor | None,
                layout: Projection):
        if holds_fp8(weight):
            return Fp8Linear(weight, bias)
        return super().__new__(cls)

    def __init__(self, weight: Weight, bias: torch.Tensor | None,
                 layout: Projection) -> None:
        # weight [N, K] (or row blocks), bias [N] or None
        self.blocks, self.kind = None, None  # a GGUF weight's blocks, where they run
        parts = weight if isinstance(weight, list) else [weight]
        if any(isinstance(p, BlockWeight) for p in parts):
            parts = self._blocks_or_dense(parts, bias, layout)
            if parts is None:
                return
            weight = parts if len(parts) > 1 else parts[0]
        first = parts[0]
        if layout != "dense" and (first.device.type != "cpu" or first.dtype != torch.float32):
            raise ValueError(f"Linear: the {layout!r} layout takes a float32 weight on the CPU, "
                             f"got {first.dtype} on {first.device}")
        self.out_features, self.in_features = cpu_linear.rows(parts), first.shape[1]
        self.bias = bias
        self.weight = None
        self.panels = self.panel_bias = None  # the C kernel's layout, where it runs
        self.packed = None  # oneDNN's blocked weight, where it runs instead
        if layout == "panels":
            # made at load (for SmolLM2's 538 MB ~2.5 s of packing), or mapped from the panel
            # file on a warm start
            laid = _laid_out(weight, bias)
            self.panels, self.panel_bias = laid.panels, laid.bias
            return
        dense = torch.cat(parts) if len(parts) > 1 else first
        if layout == "onednn":
            self.packed = torch.ops.mkldnn._reorder_linear_weight(dense.contiguous(), _ROWS_HINT)
        else:
            self.weight = dense

    def _blocks_or_dense(self, parts: list, bias: torch.Tensor | None,
                         layout: Projection) -> list[torch.Tensor] | None:
        """A GGUF weight's blocks kept (None returned: built), else its parts as float32."""
        kinds = {(p.kind, p.in_features) if isinstance(p, BlockWeight) else None for p in parts}
        if layout == "panels" and len(kinds) == 1 and cpu_blocks.load() is not None:
            joined = BlockWeight.cat(parts)
            self.out_features, self.in_features = joined.shape
            self.blocks, self.kind = joined.blocks, joined.kind
            self.bias, self.weight, self.packed = bias, None, None
            self.panels, self.panel_bias = None, cpu_linear.pack_bias(bias, self.out_features)
            return None
        return [p.dequantize() if isinstance(p, BlockWeight) else p for p in parts]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.blocks is not None:
            return cpu_blocks.linear(x, self.blocks, self.kind, self.panel_bias)
        if self.panels is not None:
            return cpu_linear.linear(x, self.panels, self.panel_bias, self.out_features)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:  # [T, K] -> [T] int64, or None
        """self(x).argmax(-1), the product never written, on the C kernel's panels (the same
        values, so the same first maximum); None in the other layouts."""
        if self.blocks is not None:
            return cpu_blocks.linear_argmax(x, self.blocks, self.kind, self.panel_bias)
        if self.panels is None:
            return None
        return cpu_linear.linear_argmax(x, self.panels, self.panel_bias, self.out_features)
