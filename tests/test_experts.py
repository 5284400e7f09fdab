"""Mixture-of-experts pieces (batchllm/model/experts.py): the router's top-k on tied scores, the
per-expert token counts of real engine steps against a brute-force count, the grouped run
against a token-by-token one, and the Triton grouped product against its twin."""

from __future__ import annotations

import pytest
import torch
from hf_reference import tiny_model_folder
from test_engine_equivalence import nested_prompts
from triton_interpreter import CUDA, load

from batchllm import LLM, SamplingParams
from batchllm.model import experts
from batchllm.model.experts import GroupedExperts, Routing, group_by_expert, route
from batchllm.model.weights import load_weights
from batchllm_kernels.reference.grouped_matmul import grouped_matmul_ref
from batchllm_kernels.reference.pointwise import silu_mul_ref

DEVICE = "cuda" if CUDA else "cpu"


def test_tied_scores_route_to_the_lower_expert_whatever_the_batch():
    tied = torch.tensor([[0.5, 2.0, 2.0, 2.0, -1.0],  # three-way tie for the top
                         [1.0, 1.0, 1.0, 1.0, 1.0],  # all equal
                         [0.0, 3.0, 1.0, 3.0, 1.0]])  # ties at both places
    expected = [[1, 2], [0, 1], [1, 3]]
    r = route(tied, 2, normalize=True)
    assert r.experts.tolist() == expected
    assert torch.allclose(r.weights, torch.full((3, 2), 0.5))
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):  # among other tokens, in any order: the same choice for each tied row
        others = torch.randn(7, 5, generator=gen)
        batch = torch.cat([others, tied])[torch.randperm(10, generator=gen)]
        got = route(batch, 2, normalize=False).experts
        for row, want in zip(tied, expected):
            where = (batch == row).all(dim=1).nonzero()[0, 0]
            assert got[where].tolist() == want


def test_scores_that_tie_only_after_the_softmax_route_as_transformers_does():
    # Distinct logits whose float32 probabilities are equal: transformers ranks probabilities.
    logits = torch.tensor([[0.0, 1e-8, -30.0]])
    probs = torch.softmax(logits, -1)
    assert probs[0, 0] == probs[0, 1]
    assert route(logits, 1, normalize=False).experts.tolist() == [[0]]


def test_group_by_expert_sorts_pairs_stably():
    chosen = torch.tensor([[2, 0], [0, 2], [3, 0]])  # 3 tokens, top-2, expert 1 unused
    order, offsets = group_by_expert(chosen, 4)
    assert offsets.tolist() == [0, 3, 3, 5, 6]
    assert order.tolist() == [1, 2, 5, 0, 3, 4]  # expert 0: pairs 1, 2, 5 in token order ...


def brute_force_counts(x: torch.Tensor, router: torch.Tensor, k: int) -> list[int]:
    """Per-expert token counts of x [T, H] under router [E, H], one token at a time in float64
    and plain Python: softmax, rank by (-probability, expert), keep k."""
    counts = [0] * router.shape[0]
    for row in x.double():
        p = torch.softmax(router.double() @ row, dim=0).tolist()
        for e in sorted(range(len(p)), key=lambda e: (-p[e], e))[:k]:
            counts[e] += 1
    return counts


def test_expert_counts_of_engine_steps_match_a_brute_force_count(monkeypatch):
    """Every MoE call of a real run (prefill chunks, decodes, mixed steps): the per-expert token
    counts the grouped run used equal a brute-force routing of the same tokens, and its output
    equals each token run through its experts one by one (float64)."""
    folder = tiny_model_folder("mixtral")
    _, state = load_weights(folder, torch.float32, "cpu")
    calls = []
    original = experts.SparseMoe.__call__

    def recording(self, x, act_mul):
        out = original(self, x, act_mul)
        calls.append((self, x.clone(), self.experts.last_offsets.clone(), out))
        return out

    monkeypatch.setattr(experts.SparseMoe, "__call__", recording)
    llm = LLM(str(folder), dtype="float32", device="cpu", kv_cache_memory=64 << 20,
              max_batched_tokens=29)
    llm.generate(nested_prompts()[:6], SamplingParams(max_tokens=4))
    layers = {id(block): i for i, block in enumerate(
        layer.mlp for layer in llm.runtime.loaded.model.layers)}
    assert len(calls) > 10 and len({x.shape[0] for _, x, _, _ in calls}) > 3
    for block, x, offsets, out in calls:
        p = f"model.layers.{layers[id(block)]}.block_sparse_moe."
        router = state[p + "gate.weight"]
        assert torch.diff(offsets).tolist() == brute_force_counts(x, router, 2)
        probs = torch.softmax(x.double() @ router.double().T, dim=-1)
        top, chosen = probs.topk(2, dim=-1)
        top = top / top.sum(-1, keepdim=True)
        expected = torch.zeros_like(x, dtype=torch.float64)
        for t in range(x.shape[0]):
            for j in range(2):
                e = int(chosen[t, j])
                w1, w3, w2 = (state[f"{p}experts.{e}.{n}.weight"].double()
                              for n in ("w1", "w3", "w2"))
                h = torch.nn.functional.silu(w1 @ x[t].double()) * (w3 @ x[t].double())
                expected[t] += top[t, j] * (w2 @ h)
        torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-4)


def test_grouped_launch_equals_one_projection_per_expert():
    gen = torch.Generator().manual_seed(1)
    e, h, i = 5, 24, 20
    gate_up = [torch.randn(2 * i, h, generator=gen) for _ in range(e)]
    down = [torch.randn(h, i, generator=gen) for _ in range(e)]
    x = torch.randn(11, h, generator=gen)
    routing = route(torch.randn(11, e, generator=gen), 2, normalize=True)
    per_expert = GroupedExperts(gate_up, down, "dense", None)(x, routing, silu_mul_ref)
    grouped = GroupedExperts(gate_up, down, "dense", grouped_matmul_ref)(x, routing, silu_mul_ref)
    torch.testing.assert_close(grouped, per_expert, rtol=1e-5, atol=1e-5)
    assert isinstance(routing, Routing)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("counts", [[37, 0, 1, 64, 5], [0, 0, 3], [130]])
def test_triton_grouped_matmul_matches_twin(counts, dtype):
    """Odd run lengths, empty experts, a run over several row tiles; output width not a
    multiple of the column tile."""
    grouped = load("batchllm_kernels.triton.grouped_matmul")
    gen = torch.Generator().manual_seed(sum(counts))
    k, m = 40, 72
    x = torch.randn(sum(counts), k, generator=gen).to(dtype).to(DEVICE)
    w = torch.randn(len(counts), m, k, generator=gen).to(dtype).to(DEVICE)
    offsets = torch.tensor([0, *counts], device=DEVICE).cumsum(0).int()
    y = grouped.grouped_matmul(x, w, offsets)
    expected = grouped_matmul_ref(x.float(), w.float(), offsets)
    assert y.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.float(), expected, rtol=tol, atol=tol * 10)


def test_triton_grouped_matmul_rejects_bad_inputs():
    grouped = load("batchllm_kernels.triton.grouped_matmul")
    x, w = torch.zeros(4, 8, device=DEVICE), torch.zeros(2, 6, 8, device=DEVICE)
    with pytest.raises(ValueError, match="offsets"):
        grouped.grouped_matmul(x, w, torch.tensor([0, 4], dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="w \\[E, M, K\\]"):
        grouped.grouped_matmul(x, w[:, :, :5], torch.zeros(3, dtype=torch.int32, device=DEVICE))
