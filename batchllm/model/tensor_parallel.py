"""One rank's shard of a dense model (engine.tensor_parallel: N), Megatron's split:

  column-parallel   q/k/v (by heads) and gate/up (by the intermediate size): no communication;
  row-parallel      o and down (by their input columns): one all-reduce each, the bias on rank 0;
  KV heads          split with the query heads; replicated where there are fewer than ranks
                    (rank r takes KV head r * Hkv // N, the one its query heads read);
  vocabulary        the embedding's and lm_head's rows split: a token's row comes from the rank
                    that holds it (the others add zeros, one all-reduce), the logits all-gathered
                    so that the sampler sees the whole vocabulary.

A rank reads only its slices (Checkpoint.read with a part). The shard is a DecoderModel of the
local sizes (heads, intermediate size), so the attention, the KV pool and the layers are the
plain ones; the C kernels' one-call layer loop (cpu_layers.py) is not used: the all-reduces sit
between its layers' halves.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.distributed as dist

from batchllm.model.decoder import DecoderModel
from batchllm.model.errors import ModelError
from batchllm.model.families import describe
from batchllm.model.rotary import head_dim_of


def _check(config, n: int) -> None:
    f = describe(config)
    hq = config.num_attention_heads
    hkv = config.num_key_value_heads or hq
    why = None
    if f.experts is not None:
        why = "mixture-of-experts models are not split yet"
    elif f.fused_qkv or f.fused_gate_up:
        why = "fused qkv_proj / gate_up_proj checkpoints are not split yet"
    elif f.qk_norm == "full":
        why = "a q/k norm over all heads is not split yet"
    elif hq % n or config.intermediate_size % n or config.vocab_size % n:
        why = (f"{hq} heads, intermediate size {config.intermediate_size} and vocabulary "
               f"{config.vocab_size} must each divide by {n}")
    elif hkv % n and n % hkv:
        why = f"{hkv} KV heads and {n} ranks: one must divide the other"
    if why:
        raise ModelError(f"engine.tensor_parallel: {n}: {config.model_type}: {why}")


def local_kv_heads(config, n: int) -> int:
    hkv = config.num_key_value_heads or config.num_attention_heads
    return max(1, hkv // n)


def shard_config(config, n: int):
    """The config of one rank's shard: its heads and intermediate size, the head size fixed."""
    _check(config, n)
    local = copy.deepcopy(config)
    local.head_dim = head_dim_of(config)
    local.num_attention_heads = config.num_attention_heads // n
    local.num_key_value_heads = local_kv_heads(config, n)
    local.intermediate_size = config.intermediate_size // n
    return local


def shard_checkpoint(state, config, rank: int, n: int) -> None:
    """Replace the split tensors of `state` (a weights.Checkpoint) by rank's slices, read alone."""
    f = describe(config)
    hkv = config.num_key_value_heads or config.num_attention_heads
    kv_part = (0, rank, n) if hkv >= n else (0, rank * hkv // n, hkv)
    for i in range(config.num_hidden_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        parts = {a + "q_proj.weight": (0, rank, n), a + "k_proj.weight": kv_part,
                 a + "v_proj.weight": kv_part, a + "o_proj.weight": (1, rank, n),
                 m + "gate_proj.weight": (0, rank, n), m + "up_proj.weight": (0, rank, n),
                 m + "down_proj.weight": (1, rank, n)}
        if f.qkv_bias:
            parts.update({a + "q_proj.bias": (0, rank, n), a + "k_proj.bias": kv_part,
                          a + "v_proj.bias": kv_part})
        if f.mlp_bias:
            parts.update({m + "gate_proj.bias": (0, rank, n), m + "up_proj.bias": (0, rank, n)})
        for name, part in parts.items():
            state[name] = state.read(name, part)
        for name in (a + "o_proj.bias", m + "down_proj.bias"):  # added once, on rank 0
            if name in state and rank:
                state[name] = torch.zeros_like(state.read(name))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in state:
            state[name] = state.read(name, (0, rank, n))


class _Reduced:
    """A row-parallel projection: the rank's partial product, summed over the ranks."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.out_features, self.in_features = inner.out_features, inner.in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        dist.all_reduce(y)
        return y


class ShardedDecoder(DecoderModel):
    """One rank's DecoderModel: local heads and MLP width, a slice of the vocabulary."""

    def __init__(self, config, state, max_position: int, folder: Path | None,
                 rank: int, n: int) -> None:
        self.full_vocab = config.vocab_size
        self.rank, self.ranks = rank, n
        super().__init__(shard_config(config, n), state, max_position, folder)
        self.vocab_lo = rank * (self.full_vocab // n)
        self.vocab_hi = self.vocab_lo + self.full_vocab // n
        for layer in self.layers:
            layer.attn.o = _Reduced(layer.attn.o)
            layer.mlp.down = _Reduced(layer.mlp.down)
        self.cpu_layers = None  # the all-reduces sit between each layer's halves

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        mine = (input_ids >= self.vocab_lo) & (input_ids < self.vocab_hi)
        local = torch.where(mine, input_ids - self.vocab_lo, torch.zeros_like(input_ids))
        h = self.embed[local] * mine.unsqueeze(1).to(self.embed.dtype)
        dist.all_reduce(h)
        return h

    @torch.inference_mode()
    def logits(self, h: torch.Tensor) -> torch.Tensor:  # [S, H] -> [S, V] fp32, all ranks
        part = super().logits(h).contiguous()  # [S, V/N], soft-capped per element
        parts = [torch.empty_like(part) for _ in range(self.ranks)]
        dist.all_gather(parts, part)
        return torch.cat(parts, dim=1)

    @torch.inference_mode()
    def greedy(self, h: torch.Tensor) -> torch.Tensor | None:
        return None  # the argmax over the gathered logits


def load_shard(config, state, max_position: int, folder: Path, rank: int,
               n: int) -> ShardedDecoder:
    """Rank's shard of the model whose (config, Checkpoint) these are: only its slices read."""
    _check(config, n)
    shard_checkpoint(state, config, rank, n)
    return ShardedDecoder(config, state, max_position, folder, rank, n)
