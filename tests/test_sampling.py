"""Sampling: reproducible per row whatever the batch or order, top-k/top-p, stop strings."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hf_reference import tiny_model_folder

from batchllm import LLM, SamplingParams
from batchllm.engine.sampler import filtered_probs, row_key, sample_ids, uniform, uniforms
from batchllm.rows.record import Row


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(tiny_model_folder("llama")), dtype="float32", device="cpu")


def prompts(n: int = 8) -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    shared = rng.integers(5, 4000, 30).tolist()
    return [np.asarray(shared + rng.integers(5, 4000, 1 + i % 5).tolist(), np.int32)
            for i in range(n)]


def run_rows(llm: LLM, order: list[int], sp: SamplingParams) -> dict[str, list[int]]:
    ps = prompts()
    rows = [Row(k, f"row-{i}", ps[i], sp) for k, i in enumerate(order)]
    out: dict[str, list[int]] = {}
    llm.runtime.run_rows(rows, lambda row: out.__setitem__(row.id, row.token_ids))
    return out


def test_temperature_sampling_is_the_same_whatever_the_batch_or_order(llm: LLM) -> None:
    sp = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=7,
                        ignore_eos=True)
    together = run_rows(llm, list(range(8)), sp)
    reversed_ = run_rows(llm, list(range(7, -1, -1)), sp)
    alone = {}
    for i in range(8):
        alone.update(run_rows(llm, [i], sp))
    assert together == reversed_ == alone
    # The draws are random: rows differ from greedy and from each other's seeds.
    other_seed = run_rows(llm, list(range(8)), SamplingParams(
        max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=8, ignore_eos=True))
    assert other_seed != together
    greedy = run_rows(llm, list(range(8)), SamplingParams(max_tokens=12, ignore_eos=True))
    assert greedy != together


def test_top_k_one_is_greedy(llm: LLM) -> None:
    greedy = run_rows(llm, list(range(8)), SamplingParams(max_tokens=8, ignore_eos=True))
    top1 = run_rows(llm, list(range(8)), SamplingParams(
        max_tokens=8, temperature=0.8, top_k=1, ignore_eos=True))
    assert greedy == top1


def test_draws_follow_the_filtered_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]])
    probs, ids = filtered_probs(logits, torch.tensor([1.0]), torch.tensor([0]),
                                torch.tensor([1.0]))
    expected = torch.softmax(logits[0], -1)
    assert torch.allclose(probs[0], expected[ids[0]])
    # top_p 0.8 keeps the smallest set of most likely tokens whose mass reaches 0.8
    probs, ids = filtered_probs(logits, torch.tensor([1.0]), torch.tensor([0]),
                                torch.tensor([0.8]))
    kept = ids[0][probs[0] > 0].tolist()
    sorted_p = expected.sort(descending=True)
    need = int((sorted_p.values.cumsum(0) < 0.8).sum()) + 1
    assert kept == sorted_p.indices[:need].tolist()
    # uniforms: in [0, 1), and about uniform
    key = row_key(0, "x")
    u = np.array([uniform(key, n) for n in range(20000)])
    assert 0 <= u.min() and u.max() < 1
    assert abs(u.mean() - 0.5) < 0.01
    assert row_key(0, "x") != row_key(1, "x") != row_key(0, "y")


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (3, 1.0), (0, 0.75)])
def test_sampled_tokens_follow_the_distribution(top_k: int, top_p: float) -> None:
    """20,000 draws of one row (its counter 0..19,999) at temperature 0.7: each token's frequency
    is its probability after temperature, top-k and top-p, within five standard errors. The
    unfiltered case draws in token-id order without a sort, the others from the sorted,
    filtered distribution."""
    logits = torch.tensor([0.3, 2.0, -1.0, 1.0, 0.5, 1.9])
    n, t = 20000, 0.7
    draws = sample_ids(logits.expand(n, -1).contiguous(), [t] * n, [top_k] * n, [top_p] * n,
                       [row_key(3, "r")] * n, list(range(n))).tolist()
    p = torch.softmax(logits.double() / t, -1)
    order = p.argsort(descending=True)
    kept = torch.zeros_like(p, dtype=torch.bool)
    mass = 0.0
    for rank, tok in enumerate(order.tolist()):
        if (top_k and rank >= top_k) or (rank > 0 and mass >= top_p):
            break
        kept[tok] = True
        mass += float(p[tok])
    want = torch.where(kept, p, 0.0) / p[kept].sum()
    got = torch.bincount(torch.tensor(draws), minlength=len(logits)).double() / n
    se = (want * (1 - want) / n).sqrt()
    assert torch.all((got - want).abs() <= 5 * se + 1e-12), (got, want)


def test_stop_string_across_tokens_is_cut(llm: LLM) -> None:
    ids = prompts(1)
    free = llm.generate([ids[0]], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    tok = llm.tokenizer
    pieces = [tok.decode(free.token_ids[:k], skip_special_tokens=True) for k in range(21)]
    # a stop string that starts inside one token's text and ends inside a later one
    k = next(k for k in range(3, 18) if len(pieces[k]) - len(pieces[k - 1]) >= 2
             and len(pieces[k + 1]) > len(pieces[k]))
    start = len(pieces[k]) - 1
    stop = pieces[k + 1][start : start + 2]
    assert len(stop) == 2
    first = pieces[-1].find(stop)
    out = llm.generate([ids[0]], SamplingParams(max_tokens=20, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == pieces[-1][:first]
    assert stop not in out.text
    assert len(out.token_ids) <= k + 2


def test_bad_sampling_and_too_long_prompts_become_error_rows(llm: LLM) -> None:
    ps = prompts(3)
    too_long = np.arange(llm.max_model_len + 5, dtype=np.int32) % 4000
    outs = llm.generate(
        [ps[0], too_long, ps[1], ps[2]],
        [SamplingParams(max_tokens=4), SamplingParams(max_tokens=4),
         SamplingParams(max_tokens=4, temperature=-1.0), SamplingParams(max_tokens=4)],
    )
    assert [o.finish_reason for o in outs] == ["length", "error", "error", "length"]
    assert "tokens" in outs[1].error and "max_model_len" in outs[1].error
    assert "temperature" in outs[2].error


def test_vectorised_uniforms_are_the_scalar_ones_bit_for_bit() -> None:
    """sampler.uniforms (the engine's draws, over a step's rows at once) equals uniform."""
    keys = [row_key(s, f"r{i}", i % 3) for s in range(4) for i in range(50)] + [0, (1 << 64) - 1]
    counters = [(i * 7919) % 100_003 for i in range(len(keys))]
    got = uniforms(np.array(keys, dtype=np.uint64), np.array(counters, dtype=np.int64))
    assert got.tolist() == [uniform(k, c) for k, c in zip(keys, counters)]


def test_row_chunks_give_the_whole_batchs_tokens_and_logprobs_bit_for_bit(monkeypatch) -> None:
    """On the CPU sample_ids and token_logprobs work in row chunks (sampler.row_chunks): the
    same bits as the batch in one piece, for greedy, plain, top-k and top-p rows mixed, with
    chunks of 3 rows against one of 40 (a wrong chunk's temperature, key or row index fails)."""
    from batchllm.engine import sampler

    rows, vocab = 40, 1000
    logits = torch.from_numpy(np.random.default_rng(5).standard_normal((rows, vocab))
                              .astype(np.float32) * 4)
    i = np.arange(rows)
    temperature = np.where(i % 4 == 0, 0.0, 0.5 + (i % 3) * 0.4)
    top_k, top_p = np.where(i % 3 == 1, 20, 0), np.where(i % 5 == 2, 0.8, 1.0)
    keys, counters = np.asarray([row_key(3, r) for r in i], np.uint64), i * 7

    def both(chunk_bytes: int):
        monkeypatch.setattr(sampler, "_CPU_CHUNK_BYTES", chunk_bytes)
        ids = sample_ids(logits, temperature, top_k, top_p, keys, counters)
        return ids, sampler.token_logprobs(logits.clone(), temperature, ids, [5] * rows).arrays()

    assert len(sampler.row_chunks(rows, vocab, logits.device)) == 1
    assert sampler.row_chunks(0, vocab, logits.device) == []  # an empty group: nothing to run
    ids_whole, lp_whole = both(1 << 30)
    monkeypatch.setattr(sampler, "_CPU_CHUNK_BYTES", 3 * 8 * vocab)
    assert len(sampler.row_chunks(rows, vocab, logits.device)) == 14
    ids_chunked, lp_chunked = both(3 * 8 * vocab)
    assert torch.equal(ids_whole, ids_chunked)
    for a, b in zip(lp_whole, lp_chunked):
        assert np.array_equal(a, b)
    assert len(set(ids_whole.tolist())) > rows // 2  # the draws vary: not one token throughout
