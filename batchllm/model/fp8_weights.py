"""FP8 weights: the record a projection's FP8 weight is kept in, how bf16 weights are quantized
at load (model.quantization: fp8), and how FP8 checkpoints' tensors become records.

A record holds e4m3 values [N, K] and float32 scales [R, G], W = e4m3 * scale with scale row r
covering weight rows r*row_block ..., scale group g the columns g*col_block ... (per tensor and
per channel: row_block 1, one group; 128x128 blocks: 128 and 128). Checkpoints, as
transformers and llm-compressor write them (the `quantization_config` in config.json):
  compressed-tensors  format float-quantized (naive-quantized): weight float8_e4m3fn with
                      weight_scale [1] (strategy tensor), [N, 1] (channel) or
                      [ceil(N/bn), ceil(K/bk)] (block, block_structure [bn, bk]); the scale in
                      the weights' dtype (bfloat16 for a bfloat16 model) or float32
  fbgemm_fp8          weight float8_e4m3fn, weight_scale [N, 1] float32; activations per
                      token, their max capped at activation_scale_ub
  fp8                 transformers' fine-grained FP8: weight_scale_inv [ceil(N/bn), ceil(K/bk)],
                      weight_block_size [bn, bk] (W = e4m3 * weight_scale_inv, despite the name)
Activation scales in the file (input_scale: static per-tensor schemes) are not used: the
W8A8 kernel quantizes every token by its own max (fp8_linear.py). Embeddings and the lm_head
stay as they are (llm-compressor's default ignores the lm_head); so do the experts of a MoE
layer and, in models whose heads rotate in part, the attention's projections: an FP8 weight
there is dequantized at load into the model's dtype.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0
# the projections an FP8 record serves (a layer's attention and dense MLP, a shared expert)
PROJECTION = re.compile(r"^model\.layers\.\d+\.(self_attn\.(q|k|v|o|qkv)_proj|"
                        r"mlp\.(shared_expert\.)?(gate|up|down|gate_up)_proj)\.weight$")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Fp8Weight:
    """A projection's FP8 weight (module docstring)."""

    weight: torch.Tensor  # [N, K] float8_e4m3fn
    scale: torch.Tensor  # [R, G] float32, R = ceil(N / row_block), G = ceil(K / col_block)
    row_block: int
    col_block: int
    scale_ub: float = 0.0  # fbgemm_fp8: the activations' max is capped there (0: not)

    def __post_init__(self) -> None:
        n, k = self.weight.shape
        want = (cdiv(n, self.row_block), cdiv(k, self.col_block))
        if self.weight.dtype != FP8 or tuple(self.scale.shape) != want:
            raise ValueError(f"an FP8 weight [{n}, {k}] in blocks of {self.row_block}x"
                             f"{self.col_block} needs float8_e4m3fn values and {list(want)} "
                             f"scales, got {self.weight.dtype} and {list(self.scale.shape)}")
        self.scale = self.scale.float().contiguous()

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scale.nbytes

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """[N, K] e4m3 * scale in `dtype` (the product in float32, rounded once)."""
        n, k = self.shape
        s = self.scale.repeat_interleave(self.row_block, 0)[:n]
        s = s.repeat_interleave(self.col_block, 1)[:, :k]
        return (self.weight.float() * s).to(dtype)

    def per_row(self) -> Fp8Weight:
        """The same weight with one scale row per weight row (row_block 1)."""
        if self.row_block == 1:
            return self
        scale = self.scale.repeat_interleave(self.row_block, 0)[: self.shape[0]]
        return Fp8Weight(self.weight, scale, 1, self.col_block, self.scale_ub)

    def split(self, sizes: list[int]) -> list[Fp8Weight]:
        """Row blocks of `sizes` rows (a fused qkv or gate_up weight's parts)."""
        w = self if all(s % self.row_block == 0 for s in sizes[:-1]) else self.per_row()
        rows = [s // w.row_block if s % w.row_block == 0 else cdiv(s, w.row_block)
                for s in sizes]
        return [Fp8Weight(q, s, w.row_block, w.col_block, w.scale_ub)
                for q, s in zip(w.weight.split(sizes), w.scale.split(rows))]

    @staticmethod
    def cat(parts: list[Fp8Weight]) -> Fp8Weight:
        """Row blocks joined (q, k, v; gate, up) into one weight."""
        if len(parts) == 1:
            return parts[0]
        if len({(p.col_block, p.shape[1], p.scale_ub) for p in parts}) != 1:
            raise ValueError("FP8 weights joined must share their columns, column blocks and "
                             "activation cap")
        rb = parts[0].row_block
        if any(p.row_block != rb or p.shape[0] % rb for p in parts[:-1]) or \
                parts[-1].row_block != rb:
            parts = [p.per_row() for p in parts]
            rb = 1
        return Fp8Weight(torch.cat([p.weight for p in parts]),
                         torch.cat([p.scale for p in parts]), rb, parts[0].col_block,
                         parts[0].scale_ub)


def holds_fp8(weight: object) -> bool:
    """Whether a projection's weight (a tensor, a record, or a list of its row blocks) is FP8."""
    first = weight[0] if isinstance(weight, list) and weight else weight
    return isinstance(first, Fp8Weight)


def quantize(w: torch.Tensor) -> Fp8Weight:
    """A weight [N, K] quantized per output channel: scale = max |row| / 448, e4m3(w / scale)
    (model.quantization: fp8, as llm-compressor's FP8_DYNAMIC scheme quantizes)."""
    w32 = w.float()
    scale = (w32.abs().amax(dim=1, keepdim=True) / E4M3_MAX).clamp_(min=1e-12)  # [N, 1]
    q = (w32 / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8)
    return Fp8Weight(q, scale, 1, w.shape[1])


def weight_bytes(state: dict[str, torch.Tensor | Fp8Weight]) -> int:
    """The bytes a state dict's weights take (an FP8 record: its values and scales)."""
    return sum(t.nbytes for t in state.values())
