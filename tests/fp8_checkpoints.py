"""FP8 checkpoints made here, in the real formats, from a plain Hugging Face folder; quantized by
a reference written from the formats' definitions (not by batchllm's code):

  compressed-tensors  llm-compressor's output: config.json's quantization_config (quant_method
                      compressed-tensors, format float-quantized, a config group of 8-bit float
                      weights with strategy tensor / channel / block and its block_structure,
                      dynamic per-token input activations, lm_head ignored); each Linear's
                      weight float8_e4m3fn and weight_scale ([1], [N, 1] or [ceil(N/bn),
                      ceil(K/bk)]) in the model's dtype, scale = max |w| over its block / 448,
                      weight = e4m3(w / scale)
  fbgemm_fp8          transformers' FbgemmFp8Config: quant_method fbgemm_fp8,
                      activation_scale_ub, modules_to_not_convert; weight_scale [N, 1] float32

Beside each, the same weights dequantized (e4m3 * scale, in float32, exact) as a plain folder:
what transformers runs as the reference (README, Correctness: the weight rounding shared).
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SCHEMES = {"tensor": None, "channel": None, "block": [128, 128], "block32": [32, 32]}


def _quantize(w: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (e4m3 weight [N, K], scale in the format's shape, float32)."""
    w32 = w.float()
    n, k = w.shape
    if scheme == "tensor":
        scale = (w32.abs().max() / 448.0).reshape(1)
        full = scale.expand(n, k)
    elif scheme == "channel":
        scale = w32.abs().amax(dim=1, keepdim=True) / 448.0  # [N, 1]
        full = scale.expand(n, k)
    else:
        bn, bk = SCHEMES[scheme]
        rows, cols = -(-n // bn), -(-k // bk)
        padded = torch.zeros(rows * bn, cols * bk)
        padded[:n, :k] = w32.abs()
        scale = padded.view(rows, bn, cols, bk).amax(dim=(1, 3)) / 448.0  # [R, G]
        full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    scale = scale.clamp(min=1e-12)
    full = full.clamp(min=1e-12)
    return (w32 / full).clamp(-448.0, 448.0).to(FP8), scale


def _dequantize(q: torch.Tensor, scale: torch.Tensor, scheme: str) -> torch.Tensor:
    n, k = q.shape
    if scheme in ("tensor", "channel"):
        return q.float() * scale.float()
    bn, bk = SCHEMES[scheme]
    full = scale.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return q.float() * full


def _quantization_config(scheme: str, kind: str) -> dict:
    if kind == "fbgemm_fp8":
        return {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                "modules_to_not_convert": ["lm_head"]}
    weights = {"num_bits": 8, "type": "float", "symmetric": True,
               "strategy": "block" if scheme.startswith("block") else scheme,
               "dynamic": False, "block_structure": SCHEMES[scheme], "group_size": None,
               "actorder": None, "observer": "minmax", "observer_kwargs": {}}
    inputs = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
              "dynamic": True, "block_structure": None, "group_size": None, "actorder": None,
              "observer": None, "observer_kwargs": {}}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "global_compression_ratio": None,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": inputs,
                                          "output_activations": None,
                                          "format": "float-quantized"}},
            "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {},
            "transform_config": {}}


@functools.cache
def fp8_checkpoint(source: Path, scheme: str = "channel",
                   kind: str = "compressed-tensors") -> tuple[Path, Path]:
    """(the FP8 folder, its dequantized twin) made from `source` (built once per process)."""
    if kind == "fbgemm_fp8" and scheme != "channel":
        raise ValueError("fbgemm_fp8 checkpoints are per channel")
    tag = f"{source.name}-fp8-{kind}-{scheme}"
    folder, plain = source.parent / tag, source.parent / f"{tag}-dequantized"
    for out in (folder, plain):
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(source, out, ignore=shutil.ignore_patterns("*.safetensors",
                                                                   "batchllm_*"))
    state, deq = {}, {}
    for file in sorted(source.glob("*.safetensors")):
        state.update(load_file(file))
    for name, w in list(state.items()):
        parts = name.split(".")
        if len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in PROJECTIONS \
                and ".experts." not in name:
            q, scale = _quantize(w, scheme)
            stored = scale if kind == "fbgemm_fp8" else scale.to(w.dtype)
            deq[name] = _dequantize(q, stored, scheme)  # float32: e4m3 * scale exactly
            state[name] = q
            state[name.removesuffix("weight") + "weight_scale"] = stored
        else:
            deq[name] = w
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    save_file(deq, plain / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = _quantization_config(scheme, kind)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder, plain
