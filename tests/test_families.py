"""Every family batchllm accepts, on a tiny random model of it (tests/hf_reference.py), gives
transformers' greedy tokens (float32, CPU, one prompt at a time) under DESIGN.md's near-tie rule:
with prefix sharing on and off, page sizes 1 and 16, a token budget smaller than a prompt, and
a pool so small that requests are preempted. The windowed families (Mistral with its window,
Gemma 2 and 3) have windows of 5-7 tokens: every prompt, and every shared prefix, is longer."""

from __future__ import annotations

import functools

import pytest
import torch
from hf_reference import (
    FAMILY_KINDS,
    WINDOWED_KINDS,
    assert_tokens_match,
    hf_greedy_reference,
    tiny_model_folder,
)
from test_engine_equivalence import MAX_TOKENS, nested_prompts

from batchllm import LLM, SamplingParams
from batchllm.model.decoder import model_shape
from batchllm.model.hf_cache import load_config
from batchllm.model.loader import load_model

NEW_KINDS = [k for k in FAMILY_KINDS if k not in ("llama", "qwen2", "mistral")]  # those three:
# tests/test_engine_equivalence.py

# (sharing, page size, token budget): sharing on and off, pages of 1 and 16, a budget smaller
# than every prompt, each at least once (their full product, for the first three families:
# test_engine_equivalence.py). Steps, not tokens, cost here: each C kernel call pays a thread
# wake-up, so the grid is kept to what it must cover.
GRID = [(True, 1, 13), (False, 16, 8192)]


@functools.cache
def reference(kind: str) -> list[tuple[list[int], list[float]]]:
    return hf_greedy_reference(tiny_model_folder(kind), nested_prompts(), MAX_TOKENS)


def generate(kind: str, **settings) -> dict:
    llm = LLM(str(tiny_model_folder(kind)), dtype="float32", device="cpu", **settings)
    outs = llm.generate(nested_prompts(), SamplingParams(max_tokens=MAX_TOKENS))
    for i, (out, (tokens, gaps)) in enumerate(zip(outs, reference(kind))):
        assert out.finish_reason in ("stop", "length"), out.error
        assert_tokens_match(out.token_ids, tokens, gaps, row=f"{kind} {i}")
    return llm.last_metrics


# the fast lane (README: Run the tests) keeps one family of each kind: a new dense one, qk-norm,
# softcap with windows, experts; the full suite runs all
FAST_KINDS = ("llama3", "qwen3", "gemma2", "qwen2_moe")


@pytest.mark.parametrize("kind", [k if k in FAST_KINDS else pytest.param(k, marks=pytest.mark.slow)
                                  for k in NEW_KINDS])
def test_family_matches_transformers(kind: str) -> None:
    for sharing, page_size, budget in GRID:
        m = generate(kind, prefix_sharing=sharing, page_size=page_size,
                     max_batched_tokens=budget, kv_cache_memory=64 << 20)
        assert m["preemptions"] == 0
        if sharing:  # every distinct prompt token through the model once
            assert m["prefill_tokens"] == m["tree_tokens"] < m["prompt_tokens"]
        else:
            assert m["prefill_tokens"] == m["prompt_tokens"]
    # A pool too small for the working set (the full grid of preemption runs, sharing x page
    # size, is test_engine_equivalence.py's; here sharing alternates between the families).
    sharing = NEW_KINDS.index(kind) % 2 == 0
    longest = max(map(len, nested_prompts())) + MAX_TOKENS
    pages = -(-longest // 16) + 2
    per_token = model_shape(load_config(tiny_model_folder(kind))).kv_bytes_per_token(
        torch.float32)
    m = generate(kind, prefix_sharing=sharing, max_batched_tokens=48,
                 kv_cache_memory=pages * 16 * per_token)
    assert m["kv_pages_total"] == pages and m["preemptions"] > 0


@pytest.mark.parametrize("kind", WINDOWED_KINDS)
def test_windows_are_shorter_than_prompts_and_shared_prefixes(kind: str) -> None:
    family = load_model(str(tiny_model_folder(kind)), "float32", "cpu").model.family
    window = max(family.windows)
    assert 0 < window < min(map(len, nested_prompts())) and window < 21  # the system prompt
