"""The forward pass over paged KV, one for every family (families.py describes what varies).

One call runs every token of a step, whatever request it belongs to and whether it is a prompt
chunk or a decode: the tokens are flat ([T] ids and positions); attention finds each token's
sequence through the step's metadata. Logits are computed only for the rows that sample.

A layer is Llama's:
    x = norm_in(h);  h += attention(x);  x = norm_mlp(h);  h += mlp(x)
with, where the family says so: the attention and MLP outputs normed before they join the
residual (Gemma's sandwich norms), q/k norms inside the attention, a MoE MLP, and the
embedding scaled / the logits soft-capped at the ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from batchllm.model.attention import PagedAttention
from batchllm.model.checkpoint import Tensors
from batchllm.model.cpu_layers import CpuLayers
from batchllm.model.experts import SparseMoe
from batchllm.model.families import Family, describe
from batchllm.model.layers import Attention, Mlp, take_norm
from batchllm.model.linear import Linear
from batchllm.model.ops import ModelOps, kernel_path, pick_ops
from batchllm.model.rotary import head_dim_of, head_permutation, rope_tables

if TYPE_CHECKING:
    from transformers import PretrainedConfig


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
    """The sizes of a supported model (describe() raises ModelError for the others)."""
    describe(config)
    return ModelShape(
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads or config.num_attention_heads,
        head_dim=head_dim_of(config),
        vocab_size=config.vocab_size,
        max_position=config.max_position_embeddings,
    )


_CPU_MLP_BYTES = 24 << 20  # under glibc's 32 MiB mmap threshold (see engine/cpu_allocator.py)


def _mlp_rows(x: torch.Tensor, width: int) -> int:
    """Rows per MLP block. On the CPU, a long prefill step's [T, 2I] intermediate would be a
    fresh mapping page-faulted in at every layer (measured: 4x the page faults of the whole run);
    blocks of at most 24 MiB reuse heap memory and keep the products large (2,048 rows for
    SmolLM2-135M). Elsewhere one block."""
    if x.device.type != "cpu":
        return max(1, x.shape[0])
    return max(128, _CPU_MLP_BYTES // (width * x.element_size()))


class _Layer:
    def __init__(self, t: Tensors, i: int, f: Family, s: ModelShape, ops: ModelOps,
                 perm: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor]) -> None:
        p = f"model.layers.{i}."
        layout = ops.projection
        self.attn = Attention(t, p, f, i, (s.num_heads, s.num_kv_heads, s.head_dim), layout,
                              perm, rope)
        self.norm_in = take_norm(t, p + "input_layernorm.weight", f)
        # Gemma's post_attention_layernorm norms the attention's output; Llama's is the MLP's
        # input norm, which Gemma calls pre_feedforward_layernorm.
        self.norm_attn_out = self.norm_mlp_out = None
        if f.sandwich_norms:
            self.norm_attn_out = take_norm(t, p + "post_attention_layernorm.weight", f)
            self.norm_mlp = take_norm(t, p + "pre_feedforward_layernorm.weight", f)
            self.norm_mlp_out = take_norm(t, p + "post_feedforward_layernorm.weight", f)
        else:
            self.norm_mlp = take_norm(t, p + "post_attention_layernorm.weight", f)
        if f.experts is not None and f.experts.sparse_layers[i]:
            self.mlp = SparseMoe(t, p, f.experts, layout, ops.grouped_matmul,
                                 lambda t_, prefix: Mlp(t_, prefix, f, layout))
        else:
            self.mlp = Mlp(t, p + "mlp.", f, layout)


class DecoderModel:
    """Weights and forward pass: `forward`, or its two halves `hidden` then `logits` (the CUDA
    path captures `hidden` of decode steps in graphs, and computes the logits outside), or
    `hidden` then `greedy` for steps whose rows all take the argmax."""

    def __init__(
        self,
        config: PretrainedConfig,
        state: dict[str, torch.Tensor],
        max_position: int,
        folder: Path | None = None,  # where `state` came from, for the error messages
    ) -> None:
        self.family = f = describe(config)
        s = self.shape = model_shape(config)
        t = Tensors(state, f.name, folder)
        self.eps = config.rms_norm_eps
        self.embed = t.take("model.embed_tokens.weight")  # [V, H]
        self.dtype = self.embed.dtype
        device = self.embed.device
        # Every op of the forward, picked once; PagedAttention(..., ops=model.ops) shares it.
        self.ops: ModelOps = pick_ops(device, self.dtype, s.num_heads, s.head_dim)
        head = t.take("lm_head.weight") if "lm_head.weight" in t else self.embed
        self.lm_head = Linear(head, None, self.ops.projection)  # [V, H]
        self.norm = take_norm(t, "model.norm.weight", f)
        # Gemma: sqrt(hidden) rounded to the model dtype first, as transformers does.
        self.embed_scale = (torch.tensor(s.hidden_size**0.5, dtype=self.dtype).to(device)
                            if f.embed_scale else None)
        tables = rope_tables(config, max_position, device)  # per layer kind, [P, D] each
        perm = head_permutation(config)
        self.layers = [_Layer(t, i, f, s, self.ops, perm, tables[f.rope_kinds[i]])
                       for i in range(s.num_layers)]
        t.check_all_taken()
        pw = self.ops.pointwise
        self.act_mul = pw.silu_mul if f.activation == "silu" else pw.gelu_tanh_mul
        # Plain layers on the CPU's C kernels: all of a step's in one C call, the same values
        # (cpu_layers.py); None: the loop in hidden()
        self.cpu_layers = CpuLayers.of(self)
        self.kernel_path = kernel_path(device.type, str(self.dtype).removeprefix("torch."))

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
    def hidden(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        attention: PagedAttention,
        sample_rows: torch.Tensor,  # [S] int64
    ) -> torch.Tensor:  # [S, H]: the final norm of the rows that sample (what a graph captures)
        t = input_ids.shape[0]
        norm, eps = self.ops.pointwise.add_rms_norm, self.eps
        h = self.embed_tokens(input_ids)  # [T, H], the residual stream
        if self.embed_scale is not None:
            h = h * self.embed_scale
        if self.cpu_layers is not None and attention.ops is self.ops:  # not an FP8 cache's ops
            self.cpu_layers.forward(h, positions, attention, _mlp_rows(h, self.layers[0].mlp.width))
            return norm(h[sample_rows], None, self.norm, eps)  # [S, H]
        for i, layer in enumerate(self.layers):
            x = norm(h, None, layer.norm_in, eps)
            a = layer.attn(x, positions, attention, i, self.ops, eps)  # [T, H]
            if layer.norm_attn_out is not None:
                a = norm(a, None, layer.norm_attn_out, eps)
            x = norm(h, a, layer.norm_mlp, eps)  # h += a
            block = _mlp_rows(x, layer.mlp.width)
            for lo in range(0, t, block):  # blocks of rows: bounded intermediate buffers
                rows = slice(lo, lo + block)
                m = layer.mlp(x[rows], self.act_mul)  # [t, H]
                if layer.norm_mlp_out is not None:
                    m = norm(m, None, layer.norm_mlp_out, eps)
                h[rows].add_(m)  # on the view: `h[rows] +=` copies the rows back after
        return norm(h[sample_rows], None, self.norm, eps)  # [S, H]

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        return self.embed[input_ids]

    @torch.inference_mode()
    def logits(self, h: torch.Tensor) -> torch.Tensor:  # [S, H] -> [S, V] fp32
        logits = self.lm_head(h)  # [S, V]
        cap = self.family.final_softcap
        if cap:  # Gemma 2, in the model dtype as transformers does
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    @torch.inference_mode()
    def greedy(self, h: torch.Tensor) -> torch.Tensor | None:  # [S, H] -> [S] int64, or None
        """logits(h).argmax(-1) without the [S, V] logits written, where the lm_head's kernel
        can reduce its product (the CPU panels; not under a final soft cap, whose rounding could
        make ties that the raw logits do not have); None where it cannot: take logits()."""
        if self.family.final_softcap:
            return None
        return self.lm_head.argmax(h)
