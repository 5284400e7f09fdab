"""Greedy tokens of batchllm equal Hugging Face transformers `generate` (one prompt at a time,
float32, CPU) under DESIGN.md's near-tie rule, whatever the engine settings."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from hf_reference import assert_tokens_match, hf_greedy_reference, tiny_model_folder

from batchllm import LLM, SamplingParams

MAX_TOKENS = 10


def nested_prompts(seed: int = 0) -> list[list[int]]:
    """Three levels of sharing (system > template > document > question), an exact duplicate,
    a prompt that is a prefix of another, and one sharing nothing."""
    rng = np.random.default_rng(seed)

    def toks(n: int) -> list[int]:
        return rng.integers(5, 4000, n).tolist()

    system = toks(21)
    prompts = []
    for _ in range(2):
        template = toks(9)
        for _ in range(2):
            doc = toks(int(rng.integers(10, 40)))
            for _ in range(3):
                prompts.append(system + template + doc + toks(int(rng.integers(1, 8))))
    prompts.append(list(prompts[3]))  # an exact duplicate
    prompts.append(prompts[5][:-1] if len(prompts[5]) > 1 else prompts[5])  # a prefix of another
    prompts.append(toks(13))  # shares nothing
    return prompts


@functools.cache
def reference(kind: str) -> list[tuple[list[int], list[float]]]:
    return hf_greedy_reference(tiny_model_folder(kind), nested_prompts(), MAX_TOKENS)


@functools.cache
def engine(kind: str, **settings) -> LLM:
    # Engines stay cached for the session: a 256 MiB pool each (plenty for these tiny models)
    # keeps the process small enough to fork (Ray's tests start processes later).
    settings.setdefault("kv_cache_memory", 256 << 20)
    return LLM(str(tiny_model_folder(kind)), dtype="float32", device="cpu", **settings)


def kv_bytes(llm_kind: str, pages: int, page_size: int) -> int:
    probe = engine(llm_kind)
    return pages * page_size * probe.runtime.engine.bytes_per_token


def run_and_compare(kind: str, **settings) -> dict:
    llm = engine(kind, **settings)
    outs = llm.generate(nested_prompts(), SamplingParams(max_tokens=MAX_TOKENS))
    for i, (out, (tokens, gaps)) in enumerate(zip(outs, reference(kind))):
        assert out.finish_reason in ("stop", "length"), out.error
        assert_tokens_match(out.token_ids, tokens, gaps, row=i)
    return llm.last_metrics


SETTINGS = {
    "default": {},
    "page1": {"page_size": 1},
    "page7": {"page_size": 7},
    "chunked": {"max_batched_tokens": 13},
    "one_seq": {"max_num_seqs": 1},
    "input_order": {"order": "input"},
}


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("sharing", [True, False])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_greedy_matches_transformers(kind: str, sharing: bool, name: str) -> None:
    metrics = run_and_compare(kind, prefix_sharing=sharing, **SETTINGS[name])
    tree, prompt = metrics["tree_tokens"], metrics["prompt_tokens"]
    if sharing:
        # Enough memory for the working set: each distinct prompt token runs exactly once.
        assert metrics["prefill_tokens"] == tree < prompt
    else:
        assert metrics["prefill_tokens"] == prompt
    assert metrics["preemptions"] == 0


@pytest.mark.parametrize("sharing", [True, False])
def test_a_bfloat16_checkpoint_run_in_float32_matches_transformers(sharing: bool) -> None:
    """A checkpoint saved in bfloat16, run in float32 (transformers upcasts the same values):
    the greedy tokens are transformers'."""
    run_and_compare("llama:bf16", prefix_sharing=sharing)


def test_greedy_steps_take_the_lm_head_argmax(monkeypatch) -> None:
    """On the C kernel's panels, a step whose sampling rows are all plain greedy gets the
    lm_head's argmax (cpu_linear_argmax) and never the [S, V] logits; a step with a logprobs row,
    or one sampling from a shared prefix's kept logits, takes the logits. Either way the tokens
    are those of the logits path (exactly: the same values) and transformers'."""
    llm = engine("llama")
    model = llm.runtime.loaded.model
    assert model.lm_head.panels is not None
    calls = {"greedy": 0, "logits": 0}

    def counted(name, fn):
        def call(h):
            out = fn(h)
            calls[name] += out is not None
            return out
        return call

    monkeypatch.setattr(model, "greedy", counted("greedy", model.greedy))
    monkeypatch.setattr(model, "logits", counted("logits", model.logits))
    prompts = nested_prompts()
    fused = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    for i, (out, (tokens, gaps)) in enumerate(zip(fused, reference("llama"))):
        assert_tokens_match(out.token_ids, tokens, gaps, row=i)
    assert calls["greedy"] > 3 * calls["logits"] > 0  # the prefix-of-another row: logits
    mixed = [SamplingParams(max_tokens=MAX_TOKENS, logprobs=2 if i == 4 else 0)
             for i in range(len(prompts))]
    calls.update(greedy=0, logits=0)
    with_logprobs = llm.generate(prompts, mixed)
    assert calls["logits"] > 0
    monkeypatch.setattr(model, "greedy", lambda h: None)  # the logits path only
    unfused = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.token_ids for o in fused] == [o.token_ids for o in unfused]
    assert [o.token_ids for o in fused] == [o.token_ids for o in with_logprobs]


