"""A sparse mixture-of-experts MLP: the router's top-k, the experts run grouped, and Qwen2-MoE's
shared expert.

Routing (every family as transformers computes it): probabilities = softmax of the router
logits in float32; the k largest, ties to the lower expert index (a stable sort, so a token's
experts never depend on the device or on the other tokens of the step); renormalised to sum 1
when the family says (Mixtral always, Qwen-MoE and OLMoE when norm_topk_prob).

Grouped run: the step's (token, choice) pairs are sorted by expert (stable), so that each
expert's rows are one contiguous run; each expert with rows multiplies them once by its
gate-up and once by its down weight; the outputs, times their routing weights, are added back
to their tokens in expert order, as transformers' loop over experts adds them. On CUDA (and
with the Triton backend) the runs go through one grouped launch per weight
(kernels/triton/grouped_matmul.py, twin kernels/reference/grouped_matmul.py); on the CPU each
expert's run goes through its own projection (linear.py: the C kernel's panels).

No host sync on the grouped path (the one CUDA runs and a graph captures): the sort, the
offsets (searchsorted over the sorted ids, not a bincount), the gathers and the index_add have
sizes fixed by T, k and E, and the grouped kernel numbers its tiles from the offsets on the
device; tests/test_sync_free.py guards it. The same grouping as before, so the same sums in the
same order: the tokens are unchanged. Only the CPU's per-expert loop reads the run bounds to the
host (C kernels need each run's rows; on the CPU there is no device to wait for).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from batchllm.model.checkpoint import Tensors
from batchllm.model.families import Experts
from batchllm.model.linear import Linear
from batchllm.model.ops import Projection


class Routing(NamedTuple):
    weights: torch.Tensor  # [T, k] fp32, each token's weight per chosen expert
    experts: torch.Tensor  # [T, k] int64, the chosen experts, best first


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> Routing:
    """logits [T, E] -> the top-k experts per token (see the module docstring)."""
    probs = torch.softmax(logits.float(), dim=-1)  # [T, E]
    values, experts = torch.sort(probs, dim=-1, descending=True, stable=True)
    values, experts = values[:, :top_k], experts[:, :top_k]
    if normalize:
        values = values / values.sum(dim=-1, keepdim=True)
    return Routing(values, experts)


def group_by_expert(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """experts [T, k] -> (order [T*k] int64: the flat (token, choice) pairs sorted by expert,
    ties in token order; offsets [E+1] int32: expert e's pairs are order[offsets[e]:offsets[e+1]]).

    Without a host sync, in sizes fixed by T, k and E (so a CUDA graph can hold it): the offsets
    are where each expert id would be inserted in the sorted ids (searchsorted on the device),
    not a bincount, which reads its size back to the host on CUDA."""
    flat = experts.reshape(-1)  # [T*k]
    ids, order = torch.sort(flat, stable=True)  # [T*k] each
    bounds = torch.arange(num_experts + 1, dtype=ids.dtype, device=ids.device)  # [E+1]
    offsets = torch.searchsorted(ids, bounds, out_int32=True)  # [E+1]: pairs with id < e
    return order, offsets


class GroupedExperts:
    """E experts' weights: gate-up [2I, H] and down [H, I] each."""

    def __init__(self, gate_up: list[torch.Tensor], down: list[torch.Tensor], layout: Projection,
                 grouped_matmul: Callable | None) -> None:
        self.num_experts = len(gate_up)
        self.grouped_matmul = grouped_matmul
        if grouped_matmul is not None:  # one launch per weight over all experts
            self.w_gate_up = torch.stack(gate_up)  # [E, 2I, H]
            self.w_down = torch.stack(down)  # [E, H, I]
        else:  # one projection per expert, in the layout of the others
            self.gate_up = [Linear(w, None, layout) for w in gate_up]
            self.down = [Linear(w, None, layout) for w in down]
        self.last_offsets: torch.Tensor | None = None  # [E+1] of the last call (tests, stats)

    def __call__(self, x: torch.Tensor, routing: Routing, act_mul: Callable) -> torch.Tensor:
        """x [T, H] -> [T, H]: each token's experts' outputs, weighted and summed."""
        k = routing.experts.shape[1]
        order, offsets = group_by_expert(routing.experts, self.num_experts)
        self.last_offsets = offsets
        tokens = order // k  # [T*k], the token of each sorted pair
        xs = x[tokens]  # [T*k, H], each expert's rows together
        if self.grouped_matmul is not None:
            ys = self.grouped_matmul(act_mul(self.grouped_matmul(xs, self.w_gate_up, offsets)),
                                     self.w_down, offsets)
        else:
            ys = torch.empty_like(xs)
            bounds = offsets.tolist()  # the CPU path only (see the module docstring)
            for e in range(self.num_experts):
                lo, hi = bounds[e], bounds[e + 1]
                if hi > lo:
                    ys[lo:hi] = self.down[e](act_mul(self.gate_up[e](xs[lo:hi])))
        ys = ys * routing.weights.reshape(-1)[order, None].to(ys.dtype)
        return torch.zeros_like(x).index_add_(0, tokens, ys)


class SparseMoe:
    """One layer's router and experts (and shared expert), read by the family's names."""

    def __init__(self, t: Tensors, prefix: str, spec: Experts, layout: Projection,
                 grouped_matmul: Callable | None, dense_mlp: Callable) -> None:
        """dense_mlp(tensors, prefix) -> the dense MLP under prefix (layers.Mlp)."""
        self.spec = spec
        if spec.names == "mixtral":
            base, names = prefix + "block_sparse_moe.", ("w1", "w3", "w2")
        else:
            base, names = prefix + "mlp.", ("gate_proj", "up_proj", "down_proj")
        self.router = Linear(t.take(base + "gate.weight"), None, layout)  # [E, H]
        if base + "experts.gate_up_proj" in t:  # transformers' own fused layout
            gate_up = list(t.take(base + "experts.gate_up_proj").unbind(0))
            down = list(t.take(base + "experts.down_proj").unbind(0))
        else:
            gate, up, dn = ([t.take(f"{base}experts.{e}.{n}.weight")
                             for e in range(spec.num_experts)] for n in names)
            gate_up = [torch.cat([g, u]) for g, u in zip(gate, up)]
            down = dn
        self.experts = GroupedExperts([w.contiguous() for w in gate_up],
                                      [w.contiguous() for w in down], layout, grouped_matmul)
        self.shared = self.shared_gate = None
        if spec.shared_size:
            self.shared = dense_mlp(t, base + "shared_expert.")
            self.shared_gate = Linear(t.take(base + "shared_expert_gate.weight"), None, layout)
        self.width = 2 * spec.intermediate_size * spec.top_k  # per row, for the row blocks

    def __call__(self, x: torch.Tensor, act_mul: Callable) -> torch.Tensor:  # [T, H] -> [T, H]
        routing = route(self.router(x), self.spec.top_k, self.spec.normalize)
        out = self.experts(x, routing, act_mul)
        if self.shared is not None:
            out += torch.sigmoid(self.shared_gate(x)) * self.shared(x, act_mul)
        return out
