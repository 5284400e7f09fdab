"""Admission in bursts (Scheduler.burst, issue 28 item 3): where steps replay CUDA graphs, rows
are admitted while others decode only once enough slots are free, so that most steady-state
steps are decode-only, the steps a graph replays. Every row's tokens, finish reason and counts
are the same as with admission at every step; prefill_tokens == tree_tokens still; and the
decode-only steps do rise on a shared-prefix job. On the CPU path with the rule forced on (its
default is off there), and on the CUDA path in the Triton interpreter, where the decode-only
steps are counted as DecodeGraphs.replay calls, and a greedy step's graph ends in the argmax."""

from __future__ import annotations

import functools

import pytest
import torch
from hf_reference import tiny_model_folder
from test_engine_equivalence import nested_prompts

from batchllm import LLM, SamplingParams

BYTES_PER_TOKEN = 512  # the tiny Llama: 2 layers x 2 KV heads x 16 x (K, V) x fp32


def shared_prefix_job(copies: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """`copies` sets of nested prompts (15 rows each: system > template > document >
    question); lengths 8-20 so that rows finish at different steps; greedy and temperature
    0.7, logprobs on some."""
    prompts = [p for seed in range(copies) for p in nested_prompts(seed)]
    sp = [SamplingParams(max_tokens=8 + (i * 7) % 13, ignore_eos=True, seed=i,
                         temperature=0.7 * (i % 2), logprobs=2 * (i % 5 == 1))
          for i in range(len(prompts))]
    return prompts, sp


@functools.cache
def cpu_engine(**settings) -> LLM:
    settings.setdefault("kv_cache_memory", 64 << 20)
    return LLM(str(tiny_model_folder("llama")), dtype="float32", device="cpu", **settings)


def run(llm: LLM, burst: int, prompts, sp, monkeypatch) -> tuple[list, dict, list[bool]]:
    """The rows' outputs, the metrics and, per forward step, whether it was decode-only."""
    engine = llm.runtime.engine
    runner = engine.runner
    forward = runner.forward_step
    decode_only: list[bool] = []

    def counted(slots, counts, *args, **kwargs):
        decode_only.append(bool((counts == 1).all()))
        return forward(slots, counts, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(runner, "forward_step", counted)
        patch.setattr(engine, "burst", burst)
        outs = llm.generate(prompts, sp)
    rows = [(o.token_ids, o.finish_reason, o.prompt_tokens, o.cached_tokens,
             [lp.token_id for lp in o.logprobs or []]) for o in outs]
    return rows, llm.last_metrics, decode_only


SETTINGS = {
    "sharing": {"max_num_seqs": 16},
    "chunked": {"max_num_seqs": 16, "max_batched_tokens": 24},
    "overlap": {"max_num_seqs": 16, "overlap": True},
    "preemption": {"max_num_seqs": 16, "page_size": 4, "max_batched_tokens": 32,
                   "kv_cache_memory": 60 * 4 * BYTES_PER_TOKEN},
}


# the fast lane keeps sharing and overlap (each ~12 s on a 2-core machine)
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow)
                                  if n in ("preemption", "chunked") else n for n in SETTINGS])
def test_bursts_give_the_same_rows_and_more_decode_only_steps(name: str, monkeypatch) -> None:
    prompts, sp = shared_prefix_job(4)
    llm = cpu_engine(**SETTINGS[name])
    assert llm.runtime.engine.burst == 0  # the CPU path: admission at every step
    every, m_every, decode_every = run(llm, 0, prompts, sp, monkeypatch)
    bursts, m_bursts, decode_bursts = run(llm, 4, prompts, sp, monkeypatch)
    for i, (a, b) in enumerate(zip(every, bursts)):
        assert a == b, f"row {i} differs with admission in bursts"
    for key in ("completion_tokens", "tree_tokens", "cached_tokens"):
        assert m_bursts[key] == m_every[key], key
    if name == "preemption":  # the pages bind, not the slots: the same steps either way
        assert m_every["preemptions"] > 0 and m_bursts["preemptions"] > 0
        return
    assert m_every["prefill_tokens"] == m_every["tree_tokens"]
    assert m_bursts["prefill_tokens"] == m_bursts["tree_tokens"]
    # admission at every step: a row admitted whenever one finishes, most steps mixed
    assert sum(decode_bursts) > sum(decode_every) + 5, (sum(decode_every), sum(decode_bursts))
    assert sum(decode_bursts) / len(decode_bursts) > sum(decode_every) / len(decode_every)