@pytest.mark.parametrize("sharing", [True, False])
def test_greedy_matches_with_the_torch_twins(sharing: bool, monkeypatch) -> None:
    """BATCHLLM_CPU_KERNEL=0 (or no C compiler): every part of the CPU path in torch."""
    from batchllm_kernels.reference.pointwise import TORCH_OPS
    from batchllm_kernels.reference.store_kv import store_kv_ref

    # Read where the ops are picked (batchllm/model/ops.py), whatever the C loaders hold.
    monkeypatch.setenv("BATCHLLM_CPU_KERNEL", "0")
    llm = LLM(str(tiny_model_folder("llama")), dtype="float32", device="cpu",
              kv_cache_memory=64 << 20, prefix_sharing=sharing, max_batched_tokens=29)
    model = llm.runtime.loaded.model
    ops = model.ops
    assert llm.runtime.engine.attention.ops == ops  # the cache picked the same record
    assert ops.paged_attention.__name__ == "paged_attention_ref"
    assert ops.store_kv is store_kv_ref and ops.prefix_attention_into is None
    assert ops.pointwise is TORCH_OPS
    assert ops.projection != "panels" and model.layers[0].attn.qkv.panels is None  # oneDNN / F.linear
    outs = llm.generate(nested_prompts(), SamplingParams(max_tokens=MAX_TOKENS))
    for i, (out, (tokens, gaps)) in enumerate(zip(outs, reference("llama"))):
        assert_tokens_match(out.token_ids, tokens, gaps, row=i)


@pytest.mark.parametrize("kind", ["llama", pytest.param("qwen2", marks=pytest.mark.slow)])
@pytest.mark.parametrize("sharing", [True, False])
@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_matches_under_preemption(kind: str, sharing: bool, page_size: int) -> None:
    # A pool far smaller than the working set: requests are preempted and recomputed.
    longest = max(map(len, nested_prompts())) + MAX_TOKENS
    pages = -(-longest // page_size) + 2
    metrics = run_and_compare(
        kind, prefix_sharing=sharing, page_size=page_size,
        kv_cache_memory=kv_bytes(kind, pages, page_size), max_batched_tokens=32,
    )
    assert metrics["kv_pages_total"] == pages
    assert metrics["preemptions"] > 0
    assert metrics["kv_pages_peak"] <= pages


@pytest.mark.slow  # loads the real SmolLM2 model
def test_smollm2_real_prompts_match_transformers(smollm2_folder) -> None:
    llm = LLM("smollm2-135m-instruct", dtype="float32", device="cpu")
    questions = [
        "What is the capital of France?",
        "Write a haiku about contracts.",
        "Explain what an indemnification clause does, in two sentences.",
        "List three prime numbers.",
        "What is the capital of France? Answer in one word.",
    ]
    system = "You are a careful legal assistant. Answer briefly and precisely."
    convs = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
             for q in questions]
    outs = llm.chat(convs, SamplingParams(max_tokens=24))
    texts = llm.tokenizer.apply_chat_template(convs, tokenize=False, add_generation_prompt=True)
    ids = [llm.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    ref = hf_greedy_reference(smollm2_folder, ids, 24)
    for i, (out, (tokens, gaps)) in enumerate(zip(outs, ref)):
        assert out.prompt_tokens == len(ids[i])
        assert_tokens_match(out.token_ids, tokens, gaps, row=i)
    m = llm.last_metrics
    assert m["prefill_tokens"] == m["tree_tokens"] < m["prompt_tokens"]
    # Every row reused the shared system prompt computed once.
    assert all(out.cached_tokens > 0 for out in outs)
    assert m["cached_tokens"] >= m["prompt_tokens"] - m["tree_tokens"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("sharing", [True, False])
@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_matches_on_cuda_with_the_triton_kernels(sharing: bool, page_size: int) -> None:
    # The GPU path (Triton kernels) in float32 against the CPU reference.
    llm = LLM(str(tiny_model_folder("llama")), dtype="float32", device="cuda",
              prefix_sharing=sharing, page_size=page_size, max_batched_tokens=32)
    outs = llm.generate(nested_prompts(), SamplingParams(max_tokens=MAX_TOKENS))
    for i, (out, (tokens, gaps)) in enumerate(zip(outs, reference("llama"))):
        assert_tokens_match(out.token_ids, tokens, gaps, row=i)
    assert llm.last_metrics["device"].startswith("cuda")
