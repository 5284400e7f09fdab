"""engine.overlap: the step loop one step ahead gives every row the same tokens, text, finish
reason, counts and log-probabilities as without it, on tiny random models: sharing on and off,
chunked prefill, preemption, stop strings, end-of-sequence stops, temperature sampling, n
samples, a grammar row; and it does take effect (step N+1 launched before step N's ids are
read)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from hf_reference import tiny_model_folder
from test_engine_equivalence import nested_prompts

from batchllm import LLM, SamplingParams
from batchllm.engine import future_tokens

BYTES_PER_TOKEN = 512  # the tiny Llama: 2 layers x 2 KV heads x 16 x (K, V) x fp32


@functools.cache
def engine(overlap: bool, **settings) -> LLM:
    settings.setdefault("kv_cache_memory", 64 << 20)
    return LLM(str(tiny_model_folder("llama")), dtype="float32", device="cpu", overlap=overlap,
               **settings)


def params(stops: bool = True, **extra) -> list[SamplingParams]:
    """Mixed rows: greedy and temperature 0.7, logprobs on some, lengths 8-11, stop strings on
    a third (taken from what the row generates, so that they hit mid-output)."""
    out = []
    found = _stops() if stops else []
    for i in range(len(nested_prompts())):
        stop = (found[i],) if stops and i % 3 == 0 and found[i] else ()
        out.append(SamplingParams(max_tokens=8 + i % 4, temperature=0.7 * (i % 2), seed=i,
                                  logprobs=2 if i % 3 == 1 else 0, stop=stop, **extra))
    return out


def _stop_strings() -> list[str]:
    llm = engine(False)
    outs = llm.generate(nested_prompts(), [SamplingParams(max_tokens=8, ignore_eos=True)]
                        * len(nested_prompts()))
    return [llm.tokenizer.decode(o.token_ids[3:5]).strip()[:3] for o in outs]


_STOPS: list[str] = []


def _stops() -> list[str]:
    """_stop_strings(), found once: whichever test of the module a worker runs first (a test
    that built its rows before any run found none: IndexError, on the workers where it ran
    first)."""
    if not _STOPS:
        _STOPS.extend(_stop_strings())
    return _STOPS


def run(overlap: bool, sampling=None, **settings) -> tuple[list, dict]:
    llm = engine(overlap, **settings)
    outs = llm.generate(nested_prompts(), sampling or params())
    values = [[lp.logprob for lp in o.logprobs or []] for o in outs]
    rows = [(o.token_ids, o.text, o.finish_reason, o.prompt_tokens, o.cached_tokens,
             [(lp.token_id, [t for t, _ in lp.top]) for lp in o.logprobs or []],
             [(c.token_ids, c.finish_reason) for c in o.outputs]) for o in outs]
    return (rows, values), llm.last_metrics


def assert_same(sampling=None, **settings) -> dict:
    (off, lp_off), m_off = run(False, sampling, **settings)
    (on, lp_on), m_on = run(True, sampling, **settings)
    for i, (a, b) in enumerate(zip(off, on)):
        assert a == b, f"row {i} differs with overlap"
    # the values to float32 rounding: a row's logits may come from a batch of another size
    for a, b in zip(lp_off, lp_on):
        assert a == pytest.approx(b, abs=1e-4)
    keys = ["completion_tokens", "tree_tokens", "cached_tokens"]
    if not m_on["preemptions"] + m_off["preemptions"]:  # (else recomputes may differ)
        keys.append("prefill_tokens")
    for key in keys:
        assert m_on[key] == m_off[key], key
    assert m_off["steps_overlapped"] == 0
    assert m_on["steps_overlapped"] > 0
    return m_on


SETTINGS = {
    "sharing": {},
    "no_sharing": {"prefix_sharing": False},
    "chunked": {"max_batched_tokens": 13},
    "preemption": {"kv_cache_memory": 24 * 4 * BYTES_PER_TOKEN, "page_size": 4,
                   "max_batched_tokens": 16},
    "preemption_no_sharing": {"kv_cache_memory": 21 * 4 * BYTES_PER_TOKEN, "page_size": 4,
                              "prefix_sharing": False},
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow)
                                  if n == "preemption_no_sharing" else n for n in SETTINGS])
def test_same_rows_with_overlap(name: str) -> None:
    m = assert_same(**SETTINGS[name])
    if name == "sharing":
        assert m["prefill_tokens"] == m["tree_tokens"]
    if name.startswith("preemption"):
        assert m["preemptions"] > 0


def test_same_rows_with_end_of_sequence_stops() -> None:
    """The two tokens the model most often picks made ends of sequence: rows stop at varied
    steps, known one step late with overlap."""
    ref = engine(False).generate(nested_prompts(), SamplingParams(max_tokens=10,
                                                                  ignore_eos=True))
    counts: dict[int, int] = {}
    for o in ref:
        for t in o.token_ids[1:]:
            counts[t] = counts.get(t, 0) + 1
    eos = sorted(counts, key=counts.get)[-2:]  # the two most frequent
    for overlap in (False, True):
        e = engine(overlap).runtime.engine
        saved = (e._eos, e.stopper.eos_ids)
        e._eos = np.array(sorted({*e._eos.tolist(), *eos}), dtype=np.int64)
        e.stopper.eos_ids = {*e.stopper.eos_ids, *eos}
        try:
            got = run(overlap, params(stops=False))
        finally:
            e._eos, e.stopper.eos_ids = saved
        if not overlap:
            off = got
    assert got[0][0] == off[0][0]
    assert sum(r[2] == "stop" for r in off[0][0]) >= 3  # some rows did stop early


def test_same_rows_with_n_samples() -> None:
    assert_same(params(n=2))


def test_a_grammar_row_holds_the_overlap() -> None:
    """A row with a choice constraint: same outputs; the steps in which it samples are not
    overlapped (its mask needs the previous token)."""
    sp = params()
    sp[2] = SamplingParams(max_tokens=12, choice=("yes", "no", "maybe"))
    sp[5] = SamplingParams(max_tokens=12, temperature=0.7, seed=3,
                           json_schema={"type": "object", "properties": {"a": {"type": "integer"}},
                                        "required": ["a"]})
    m = assert_same(sp)
    assert m["steps_overlapped"] < m["steps"] - 1


def test_step_n_plus_1_is_launched_before_step_n_is_read(monkeypatch) -> None:
    """The call order: with overlap, the next step's forward is launched between a step's ids
    being issued and their being read on the host; without it, never."""
    ahead = {}
    for overlap in (False, True):
        events: list[tuple[str, int]] = []
        llm = engine(overlap)
        runner = llm.runtime.engine.runner
        forward, issue, read = (runner.forward_step, future_tokens.FutureTokens.issue,
                                future_tokens.Issued.read)

        def logged_forward(*args, forward=forward, events=events):
            events.append(("forward", 0))
            return forward(*args)

        def logged_issue(self, tokens, issue=issue, events=events):
            out = issue(self, tokens)
            events.append(("issue", id(out)))
            return out

        def logged_read(self, read=read, events=events):
            events.append(("read", id(self)))
            return read(self)

        monkeypatch.setattr(runner, "forward_step", logged_forward)
        monkeypatch.setattr(future_tokens.FutureTokens, "issue", logged_issue)
        monkeypatch.setattr(future_tokens.Issued, "read", logged_read)
        llm.generate(nested_prompts()[:4], SamplingParams(max_tokens=6, ignore_eos=True))
        monkeypatch.undo()
        issued_at = {}
        ahead[overlap] = 0
        for k, (what, key) in enumerate(events):
            if what == "issue":
                issued_at[key] = k
            elif what == "read":
                ahead[overlap] += ("forward", 0) in events[issued_at[key]:k]
    assert ahead[False] == 0
    assert ahead[True] >= 5  # 6 tokens a row: at least 5 steps read one step late


@pytest.mark.slow
def test_same_rows_with_overlap_on_the_triton_path(monkeypatch) -> None:
    """The CUDA path's runner (placeholders resolved in its staged buffers), in the Triton
    interpreter: a small greedy and sampled job, with sharing and chunked prefill."""
    pytest.importorskip("triton")
    monkeypatch.setenv("BATCHLLM_BACKEND", "triton")
    prompts = nested_prompts()[:5]
    sp = [SamplingParams(max_tokens=5, temperature=0.7 * (i % 2), seed=i,
                         logprobs=2 * (i == 1)) for i in range(5)]
    got = []
    for overlap in (False, True):
        llm = LLM(str(tiny_model_folder("llama")), dtype="float32", device="cpu",
                  kv_cache_memory=64 << 20, max_batched_tokens=32, overlap=overlap)
        outs = llm.generate(prompts, sp)
        got.append(([(o.token_ids, o.finish_reason, o.cached_tokens) for o in outs],
                    llm.last_metrics["steps_overlapped"] > 0))
    assert got[0][0] == got[1][0]
    assert got[1][1] and not got[0][1]


@pytest.mark.slow  # the fast lane keeps the grid's preemption case above
def test_a_row_stopped_once_preempted_gives_its_prefix_pin_back(monkeypatch) -> None:
    """With overlap a stop is read one step late; a row preempted in that step finishes from
    the waiting queue, and the pin its preemption took on its shared prefix must go too (it
    stayed: the prefix's pages in use after the job). Same rows as without overlap."""
    from batchllm.engine.scheduler import Scheduler

    rng = np.random.default_rng(0)
    base = rng.integers(5, 4000, 40).tolist()
    prompts = [base[: 8 + (i % 5) * 6] + rng.integers(5, 4000, 3 + i % 7).tolist()
               for i in range(30)] + [base[:20]] * 2 + [base[:33]]
    sp = [SamplingParams(max_tokens=3 + i % 9, temperature=0.7 if i % 2 else 0.0, seed=i,
                         ignore_eos=i % 4 != 0, stop=["a", "e"] if i % 5 == 0 else [],
                         n=2 if i % 11 == 0 else 1) for i in range(len(prompts))]
    late = []
    finish = Scheduler.finish_many

    def spy(self, seqs):
        late.extend(s for s in seqs if s not in self.running)
        finish(self, seqs)

    monkeypatch.setattr(Scheduler, "finish_many", spy)
    got = {}
    for overlap in (False, True):
        llm = LLM(str(tiny_model_folder("llama")), dtype="float32", device="cpu", page_size=4,
                  max_batched_tokens=16, kv_cache_memory=48 << 10, overlap=overlap,
                  max_num_seqs=8)
        got[overlap] = [[(c.token_ids, c.finish_reason) for c in o.outputs]
                        for o in llm.generate(prompts, sp)]
        assert llm.last_metrics["preemptions"] > 0
    assert late, "no row finished from the waiting queue"
    assert got[True] == got[False]
