"""A step's log-probabilities leave their tensors when the step's ids are read (issue 27: kept
until a step's last row finished, the small tensors fragmented glibc's heap), in both step
loops, and the records are the tensors' values."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hf_reference import tiny_model_folder

from batchllm import LLM, SamplingParams
from batchllm.engine import step_logprobs
from batchllm.engine.sampler import token_logprobs


@pytest.mark.parametrize("overlap", [False, True])
def test_steps_are_lists_before_any_row_reads_them(overlap: bool, monkeypatch) -> None:
    held = []  # per record read: whether its step still held tensors
    record = step_logprobs.StepLogprobs.record

    def spy(self, i, k):
        held.append(self._tensors is not None)
        return record(self, i, k)

    monkeypatch.setattr(step_logprobs.StepLogprobs, "record", spy)
    llm = LLM(str(tiny_model_folder("llama")), dtype="float32", device="cpu", overlap=overlap)
    rng = np.random.default_rng(3)
    rows = [rng.integers(5, 4000, 6 + i % 3).tolist() for i in range(6)]
    outs = llm.generate(rows, [SamplingParams(max_tokens=2 + i % 4, temperature=0.7, seed=i,
                                              logprobs=3) for i in range(6)])
    assert [len(o.logprobs) for o in outs] == [2 + i % 4 for i in range(6)]
    assert held and not any(held), "a row read its step's records from tensors kept alive"


def test_records_are_the_tensors_values() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g)
    logits[2, 3:] = float("-inf")  # row 2: 3 allowed, k 5 -> 3 alternatives kept
    tokens = torch.tensor([7, 2, 1, 40])
    step = token_logprobs(logits, [1.0, 0.5, 0.0, 2.0], tokens, [5, 5, 5, 2])
    lp = torch.log_softmax(logits / torch.tensor([1.0, 0.5, 1.0, 2.0])[:, None], dim=-1)
    step.to_host()
    assert step._tensors is None
    for i, k in enumerate([5, 5, 5, 2]):
        rec = step.record(i, k)
        top_lp, top_id = lp[i].topk(k)
        want = [(t, v) for t, v in zip(top_id.tolist(), top_lp.tolist()) if v != float("-inf")]
        assert rec.token_id == int(tokens[i]) and rec.logprob == lp[i, tokens[i]].item()
        assert rec.top == want
    assert len(step.record(2, 5).top) == 3
