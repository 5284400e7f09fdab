"""The CUDA path's kernels (Triton, here in the interpreter on the CPU) run whole families end
to end: Gemma 2 (sliding windows and soft-capping in the attention kernels, the shared-prefix
split on its global layers) and Mixtral (the grouped experts product), greedy tokens against
transformers under DESIGN.md's rule."""

from __future__ import annotations

import pytest
from hf_reference import assert_tokens_match, hf_greedy_reference, tiny_model_folder
from test_engine_equivalence import nested_prompts
from triton_interpreter import load

from batchllm import LLM, SamplingParams

pytestmark = pytest.mark.slow  # the fast lane leaves it out (README: Run the tests)

PROMPTS = nested_prompts()[:6]  # a shared system prompt, two templates, a document


@pytest.mark.parametrize("kind, sharing", [("gemma2", True), ("mixtral", False)])
def test_family_on_the_triton_kernels(kind: str, sharing: bool, monkeypatch) -> None:
    for name in ("store_kv", "paged_attention", "prefix_attention", "merge_states",
                 "grouped_matmul"):
        load(f"batchllm_kernels.triton.{name}")  # made for the interpreter before the ops pick them
    monkeypatch.setenv("BATCHLLM_BACKEND", "triton")  # the CUDA path: its kernels, its step loop
    llm = LLM(str(tiny_model_folder(kind)), dtype="float32", device="cpu",
              kv_cache_memory=32 << 20, prefix_sharing=sharing, max_batched_tokens=40)
    model_ops = llm.runtime.loaded.model.ops
    assert model_ops.device_steps and model_ops.grouped_matmul is not None
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=5))
    reference = hf_greedy_reference(tiny_model_folder(kind), PROMPTS, 5)
    for i, (out, (tokens, gaps)) in enumerate(zip(outs, reference)):
        assert_tokens_match(out.token_ids, tokens, gaps, row=i)
