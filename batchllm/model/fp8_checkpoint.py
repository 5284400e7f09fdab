"""What an FP8 checkpoint holds beyond a plain one, taken out of its state dict at load: the KV
cache's scales (and, fp8_weights.py, the FP8 projections).

KV scales, as vLLM reads them (model_loader.weight_utils.maybe_remap_kv_scale_name and the
compressed-tensors config's cache scales), per layer i under model.layers.{i}.self_attn.:
  k_scale, v_scale                  llm-compressor's kv_cache_scheme (compressed-tensors), and
                                    attn.k_scale / attn.v_scale as vLLM names them
  k_proj.k_scale, v_proj.v_scale    NVIDIA ModelOpt
  k_proj.output_scale, ...          older compressed-tensors checkpoints
  kv_scale                          the deprecated single scale, for both
each a scalar (strategy "tensor": one per layer) or one per KV head (strategy "attn_head":
[Hkv] or [Hkv, 1, 1]). A layer the checkpoint gives none keeps 1.0, as vLLM does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from batchllm.model.errors import ModelError

_KV_SCALE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(?:attn\.)?"
                       r"(k_scale|v_scale|kv_scale|k_proj\.k_scale|v_proj\.v_scale|"
                       r"k_proj\.output_scale|v_proj\.output_scale)$")
# the names of tensors whose dtype the loader keeps as stored (weights.load_weights)
_SCALE_SUFFIXES = ("_scale", "_scale_inv", "input_scale_ub")


@dataclass
class KvScales:
    """An FP8 KV cache's scales: cache value = e4m3(x / scale), read back as value * scale."""

    k: torch.Tensor  # [num_layers, Hkv] float32
    v: torch.Tensor  # [num_layers, Hkv] float32


def keeps_dtype(name: str, tensor: torch.Tensor) -> bool:
    """Whether the loader must keep `tensor` in its stored dtype rather than cast it to the
    model's: FP8 weights, and the scales of FP8 weights and of the KV cache (rounding a float32
    scale to bfloat16 would change every value it scales)."""
    return tensor.element_size() == 1 or name.endswith(_SCALE_SUFFIXES)


def take_kv_scales(state: dict[str, torch.Tensor], num_layers: int,
                   num_kv_heads: int) -> KvScales | None:
    """The checkpoint's KV scales, removed from `state` (None where it has none)."""
    found = {}
    for name in [n for n in state if _KV_SCALE.match(n)]:
        layer, kind = _KV_SCALE.match(name).groups()
        value = state.pop(name).detach().float().cpu().flatten()
        if int(layer) >= num_layers or value.numel() not in (1, num_kv_heads):
            raise ModelError(f"model.path: KV cache scale {name!r} has {value.numel()} values "
                             f"for layer {layer}; expected 1 or one per KV head "
                             f"({num_kv_heads}) in a model of {num_layers} layers")
        if not bool(torch.isfinite(value).all()) or bool((value <= 0).any()):
            raise ModelError(f"model.path: KV cache scale {name!r} must be finite and > 0, "
                             f"got {value.tolist()}")
        kinds = ("k", "v") if kind == "kv_scale" else (kind[0],)  # k_... or v_...
        for k in kinds:
            found[int(layer), k] = value.expand(num_kv_heads)
    if not found:
        return None
    scales = {k: torch.ones(num_layers, num_kv_heads) for k in "kv"}
    for (layer, k), value in found.items():
        scales[k][layer] = value
    return KvScales(scales["k"], scales["v"])