def test_a_burst_waits_only_for_what_can_come() -> None:
    """The rule alone: while rows decode, admission waits until `burst` slots are free, or
    until every waiting row fits; a step that is mixed anyway admits at once."""
    from batchllm.engine.pages import PagePool
    from batchllm.engine.request import Kind, Request
    from batchllm.engine.row_slots import RowSlots
    from batchllm.engine.scheduler import Scheduler

    slots = RowSlots(16)
    sched = Scheduler(PagePool(64), 4, 4, 64, state=slots, burst=2)

    def row(key: int, n: int) -> Request:
        return Request(Kind.ROW, key, list(range(5, 5 + n)), n, parent=-1, state=slots)

    def step() -> list[int]:
        plan = sched.schedule()
        sched.step_done(plan)
        for s in plan.slots.tolist():  # each that ran to its end takes one new token
            if slots.computed[s] == slots.total[s]:
                slots.owner[s].append(7)
        return [slots.owner[s].key for s in plan.slots.tolist() if plan.counts[
            plan.slots.tolist().index(s)] > 1]

    for k in range(6):
        sched.add(row(k, 3))
    assert step() == [0, 1, 2, 3]  # nothing ran: admitted at once, 4 slots
    assert step() == []
    sched.finish(sched.running[0])  # one slot free, two wait: no admission
    assert step() == [] and len(sched.waiting) == 2
    sched.finish(sched.running[0])  # two free: both come
    assert step() == [4, 5] and not sched.waiting
    sched.add(row(6, 3))
    sched.finish(sched.running[0])  # one free, one waits: all that wait fit
    assert step() == [6]
    sched.finish(sched.running[0])
    sched.finish(sched.running[0])  # two free, four wait: a burst; row 7 takes the budget
    for k, n in ((7, 70), (8, 3), (9, 3), (10, 3)):
        sched.add(row(k, n))
    assert step() == [7]
    # one free, three wait, but row 7's last chunk runs: the step is mixed, row 8 comes
    assert step() == [7, 8]


def test_the_rule_is_on_where_graphs_replay(monkeypatch) -> None:
    """Engine.burst: an eighth of max_num_seqs on the CUDA path with graphs; 0 (admission at
    every step, as the CPU path's tests assert) without them and on the CPU path."""
    assert cpu_engine(max_num_seqs=32).runtime.engine.burst == 0
    pytest.importorskip("triton")
    monkeypatch.setenv("BATCHLLM_BACKEND", "triton")
    for graphs, expected in ((True, 4), (False, 0)):
        llm = LLM(str(tiny_model_folder("llama")), dtype="float32", device="cpu",
                  kv_cache_memory=16 << 20, max_num_seqs=32, cuda_graphs=graphs)
        assert llm.runtime.engine.burst == expected


@pytest.mark.slow
def test_bursts_and_greedy_graphs_on_the_triton_path(monkeypatch) -> None:
    """The CUDA path in the Triton interpreter, graphs' static path run eagerly: the same rows
    with admission at every step, in bursts, and with no graphs at all (the eager logits and
    the sampler's argmax: a greedy step's in-graph argmax gives the same ids); more steps go
    through DecodeGraphs.replay with bursts; greedy steps replay their greedy graphs and hand
    back ids, no logits. On a GPU (scripts/gpu_check.sh) the same, the graphs captured."""
    pytest.importorskip("triton")
    monkeypatch.setenv("BATCHLLM_BACKEND", "triton")
    from batchllm.engine.device_runner import DeviceRunner

    device = "cuda" if torch.cuda.is_available() else "cpu"  # on CUDA: graphs captured

    prompts = nested_prompts()[:12]
    sp = [SamplingParams(max_tokens=3 + i % 4, ignore_eos=True, seed=i,
                          temperature=0.7 * (i % 4 == 3)) for i in range(len(prompts))]
    got, replays = {}, {}
    for name, graphs, burst in (("every", True, 0), ("bursts", True, 2), ("eager", False, 0)):
        llm = LLM(str(tiny_model_folder("llama")), dtype="float32", device=device,
                  kv_cache_memory=16 << 20, max_num_seqs=4, max_batched_tokens=64,
                  cuda_graphs=graphs)
        runner = llm.runtime.engine.runner
        assert isinstance(runner, DeviceRunner)
        keys, outputs = [], []
        with monkeypatch.context() as patch:
            if graphs:
                replay = runner.graphs.replay
                patch.setattr(runner.graphs, "replay",
                              lambda key, keys=keys, replay=replay: keys.append(key) or
                              replay(key))
            patch.setattr(runner, "forward_step",
                          lambda *a, out=outputs, forward=runner.forward_step:
                          out.append(forward(*a)) or out[-1])
            patch.setattr(llm.runtime.engine, "burst", burst)
            outs = llm.generate(prompts, sp)
        got[name] = [(o.token_ids, o.finish_reason, o.cached_tokens) for o in outs]
        replays[name] = keys
        if graphs:  # greedy steps: ids from the graph, no logits; the others logits
            greedy = [k for k in keys if k[2]]
            assert greedy and len(greedy) < len(keys), keys
            assert sum(o.tokens is not None for o in outputs) == len(greedy)
            assert all(o.logits is None for o in outputs if o.tokens is not None)
        else:
            assert all(o.tokens is None for o in outputs)
    assert got["bursts"] == got["every"] == got["eager"]
    assert len(replays["bursts"]) > len(replays["every"]), {k: len(v) for k, v in
                                                              replays.items()}
