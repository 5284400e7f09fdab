"""What an FP8 checkpoint holds beyond a plain one, taken out of its state dict at load: the FP8
projections (as fp8_weights.py's records: the formats are described there) and the KV cache's
scales; and the quantization of bf16 weights at load (model.quantization: fp8).

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
from collections.abc import MutableMapping
from dataclasses import dataclass

import torch

from batchllm.model.errors import ModelError
from batchllm.model.fp8_weights import FP8, PROJECTION, Fp8Weight, quantize

_KV_SCALE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(?:attn\.)?"
                       r"(k_scale|v_scale|kv_scale|k_proj\.k_scale|v_proj\.v_scale|"
                       r"k_proj\.output_scale|v_proj\.output_scale)$")
# the names of tensors whose dtype the loader keeps as stored (weights.load_weights)
_SCALE_SUFFIXES = ("_scale", "_scale_inv", "input_scale_ub", "_zero_point")
METHODS = ("compressed-tensors", "fbgemm_fp8", "fp8")  # quantization_config.quant_method


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


def _is_fp8(state: MutableMapping, name: str) -> bool:
    """Whether `name` is stored in e4m3, asked of the file's header where the state can tell
    (a weights.Checkpoint: the tensor is then not read), else of the tensor."""
    if name in getattr(state, "files", {}) and hasattr(state, "stored_dtype"):
        return state.stored_dtype(name) == "F8_E4M3"
    value = state[name]
    return isinstance(value, torch.Tensor) and value.dtype == FP8


def take_kv_scales(state: MutableMapping, num_layers: int,
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


def quantization_config(config) -> dict | None:
    """The checkpoint's quantization_config as a dict; None where it has none."""
    q = getattr(config, "quantization_config", None)
    if q is None or isinstance(q, dict):
        return q
    return q.to_dict()


def fp8_checkpoint(config) -> bool:
    """Whether the checkpoint's projections are FP8 (a quantization_config of METHODS)."""
    return (quantization_config(config) or {}).get("quant_method") in METHODS


def _blocks(q: dict) -> tuple[int, int] | None:
    """The format's weight blocks [rows, columns] where it names them."""
    if q["quant_method"] == "fp8":
        return tuple(q.get("weight_block_size") or (128, 128))
    for group in (q.get("config_groups") or {}).values():
        weights = group.get("weights") or {}
        if weights.get("type", "float") != "float" or weights.get("num_bits", 8) != 8:
            raise ModelError("model.path: compressed-tensors weights of "
                             f"{weights.get('num_bits')}-bit {weights.get('type')} are not "
                             "supported (FP8: 8-bit float)")
        if weights.get("strategy") == "block":
            return tuple(weights["block_structure"])
    return None


def _record(name: str, q: torch.Tensor, state: MutableMapping, blocks: tuple[int, int] | None,
            scale_ub: float) -> Fp8Weight:
    """The record of FP8 weight `name` (its scale taken out of `state`)."""
    base = name.removesuffix("weight")
    scale = state.pop(base + "weight_scale", None)
    if scale is None:
        scale = state.pop(base + "weight_scale_inv", None)
    if scale is None:
        raise ModelError(f"model.path: FP8 weight {name!r} has no weight_scale")
    if state.pop(base + "weight_zero_point", None) is not None:
        raise ModelError(f"model.path: {name!r} is asymmetric (weight_zero_point); FP8 weights "
                         "must be symmetric")
    for extra in ("input_scale", "input_zero_point", "input_scale_ub"):
        state.pop(base + extra, None)  # static activation scales: not used (fp8_weights.py)
    n, k = q.shape
    scale = scale.float()
    if scale.numel() == 1:  # per tensor: the same scale for every row
        return Fp8Weight(q, scale.reshape(1, 1).expand(n, 1), 1, k, scale_ub)
    if tuple(scale.shape) in ((n, 1), (n,)):
        return Fp8Weight(q, scale.reshape(n, 1), 1, k, scale_ub)
    if blocks is not None and scale.dim() == 2:
        try:
            return Fp8Weight(q, scale, blocks[0], blocks[1], scale_ub)
        except ValueError:
            pass
    raise ModelError(f"model.path: the scale of FP8 weight {name!r} [{n}, {k}] has shape "
                     f"{list(scale.shape)}: not per tensor, per channel or in blocks of "
                     f"{blocks}")


def take_fp8_weights(config, state: MutableMapping, quantization: str | None, dtype: torch.dtype,
                     partial_rotary: bool = False) -> None:
    """In place: each FP8 projection of `state` (and its scale tensors) becomes an Fp8Weight
    under the weight's name; an FP8 weight no record serves is dequantized into `dtype`
    (fp8_weights.py says which); with quantization "fp8", every projection still in a float
    dtype is quantized per channel. partial_rotary: the attention's weights are permuted at
    load (model/rotary.py), so they stay dense."""
    q = quantization_config(config)
    if q is not None and q.get("quant_method") not in METHODS:
        raise ModelError(f"model.path: quantization_config.quant_method "
                         f"{q.get('quant_method')!r} is not supported (FP8 checkpoints: "
                         f"{', '.join(METHODS)})")
    blocks = _blocks(q) if q is not None else None
    scale_ub = float(q.get("activation_scale_ub") or 0.0) if q is not None else 0.0

    def served(name: str) -> bool:
        return bool(PROJECTION.match(name)) and not (partial_rotary and ".self_attn." in name)

    for name in [n for n in state if _is_fp8(state, n)]:
        record = _record(name, state[name], state, blocks, scale_ub)
        state[name] = record if served(name) else record.dequantize(dtype)
    if quantization == "fp8":
        for name in [n for n in state if served(n)]:
            weight = state[name]  # read once: a bf16 checkpoint's weight, one at a time
            if isinstance(weight, torch.Tensor):
                state[name] = quantize(weight)
    elif quantization is not None:
        raise ModelError(f"model.quantization: expected null or fp8, got {quantization!r}")
