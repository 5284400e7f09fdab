"""What each model family changes in the one decoder forward (decoder.py): a frozen description
read once from the transformers config. Llama is the base; every other family is a few fields
away from it, as vLLM's and SGLang's model files share their layers.

  family        differences from Llama
  mistral       a sliding window on every layer when the config sets one
  qwen2         q/k/v biases; sliding windows on the layers its config marks
  qwen3         per-head RMSNorm on q and k before the rotary embedding (head_dim may differ
                from hidden / heads)
  gemma2        embedding x sqrt(hidden); RMSNorms with (1 + w); norms after attention and
                around the MLP; GELU-tanh gated MLP; query_pre_attn_scalar; soft-capped
                attention and final logits; sliding-window layers alternating with global ones
  gemma3_text   Gemma 2 without the soft-capping, with Gemma 3's q/k norms and two rotary bases
                (one for the sliding layers, one for the global ones)
  phi3          fused qkv_proj and gate_up_proj; longrope ("su") scaling (rotary.py)
  mixtral       a sparse MoE MLP: softmax router, top-k renormalised
  qwen2_moe     MoE with the top-k renormalised only if norm_topk_prob, plus a shared expert
                gated by sigmoid(shared_expert_gate(x)); dense layers where the config says
  qwen3_moe     Qwen3's attention, Qwen's MoE without the shared expert
  olmoe         RMSNorm over all of q and all of k (not per head), q/k/v clipping, MoE
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

from transformers import PretrainedConfig

from batchllm.model.errors import ModelError

_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh",
                "gelu_tanh": "gelu_tanh"}


@dataclass(frozen=True)
class Experts:
    """A sparse mixture-of-experts MLP (experts.py runs it)."""

    num_experts: int
    top_k: int
    normalize: bool  # the top-k router probabilities renormalised to sum to 1
    intermediate_size: int  # of each expert
    shared_size: int  # Qwen2-MoE's shared expert's intermediate size; 0: none
    names: Literal["mixtral", "qwen"]  # block_sparse_moe.experts.E.w1/w3/w2 | mlp.experts.E.*
    sparse_layers: tuple[bool, ...]  # per layer: experts (else the dense MLP)


@dataclass(frozen=True)
class Family:
    """The differences from the Llama forward, per model family. Checkpoint names follow the
    family (layers.py reads them)."""

    name: str  # transformers' model_type
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    fused_qkv: bool = False  # Phi-3: self_attn.qkv_proj
    fused_gate_up: bool = False  # Phi-3: mlp.gate_up_proj
    norm_plus_one: bool = False  # Gemma: RMSNorm x (1 + w), folded into w at load
    sandwich_norms: bool = False  # Gemma: a norm after attention and after the MLP too
    qk_norm: Literal["", "head", "full"] = ""  # RMSNorm of q and k: per head | over all heads
    clip_qkv: float = 0.0  # OLMoE: q, k, v clamped to +-clip_qkv after the norms; 0: none
    activation: Literal["silu", "gelu_tanh"] = "silu"  # of the gated MLP
    embed_scale: bool = False  # Gemma: embeddings x sqrt(hidden), rounded to the model dtype
    attn_scale: float = 0.0  # the scores' scale: head_dim**-0.5 or query_pre_attn_scalar**-0.5
    attn_softcap: float = 0.0  # Gemma 2: scores s -> c * tanh(s / c); 0: none
    final_softcap: float = 0.0  # Gemma 2: logits likewise
    windows: tuple[int, ...] = ()  # per layer: sliding window W (keys p-W+1 .. p); 0: global
    rope_kinds: tuple[str, ...] = ()  # per layer: its rotary table ("" unless per layer type)
    experts: Experts | None = None

    def summary(self) -> str:
        """One line for `batchllm plan`: the family and what sets it apart."""
        parts = [self.name]
        sliding = [w for w in self.windows if w]
        if sliding:
            where = "" if len(sliding) == len(self.windows) else (
                f" on {len(sliding)} of {len(self.windows)} layers")
            parts.append(f"sliding window {max(sliding)}{where}")
        if self.attn_softcap or self.final_softcap:
            parts.append(f"soft-capping {self.attn_softcap:g}/{self.final_softcap:g}")
        if self.experts is not None:
            e = self.experts
            parts.append(f"{e.num_experts} experts, top {e.top_k}"
                         + (", a shared expert" if e.shared_size else ""))
        return ", ".join(parts)


def _base(c: PretrainedConfig, **changes) -> Family:
    """Llama's forward with this config's sizes, windows and rotary kinds."""
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    layers = c.num_hidden_layers
    types = getattr(c, "layer_types", None) or ["full_attention"] * layers
    window = getattr(c, "sliding_window", None) or 0
    has_types = getattr(c, "layer_types", None) is not None
    windows = tuple(window if not has_types or t == "sliding_attention" else 0 for t in types)
    per_type = isinstance(c.rope_parameters, dict) and set(types) <= set(c.rope_parameters)
    act = getattr(c, "hidden_activation", None) or getattr(c, "hidden_act", "silu")
    if act not in _ACTIVATIONS:
        raise ModelError(f"model.path: activation {act!r} of model type {c.model_type!r} is not "
                         f"supported; supported: {', '.join(sorted(_ACTIVATIONS))}")
    base = Family(name=c.model_type, activation=_ACTIVATIONS[act], attn_scale=head_dim**-0.5,
                  windows=windows, rope_kinds=tuple(types) if per_type else ("",) * layers)
    return replace(base, **changes)


def _gemma(c: PretrainedConfig, **changes) -> Family:
    if getattr(c, "use_bidirectional_attention", False):
        raise ModelError("model.path: a Gemma model with bidirectional attention (an embedding "
                         "model) cannot generate text")
    return _base(c, qkv_bias=c.attention_bias, o_bias=c.attention_bias, norm_plus_one=True,
                 sandwich_norms=True, embed_scale=True, attn_scale=c.query_pre_attn_scalar**-0.5,
                 attn_softcap=c.attn_logit_softcapping or 0.0,
                 final_softcap=c.final_logit_softcapping or 0.0, **changes)


def _qwen_experts(c: PretrainedConfig, shared_size: int) -> Experts:
    sparse = tuple(i not in c.mlp_only_layers and c.num_experts > 0
                   and (i + 1) % c.decoder_sparse_step == 0 for i in range(c.num_hidden_layers))
    return Experts(c.num_experts, c.num_experts_per_tok, c.norm_topk_prob,
                   c.moe_intermediate_size, shared_size, "qwen", sparse)


def _all_sparse(c: PretrainedConfig, num_experts: int, normalize: bool,
                names: Literal["mixtral", "qwen"]) -> Experts:
    return Experts(num_experts, c.num_experts_per_tok, normalize, c.intermediate_size, 0, names,
                   (True,) * c.num_hidden_layers)


def _attention_bias(c: PretrainedConfig) -> dict[str, bool]:
    return {"qkv_bias": c.attention_bias, "o_bias": c.attention_bias}


FAMILIES: dict[str, Callable[[PretrainedConfig], Family]] = {
    "llama": lambda c: _base(c, mlp_bias=c.mlp_bias, **_attention_bias(c)),
    "mistral": _base,
    "qwen2": lambda c: _base(c, qkv_bias=True),
    "qwen3": lambda c: _base(c, qk_norm="head", **_attention_bias(c)),
    "gemma2": _gemma,
    "gemma3_text": lambda c: _gemma(c, qk_norm="head"),
    "phi3": lambda c: _base(c, fused_qkv=True, fused_gate_up=True),
    "mixtral": lambda c: _base(c, experts=_all_sparse(c, c.num_local_experts, True, "mixtral")),
    "qwen2_moe": lambda c: _base(c, qkv_bias=c.qkv_bias,
                                 experts=_qwen_experts(c, c.shared_expert_intermediate_size)),
    "qwen3_moe": lambda c: _base(c, qk_norm="head", experts=_qwen_experts(c, 0),
                                 **_attention_bias(c)),
    "olmoe": lambda c: _base(c, qk_norm="full", clip_qkv=c.clip_qkv or 0.0,
                             experts=_all_sparse(c, c.num_experts, c.norm_topk_prob, "qwen"),
                             **_attention_bias(c)),
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


def describe(config: PretrainedConfig) -> Family:
    """The family of `config`; a ModelError (exit 2) naming the supported ones otherwise."""
    build = FAMILIES.get(config.model_type)
    if build is None:
        raise ModelError(f"model.path: model type {config.model_type!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    return build(config)
