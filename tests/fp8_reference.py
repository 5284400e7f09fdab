"""Test helpers for the FP8 formats: transformers running what batchllm runs, quantized the same
way, written here from the formats' definitions (not from batchllm's code).

- The FP8 KV cache: transformers' own attention (sdpa) over keys and values rounded to e4m3
  with the cache's scales, e4m3(x / s) * s per layer and KV head, as an attention function
  registered with transformers (AttentionInterface). Only the order of the sums differs from
  batchllm's, so DESIGN.md's float32 rule holds against it.
- FP8 weights on the W8A8 path: transformers on the dequantized weights (tests/fp8_checkpoints.py)
  with each quantized projection's input rounded per token to e4m3 * max|x_t| / 448, as the
  W8A8 kernel quantizes it (a forward pre-hook on each such nn.Linear).
- Greedy references (tokens and the logits at each of them) and the comparison of the rule for
  quantized formats: at a row's first differing token, the reference's logit of our token
  within `margin` of its top logit (README, Correctness).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from hf_reference import first_divergence
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

FP8 = torch.float8_e4m3fn
_SCALES: dict[str, tuple[torch.Tensor, torch.Tensor] | None] = {}  # implementation -> k, v


def e4m3_round(x: torch.Tensor, scale: torch.Tensor, heads_dim: int) -> torch.Tensor:
    """x rounded to e4m3 with one scale per head (dimension `heads_dim`): the value an FP8
    cache reads back, e4m3(x / s) * s (nearest, ties to even; saturated at +-448)."""
    shape = [1] * x.dim()
    shape[heads_dim] = -1
    s = scale.float().view(shape)
    return ((x.float() / s).clamp(-448.0, 448.0).to(FP8).float() * s).to(x.dtype)


def _fp8_kv_attention(module, query, key, value, attention_mask, **kwargs):
    """sdpa over e4m3-rounded keys and values ([B, Hkv, T, D]) with this layer's scales (1.0
    where none are given), re-rounded at every step: the raw values stay in transformers' cache
    and rounding is idempotent, so each step reads what an FP8 cache holds."""
    scales = _SCALES[module.config._attn_implementation]
    hkv = key.shape[1]
    k_s = v_s = torch.ones(hkv)
    if scales is not None:
        k_s, v_s = scales[0][module.layer_idx], scales[1][module.layer_idx]
    return sdpa_attention_forward(module, query, e4m3_round(key, k_s, 1),
                                  e4m3_round(value, v_s, 1), attention_mask, **kwargs)


@functools.cache
def hf_fp8_kv_model(folder: Path, scales: tuple[tuple[float, ...], tuple[float, ...]] | None = None,
                    dtype: torch.dtype = torch.float32):
    """The transformers model of `folder` whose attention reads an FP8 KV cache; scales: (k, v)
    nested tuples [layers][KV heads], or None for 1.0 everywhere."""
    name = f"batchllm_fp8_kv_{len(_SCALES)}"
    _SCALES[name] = None if scales is None else (torch.tensor(scales[0]), torch.tensor(scales[1]))
    AttentionInterface.register(name, _fp8_kv_attention)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype,
                                                attn_implementation=name).eval()


@torch.no_grad()
def greedy_logits(model, prompts: list[list[int]], max_new_tokens: int,
                  eos: list[int]) -> list[tuple[list[int], torch.Tensor]]:
    """transformers `generate`, greedy, one prompt at a time -> (tokens, logits [N, V] fp32)."""
    results = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=0,
                             return_dict_in_generate=True, output_logits=True)
        tokens = out.sequences[0, ids.shape[1]:].tolist()
        results.append((tokens, torch.cat(out.logits).float()[: len(tokens)]))
    return results


def deficit(ours: list[int], ref_tokens: list[int], ref_logits: torch.Tensor) -> float | None:
    """At the first differing token: the reference's top logit minus its logit of ours (None
    when the tokens agree over their common length)."""
    pos = first_divergence([int(t) for t in ours], ref_tokens)
    if pos is None:
        return None
    row = ref_logits[pos]
    return float(row.max() - row[int(ours[pos])])


def assert_within_margin(ours: list[int], ref_tokens: list[int], ref_logits: torch.Tensor,
                         margin: float, row: int | str | None = None) -> bool:
    """The rule for quantized formats: equal tokens, or at the first difference the
    reference's logit of our token within `margin` of its top (the rest of the row is then not
    compared); lengths agree unless the rows diverged. True when they diverged."""
    where = f"row {row}: " if row is not None else ""
    d = deficit(ours, ref_tokens, ref_logits)
    if d is None:
        assert len(ours) == len(ref_tokens), (
            f"{where}same tokens, but ours has {len(ours)} and the reference {len(ref_tokens)}")
        return False
    pos = first_divergence([int(t) for t in ours], ref_tokens)
    assert d <= margin, (f"{where}tokens differ at position {pos}: ours {ours[pos]}, reference "
                         f"{ref_tokens[pos]}; the reference's logit of ours is {d:.4f} below its "
                         f"top, more than the margin {margin}")
    return True


_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _per_token_e4m3(module, args):
    (x,) = args
    scale = (x.float().abs().amax(dim=-1, keepdim=True) / 448.0).clamp(min=1e-12)
    return ((x.float() / scale).clamp(-448.0, 448.0).to(FP8).float() * scale).to(x.dtype),


@functools.cache
def hf_w8a8_model(dequantized: Path, dtype: torch.dtype = torch.float32):
    """transformers on a dequantized FP8 checkpoint, the projections' inputs rounded per token
    to e4m3 (module docstring)."""
    model = AutoModelForCausalLM.from_pretrained(dequantized, dtype=dtype).eval()
    for name, module in model.named_modules():
        if name.split(".")[-1] in _PROJECTIONS and ".experts." not in name:
            module.register_forward_pre_hook(_per_token_e4m3)
    return model
