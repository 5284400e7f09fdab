"""The Llama family's forward pass (Llama, SmolLM2, Mistral, Qwen2 with q/k/v bias) over paged KV.

One call runs every token of a step, whatever request it belongs to and whether it is a prompt
chunk or a decode: the tokens are flat ([T] ids and positions); attention finds each token's
sequence through the step's metadata. Logits are computed only for the rows that sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from batchllm.model.attention import PagedAttention
from batchllm.model.errors import ModelError
from batchllm.model.linear import Linear
from batchllm.model.ops import ModelOps, Projection, pick_ops

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class ModelShape:
    """What the engine needs to know about a model: sizes, for the KV cache and the limits."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position: int

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """2 (K and V) * L layers * H KV heads * A head size * bytes of the dtype."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


def model_shape(config: PretrainedConfig) -> ModelShape:
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelError(
            f"model.path: model type {config.model_type!r} is not supported; supported: "
            + ", ".join(SUPPORTED_MODEL_TYPES)
        )
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return ModelShape(
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads or config.num_attention_heads,
        head_dim=head_dim,
        vocab_size=config.vocab_size,
        max_position=config.max_position_embeddings,
    )


def _rope_tables(config: PretrainedConfig, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin per position, [max_position, head_dim] fp32, from transformers' own rotary
    module, so every rope_type (default, llama3, yarn, ...) is computed as the reference does."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(config=config)
    inv_freq = rotary.inv_freq.float()  # [head_dim/2]
    positions = torch.arange(max_position, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]  # [P, head_dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * rotary.attention_scaling, emb.sin() * rotary.attention_scaling


_CPU_MLP_BYTES = 24 << 20  # under glibc's 32 MiB mmap threshold (see engine/cpu_allocator.py)


def _mlp_rows(x: torch.Tensor, gate_up_width: int) -> int:
    """Rows per MLP block. On the CPU, a long prefill step's [T, 2I] intermediate would be a
    fresh mapping page-faulted in at every layer (measured: 4x the page faults of the whole run);
    blocks of at most 24 MiB reuse heap memory and keep the products large (2,048 rows for
    SmolLM2-135M). Elsewhere one block."""
    if x.device.type != "cpu":
        return max(1, x.shape[0])
    return max(128, _CPU_MLP_BYTES // (gate_up_width * x.element_size()))


class _Layer:
    def __init__(self, state: dict[str, torch.Tensor], prefix: str, layout: Projection) -> None:
        att = prefix + "self_attn."
        bias = [state.get(att + n + "_proj.bias") for n in "qkv"]
        self.qkv = Linear(  # [(Hq+2Hkv)*D, H]
            torch.cat([state[att + n + "_proj.weight"] for n in "qkv"]),
            torch.cat(bias) if all(b is not None for b in bias) else None, layout)
        self.o = Linear(state[att + "o_proj.weight"], None, layout)  # [H, Hq*D]
        mlp = prefix + "mlp."
        self.gate_up = Linear(  # [2I, H]
            torch.cat([state[mlp + "gate_proj.weight"], state[mlp + "up_proj.weight"]]), None,
            layout)
        self.down = Linear(state[mlp + "down_proj.weight"], None, layout)  # [H, I]
        self.norm_in = state[prefix + "input_layernorm.weight"]
        self.norm_post = state[prefix + "post_attention_layernorm.weight"]


class LlamaModel:
    """Weights and forward pass: `forward`, or its two halves `hidden` then `logits` (the CUDA
    path captures `hidden` of decode steps in graphs, and computes the logits outside)."""

    def __init__(
        self,
        config: PretrainedConfig,
        state: dict[str, torch.Tensor],
        max_position: int,
    ) -> None:
        s = self.shape = model_shape(config)
        self.eps = config.rms_norm_eps
        self.embed = state["model.embed_tokens.weight"]  # [V, H]
        self.dtype = self.embed.dtype
        # Every op of the forward, picked once; PagedAttention(..., ops=model.ops) shares it.
        self.ops: ModelOps = pick_ops(self.embed.device, self.dtype, s.num_heads, s.head_dim)
        layout = self.ops.projection
        self.lm_head = Linear(state.get("lm_head.weight", self.embed), None, layout)  # [V, H]
        self.norm = state["model.norm.weight"]
        self.layers = [_Layer(state, f"model.layers.{i}.", layout) for i in range(s.num_layers)]
        cos, sin = _rope_tables(config, max_position)
        self.cos = cos.to(self.embed.device)  # [P, D]
        self.sin = sin.to(self.embed.device)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        attention: PagedAttention,  # the cache and this step's metadata
        sample_rows: torch.Tensor,  # [S] int64, rows of the step whose logits are wanted
    ) -> torch.Tensor:  # [S, V] fp32
        return self.logits(self.hidden(input_ids, positions, attention, sample_rows))

    @torch.inference_mode()
    def logits(self, h: torch.Tensor) -> torch.Tensor:  # [S, H] -> [S, V] fp32
        return self.lm_head(h).float()

    @torch.inference_mode()
    def hidden(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        attention: PagedAttention,
        sample_rows: torch.Tensor,  # [S] int64
    ) -> torch.Tensor:  # [S, H]: the final norm of the rows that sample (what a graph captures)
        s = self.shape
        t = input_ids.shape[0]
        hq, d = s.num_heads, s.head_dim
        ops, eps = self.ops.pointwise, self.eps
        h = self.embed[input_ids]  # [T, H], the residual stream
        for i, layer in enumerate(self.layers):
            x = ops.add_rms_norm(h, None, layer.norm_in, eps)
            qkv = layer.qkv(x)  # [T, (Hq+2Hkv)*D]
            # q and k heads rotated in place; k and v into the cache
            attention.rope_store(i, qkv, positions, self.cos, self.sin, hq)
            q = qkv[:, : hq * d].view(t, hq, d)
            o = attention.attend(i, q)  # [T, Hq, D]
            x = ops.add_rms_norm(h, layer.o(o.reshape(t, hq * d)), layer.norm_post, eps)
            block = _mlp_rows(x, layer.gate_up.out_features)
            for lo in range(0, t, block):  # blocks of rows: bounded intermediate buffers
                rows = slice(lo, lo + block)
                # [t, 2I] -> [t, I]; add_ on the view (`h[rows] +=` copies the rows back after)
                h[rows].add_(layer.down(ops.silu_mul(layer.gate_up(x[rows]))))
        return ops.add_rms_norm(h[sample_rows], None, self.norm, eps)  # [S, H]
