"""polars frames through the Python API: LLM.generate_frame adds the output columns, row for row,
with the same results as generate and chat."""

from __future__ import annotations

import polars as pl
import pytest
from hf_reference import tiny_model_folder

import batchllm

SP = batchllm.SamplingParams(max_tokens=5, temperature=0.0)
OUTPUT = ["completion", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
          "error"]


@pytest.fixture(scope="module")
def llm() -> batchllm.LLM:
    return batchllm.LLM(str(tiny_model_folder("llama")), device="cpu", kv_cache_memory=64 << 20)


def test_prompt_column_gets_generate_results(llm):
    prompts = ["The lease ends when", None, "Either party may", "   "]
    df = pl.DataFrame({"key": [10, 11, 12, 13], "prompt": prompts})
    out = llm.generate_frame(df, prompt="prompt", sampling_params=SP)
    assert out.columns == ["key", "prompt", *OUTPUT]
    assert out.get_column("key").to_list() == [10, 11, 12, 13]
    assert out.schema["prompt_tokens"] == pl.Int32 and out.schema["completion"] == pl.String
    ref = llm.generate([prompts[0], prompts[2]], SP)
    rows = out.to_dicts()
    for row, want in zip([rows[0], rows[2]], ref):
        assert (row["completion"], row["finish_reason"], row["prompt_tokens"]) == (
            want.text, want.finish_reason, want.prompt_tokens)
        assert row["error"] is None
    assert rows[1]["finish_reason"] == "error" and "null" in rows[1]["error"]
    assert rows[3]["finish_reason"] == "error" and "empty" in rows[3]["error"]
    assert rows[1]["completion"] is None


def test_messages_and_chat_template_match_chat(llm):
    convs = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
             [{"role": "user", "content": "Who pays the rent?"}]]
    out = llm.generate_frame(pl.DataFrame({"messages": convs}), messages="messages",
                             sampling_params=SP)
    assert out.get_column("completion").to_list() == [o.text for o in llm.chat(convs, SP)]
    questions = pl.DataFrame({"q": ["Hi", "Who pays the rent?"]})
    templated = llm.generate_frame(questions, prompt="q", chat_template=True, sampling_params=SP)
    wanted = llm.chat([[{"role": "user", "content": q}] for q in questions["q"]], SP)
    assert templated.get_column("completion").to_list() == [o.text for o in wanted]


def test_frame_mistakes_are_value_errors(llm):
    df = pl.DataFrame({"prompt": ["x"], "completion": ["old"]})
    with pytest.raises(ValueError, match="output column.*completion"):
        llm.generate_frame(df, prompt="prompt")
    with pytest.raises(ValueError, match="no column 'text'; columns are: prompt, completion"):
        llm.generate_frame(df, prompt="text")
    with pytest.raises(ValueError, match="one of prompt= or messages="):
        llm.generate_frame(df)
