"""The parts of a decoder layer, read from the checkpoint by the family's own names
(families.py says which): the attention block and the dense gated MLP. The MoE MLP is in
experts.py. Every part works on a step's flat tokens ([T, ...]) as decoder.py passes them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from batchllm.model.attention import PagedAttention
from batchllm.model.checkpoint import Tensors
from batchllm.model.families import Family
from batchllm.model.linear import Linear
from batchllm.model.ops import ModelOps, Projection


def take_norm(t: Tensors, name: str, family: Family) -> torch.Tensor:
    """An RMSNorm weight, with Gemma's (1 + w) folded in once (transformers adds the 1 in
    float32 at every call; the same sum in float32 models)."""
    w = t.take(name)
    return w + 1 if family.norm_plus_one else w


def _permute_heads(w: torch.Tensor, heads: int, perm: torch.Tensor | None) -> torch.Tensor:
    """Rows [heads*D, ...] (or a bias [heads*D]) with each head's dims reordered by `perm`
    (rotary.head_permutation: partial rotary in the kernels' layout); None: unchanged."""
    if perm is None:
        return w
    d = perm.shape[0]
    return w.reshape(heads, d, *w.shape[1:])[:, perm.to(w.device)].reshape(w.shape)


class Attention:
    """q/k/v projection, the family's q/k norms and clipping, rotary embedding, the paged
    attention of the step, the output projection."""

    def __init__(self, t: Tensors, prefix: str, f: Family, layer: int, heads: tuple[int, int, int],
                 layout: Projection, perm: torch.Tensor | None,
                 rope: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.hq, self.hkv, self.d = hq, hkv, d = heads
        att = prefix + "self_attn."
        if f.fused_qkv:
            weight = t.take(att + "qkv_proj.weight")
            parts = list(weight.split([hq * d, hkv * d, hkv * d]))
        else:
            parts = t.take_all([att + n + "_proj.weight" for n in "qkv"])
        biases = t.take_all([att + n + "_proj.bias" for n in "qkv"]) if f.qkv_bias else None
        rotated = (hq, hkv)  # q and k heads are rotated; v is not
        parts = [_permute_heads(w, h, perm) for w, h in zip(parts, rotated)] + parts[2:]
        if biases is not None:
            biases = [_permute_heads(b, h, perm) for b, h in zip(biases, rotated)] + biases[2:]
        self.qkv = Linear(parts, None if biases is None else torch.cat(biases),
                          layout)  # [(Hq+2Hkv)*D, H], joined by Linear only where it must
        self.o = Linear(t.take(att + "o_proj.weight"),
                        t.take(att + "o_proj.bias") if f.o_bias else None, layout)  # [H, Hq*D]
        self.q_norm = self.k_norm = None
        if f.qk_norm:
            self.q_norm, self.k_norm = (take_norm(t, att + n + "_norm.weight", f) for n in "qk")
            if f.qk_norm == "head" and perm is not None:
                self.q_norm, self.k_norm = self.q_norm[perm], self.k_norm[perm]
            elif perm is not None:
                self.q_norm = _permute_heads(self.q_norm, hq, perm)
                self.k_norm = _permute_heads(self.k_norm, hkv, perm)
        self.per_head = f.qk_norm == "head"
        # tensor_parallel.py's, where q/k norms over all heads meet heads split over the ranks:
        # the [T, 2] mean squares of the rank's q and k slices -> their means over the ranks
        self.mean_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.clip = f.clip_qkv
        self.cos, self.sin = rope  # [P, D] each
        self.scale, self.window, self.softcap = f.attn_scale, f.windows[layer], f.attn_softcap

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, attention: PagedAttention,
                 layer: int, ops: ModelOps, eps: float) -> torch.Tensor:
        """x [T, H] (normed), positions [T] -> the attention block's output [T, H]."""
        t = x.shape[0]
        hq, d = self.hq, self.d
        qkv = self.qkv(x)  # [T, (Hq+2Hkv)*D]
        if self.q_norm is not None:
            self._norm_qk(qkv, ops, eps)
        if self.clip:
            qkv.clamp_(-self.clip, self.clip)
        # q and k heads rotated in place; k and v into the cache (one pass on the CUDA path)
        attention.rope_store(layer, qkv, positions, self.cos, self.sin, hq)
        q = qkv[:, : hq * d].view(t, hq, d)
        o = attention.attend(layer, q, scale=self.scale, window=self.window,
                             softcap=self.softcap)  # [T, Hq, D]
        return self.o(o.reshape(t, hq * d))

    def _norm_qk(self, qkv: torch.Tensor, ops: ModelOps, eps: float) -> None:
        """RMSNorm of q and of k in place: per head (Qwen3, Gemma 3) or over all their heads
        (OLMoE)."""
        t, d, hq, hkv = qkv.shape[0], self.d, self.hq, self.hkv
        spans = ((0, hq * d, self.q_norm), (hq * d, (hq + hkv) * d, self.k_norm))
        if self.mean_over_ranks is not None:  # as add_rms_norm, the mean from all ranks' slices
            x = qkv[:, : (hq + hkv) * d].float()
            means = self.mean_over_ranks(torch.stack(
                [x[:, lo:hi].square().mean(1) for lo, hi, _ in spans], 1))  # [T, 2]
            for (lo, hi, w), mean in zip(spans, means.unbind(1)):
                qkv[:, lo:hi] = w * (x[:, lo:hi] * torch.rsqrt(mean + eps)[:, None]).to(qkv.dtype)
            return
        for lo, hi, w in spans:
            part = qkv[:, lo:hi]
            rows = part.reshape(-1, d) if self.per_head else part
            normed = ops.pointwise.add_rms_norm(rows.contiguous(), None, w, eps)
            part.copy_(normed.view(t, hi - lo))


class Mlp:
    """The dense gated MLP: down(act(gate(x)) * up(x)), gate and up in one projection."""

    def __init__(self, t: Tensors, prefix: str, f: Family, layout: Projection) -> None:
        if f.fused_gate_up:
            gate_up = t.take(prefix + "gate_up_proj.weight")
        else:
            gate_up = t.take_all([prefix + "gate_proj.weight", prefix + "up_proj.weight"])
        bias = None
        if f.mlp_bias:
            bias = torch.cat(t.take_all([prefix + "gate_proj.bias", prefix + "up_proj.bias"]))
        self.gate_up = Linear(gate_up, bias, layout)  # [2I, H]
        self.down = Linear(t.take(prefix + "down_proj.weight"),
                           t.take(prefix + "down_proj.bias") if f.mlp_bias else None,
                           layout)  # [H, I]
        self.width = self.gate_up.out_features  # per row, for the row blocks

    def __call__(self, x: torch.Tensor, act_mul: Callable) -> torch.Tensor:  # [T, H] -> [T, H]
        return self.down(act_mul(self.gate_up(x)))  # [T, 2I] -> [T, I] -> [T, H]
