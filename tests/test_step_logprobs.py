"""A step's log-probabilities leave their tensors when the step's ids are read, and the step
itself goes once its records are in the LogprobLog (issue 27: steps kept until their last row
finished fragmented glibc's heap), in both step loops; the records a row takes out are the
tensors' values."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from hf_reference import tiny_model_folder

from batchllm import LLM, SamplingParams
from batchllm.engine.logprob_log import LogprobLog
from batchllm.engine.row_slots import RowSlots
from batchllm.engine.sampler import token_logprobs
from batchllm.engine.step_logprobs import StepLogprobs
from batchllm.sampling_params import SamplingParams as Params


@pytest.mark.parametrize("overlap", [False, True])
def test_steps_are_let_go_once_their_records_are_logged(overlap: bool, monkeypatch) -> None:
    seen = []  # per step logged: whether it still held tensors
    add = LogprobLog.add

    def spy(self, step, *rest):
        add(self, step, *rest)
        seen.append(step._tensors is not None)

    monkeypatch.setattr(LogprobLog, "add", spy)
    llm = LLM(str(tiny_model_folder("llama")), dtype="float32", device="cpu", overlap=overlap)
    rng = np.random.default_rng(3)
    rows = [rng.integers(5, 4000, 6 + i % 3).tolist() for i in range(6)]
    outs = llm.generate(rows, [SamplingParams(max_tokens=2 + i % 4, temperature=0.7, seed=i,
                                              logprobs=3) for i in range(6)])
    assert [len(o.logprobs) for o in outs] == [2 + i % 4 for i in range(6)]
    gc.collect()
    assert seen and not any(seen), "a step kept its tensors once logged"
    alive = [o for o in gc.get_objects() if type(o) is StepLogprobs]
    assert not alive, "a step outlived the logging of its records"


def test_records_are_the_tensors_values() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g)
    logits[2, 3:] = float("-inf")  # row 2: 3 allowed, k 5 -> 3 alternatives kept
    tokens = torch.tensor([7, 2, 1, 40])
    lp = torch.log_softmax(logits / torch.tensor([1.0, 0.5, 1.0, 2.0])[:, None], dim=-1)
    step = token_logprobs(logits, [1.0, 0.5, 0.0, 2.0], tokens, [5, 5, 5, 2])  # overwrites
    assert torch.equal(logits, lp)  # them: no [4, 50] temporaries
    slots = RowSlots(4)
    taken = [slots.take(3, Params(logprobs=5)) for _ in range(4)]
    log = LogprobLog(slots, capacity=2)  # compacted to make room
    log.add(step, np.arange(4), np.array(taken), np.zeros(4, dtype=np.int64))
    assert step._tensors is None
    records = log.take(np.array(taken), np.ones(4, dtype=np.int64), np.array([5, 5, 5, 2]))
    for i, k in enumerate([5, 5, 5, 2]):
        (rec,) = records[i]
        top_lp, top_id = lp[i].topk(k)
        want = [(t, v) for t, v in zip(top_id.tolist(), top_lp.tolist()) if v != float("-inf")]
        assert rec.token_id == int(tokens[i]) and rec.logprob == lp[i, tokens[i]].item()
        assert rec.top == want
    assert len(records[2][0].top) == 3
