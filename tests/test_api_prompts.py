"""What the Python API takes as prompts and settings, as vLLM's LLM takes them: one conversation
alone in chat, vLLM's prompt dicts, seed None; and what it refuses up front (a sampling list of
another length, a frame whose columns the output would overwrite) or fails as one row (token ids
outside the vocabulary, a None prompt) while the other prompts run."""

from __future__ import annotations

import polars as pl
import pytest
from hf_reference import tiny_model_folder

import batchllm

SP = batchllm.SamplingParams(max_tokens=4)


@pytest.fixture(scope="module")
def llm() -> batchllm.LLM:
    return batchllm.LLM(str(tiny_model_folder("llama")), device="cpu", kv_cache_memory=64 << 20)


def test_one_conversation_alone_is_one_output(llm):
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    alone = llm.chat(conv, SP)
    listed = llm.chat([conv], SP)
    assert len(alone) == 1
    assert (alone[0].text, alone[0].prompt_tokens) == (listed[0].text, listed[0].prompt_tokens)
    assert alone[0].prompt_tokens > 5  # the whole rendered conversation, not one character


def test_a_list_of_sampling_params_of_another_length_is_a_value_error(llm):
    with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
        llm.generate(["a", "b", "c"], [SP, SP])
    with pytest.raises(ValueError, match="3 sampling params for 1 prompts"):
        llm.chat([[{"role": "user", "content": "Hi"}]], [SP] * 3)
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate_frame(pl.DataFrame({"p": ["x"]}), prompt="p", sampling_params=[SP, SP])


def test_token_ids_outside_the_vocabulary_fail_their_row_and_the_others_run(llm):
    vocab = llm.runtime.loaded.model.shape.vocab_size
    ids = [5, 17, 300, 41]
    want = llm.generate([ids, "The lease ends"], SP)
    outs = llm.generate([ids, [1, 2, vocab], [5, -1, 7], None, {"prompt_token_ids": ids},
                         {"prompt": "The lease ends"}, [[1, 2]]], SP)
    assert [o.finish_reason for o in outs] == ["length", "error", "error", "error", "length",
                                               "length", "error"]
    assert outs[1].error == f"the prompt's token id {vocab} is outside the model's vocabulary " \
                            f"(0..{vocab - 1})"
    assert "token id -1 is outside" in outs[2].error
    assert outs[3].error == "the prompt is None"
    assert "neither text nor a list of token ids" in outs[6].error
    assert outs[0].token_ids == outs[4].token_ids == want[0].token_ids
    assert outs[5].token_ids == want[1].token_ids


def test_seed_none_is_the_default_seed(llm):
    drawn = batchllm.SamplingParams(max_tokens=6, temperature=0.9, seed=0)
    a = llm.generate(["Either party may"], drawn)
    b = llm.generate(["Either party may"], batchllm.SamplingParams(max_tokens=6, temperature=0.9,
                                                                   seed=None))
    assert b[0].error is None and b[0].token_ids == a[0].token_ids


def test_a_frame_with_a_column_the_samples_would_add_is_refused_before_the_run(llm, monkeypatch):
    df = pl.DataFrame({"p": ["x", "y"], "sample": [1, 2], "logprobs": [0, 0]})
    kept = llm.generate_frame(df, prompt="p", sampling_params=SP)  # neither column is added
    assert kept.select("p", "sample", "logprobs").equals(df)

    def run(rows):
        raise AssertionError("the model ran")

    monkeypatch.setattr(llm, "_run", run)
    with pytest.raises(ValueError, match="output column.*: sample$"):
        llm.generate_frame(df, prompt="p", sampling_params=batchllm.SamplingParams(n=2))
    with pytest.raises(ValueError, match="output column.*: logprobs$"):
        llm.generate_frame(df, prompt="p", sampling_params=batchllm.SamplingParams(logprobs=2))
    with pytest.raises(ValueError, match="output column.*: sample, logprobs$"):
        llm.generate_frame(df, prompt="p",
                           sampling_params=batchllm.SamplingParams(n=2, logprobs=1))
