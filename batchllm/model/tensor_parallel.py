"""One rank's shard of a dense model (engine.tensor_parallel: N), Megatron's split:

  column-parallel   q/k/v (by heads) and gate/up (by the intermediate size): no communication;
  row-parallel      o and down (by their input columns): one all-reduce each, the bias on rank 0;
  KV heads          split with the query heads; replicated where there are fewer than ranks
                    (rank r takes KV head r * Hkv // N, the one its query heads read);
  q/k norms         over all heads (OLMoE): each rank's mean squares of its q and k slices
                    averaged over the ranks (one all-reduce of [T, 2]), the weights sliced;
  vocabulary        the embedding's and lm_head's rows split: a token's row comes from the rank
                    that holds it (the others add zeros, one all-reduce), the logits all-gathered
                    so that the sampler sees the whole vocabulary;
  experts           split within each expert, as the dense MLP: every expert's gate/up by its
                    intermediate size, its down by its input columns (the shared expert too);
                    the router replicated, so every rank routes every token alike and runs
                    its slice of the same experts; one all-reduce of the layer's output (the
                    experts' weighted sum and the shared expert are linear in the slices).
                    Not expert-parallel: that needs two all-to-alls per layer and its load
                    follows the routing's skew, where this is one all-reduce, balanced.

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
from batchllm.model.experts import SparseMoe
from batchllm.model.families import describe
from batchllm.model.rotary import head_dim_of


def _check(config, n: int) -> None:
    f = describe(config)
    hq = config.num_attention_heads
    hkv = config.num_key_value_heads or hq
    e = f.experts
    why = None
    if e is not None and (e.intermediate_size % n or e.shared_size % n):
        why = (f"the experts' intermediate size {e.intermediate_size}"
               + (f" and the shared expert's {e.shared_size}" if e.shared_size else "")
               + f" must divide by {n}")
    elif f.fused_qkv or f.fused_gate_up:
        why = "fused qkv_proj / gate_up_proj checkpoints are not split yet"
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
    for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):  # Qwen-MoE's
        if getattr(config, name, None):
            setattr(local, name, getattr(config, name) // n)
    return local


def _mlp_parts(f, i: int, rank: int, n: int, state) -> dict:
    """Layer i's MLP tensors and the part rank reads of each: gate/up by rows (column-parallel),
    down by columns (row-parallel); a MoE layer's every expert and shared expert alike, its
    router and shared-expert gate whole."""
    col, row = (0, rank, n), (1, rank, n)
    e = f.experts
    if e is None or not e.sparse_layers[i]:
        m = f"model.layers.{i}.mlp."
        parts = {m + "gate_proj.weight": col, m + "up_proj.weight": col,
                 m + "down_proj.weight": row}
        if f.mlp_bias:
            parts.update({m + "gate_proj.bias": col, m + "up_proj.bias": col})
        return parts
    if e.names == "mixtral":
        base, (gate, up, down) = f"model.layers.{i}.block_sparse_moe.", ("w1", "w3", "w2")
    else:
        base, (gate, up, down) = f"model.layers.{i}.mlp.", ("gate_proj", "up_proj", "down_proj")
    parts = {}
    if base + "experts.gate_up_proj" not in state:  # else transformers' fused [E, 2I, H]
        for x in range(e.num_experts):
            parts.update({f"{base}experts.{x}.{gate}.weight": col,
                          f"{base}experts.{x}.{up}.weight": col,
                          f"{base}experts.{x}.{down}.weight": row})
    if e.shared_size:
        s = base + "shared_expert."
        parts.update({s + "gate_proj.weight": col, s + "up_proj.weight": col,
                      s + "down_proj.weight": row})
    return parts


def _shard_fused_experts(state, prefix: str, rank: int, n: int) -> None:
    """transformers' fused experts: gate_up [E, 2I, H] (gate rows, then up rows) and down
    [E, H, I]: rank's I/n rows of the gate and of the up half, its I/n columns of down."""
    fused, down = prefix + "experts.gate_up_proj", prefix + "experts.down_proj"
    state[fused] = torch.cat([state.read(fused, (1, rank, 2 * n)),
                              state.read(fused, (1, n + rank, 2 * n))], dim=1)
    state[down] = state.read(down, (2, rank, n))


def shard_checkpoint(state, config, rank: int, n: int) -> None:
    """Replace the split tensors of `state` (a weights.Checkpoint) by rank's slices, read alone."""
    f = describe(config)
    hkv = config.num_key_value_heads or config.num_attention_heads
    kv_part = (0, rank, n) if hkv >= n else (0, rank * hkv // n, hkv)
    for i in range(config.num_hidden_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        parts = {a + "q_proj.weight": (0, rank, n), a + "k_proj.weight": kv_part,
                 a + "v_proj.weight": kv_part, a + "o_proj.weight": (1, rank, n),
                 **_mlp_parts(f, i, rank, n, state)}
        if f.qkv_bias:
            parts.update({a + "q_proj.bias": (0, rank, n), a + "k_proj.bias": kv_part,
                          a + "v_proj.bias": kv_part})
        if f.qk_norm == "full":  # OLMoE's norms over all heads: the rank's heads' weights
            parts.update({a + "q_norm.weight": (0, rank, n), a + "k_norm.weight": kv_part})
        for prefix in (f"model.layers.{i}.mlp.", f"model.layers.{i}.block_sparse_moe."):
            if prefix + "experts.gate_up_proj" in state:
                _shard_fused_experts(state, prefix, rank, n)
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


class _ReducedMoe:
    """A MoE layer of sliced experts: the rank's partial output, summed over the ranks."""

    def __init__(self, inner) -> None:
        self.inner, self.width = inner, inner.width

    def __call__(self, x: torch.Tensor, act_mul) -> torch.Tensor:  # [T, H] -> [T, H]
        y = self.inner(x, act_mul)
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
            if layer.attn.q_norm is not None and not layer.attn.per_head:
                layer.attn.mean_over_ranks = self._mean_over_ranks
            if isinstance(layer.mlp, SparseMoe):
                layer.mlp = _ReducedMoe(layer.mlp)
            else:
                layer.mlp.down = _Reduced(layer.mlp.down)
        self.cpu_layers = None  # the all-reduces sit between each layer's halves

    def _mean_over_ranks(self, means: torch.Tensor) -> torch.Tensor:
        """The ranks' mean squares of equal widths averaged: the mean over all heads. A KV head
        replicated on N/Hkv ranks counts N/Hkv times, as every other: k's mean is exact too."""
        dist.all_reduce(means)
        return means / self.ranks

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
