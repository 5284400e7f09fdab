"""Range partitioning by leading tokens (batchllm/plan/partition.py), without Ray: keys sort as
token sequences, every row lands in one part, parts are contiguous runs of the sorted rows, the
tokens cut apart (longest common prefix across each cut) equal a brute-force count of distinct
prefixes per part, and the parts' costs are balanced."""

from __future__ import annotations

import random
from itertools import pairwise

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from test_shards import brute_duplicated, distinct_prefixes

from batchllm.plan.partition import (
    KEY_TOKENS,
    choose_cuts,
    common_tokens,
    route,
    row_key,
    sample_block,
)
from batchllm.rows.record import Row
from batchllm.sampling_params import SamplingParams

token_lists = st.lists(st.lists(st.integers(0, 70000), min_size=1, max_size=12), min_size=1,
                       max_size=40)


@settings(max_examples=200, deadline=None)
@given(token_lists)
def test_keys_sort_as_token_sequences_and_count_common_tokens(rows):
    keys = [row_key(np.array(r, np.int32)) for r in rows]
    assert sorted(range(len(rows)), key=keys.__getitem__) == sorted(
        range(len(rows)), key=lambda i: rows[i])
    for a, b in zip(rows, rows[1:] + rows[:1]):
        lcp = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common_tokens(row_key(np.array(a)), row_key(np.array(b))) == lcp


def test_key_stops_after_key_tokens():
    long = np.arange(KEY_TOKENS + 50, dtype=np.int32)
    assert row_key(long) == row_key(long[:KEY_TOKENS]) and len(row_key(long)) == 4 * KEY_TOKENS


def nested_rows(seed: int, n: int) -> list[Row]:
    """System prompt > 3 templates > documents > questions, with exact duplicates and max_tokens
    1..40, plus rows that cannot run."""
    rng = random.Random(seed)
    system = [rng.randrange(1000) for _ in range(30)]
    templates = [[rng.randrange(1000) for _ in range(rng.randrange(5, 40))] for _ in range(3)]
    docs = [[rng.randrange(1000) for _ in range(rng.randrange(10, 60))] for _ in range(12)]
    rows = []
    for i in range(n):
        if i % 17 == 5:
            rows.append(Row(i, i, None, SamplingParams(max_tokens=4), error="the prompt is null"))
            continue
        t, d = templates[rng.randrange(3)], docs[rng.randrange(12)]
        q = [rng.randrange(1000) for _ in range(rng.randrange(0, 8))]
        rows.append(Row(i, i, np.array(system + t + d + q, np.int32),
                        SamplingParams(max_tokens=rng.randrange(1, 41))))
    return rows


def blocks_of(rows: list[Row], size: int) -> list[list[Row]]:
    return [rows[lo : lo + size] for lo in range(0, len(rows), size)]


def test_parts_are_contiguous_balanced_and_count_cut_tokens_exactly():
    rows = nested_rows(0, 600)
    for num_parts in (2, 3, 5):
        samples = [sample_block(b, 16) for b in blocks_of(rows, 150)]
        uppers = choose_cuts(samples, num_parts)
        assert uppers == sorted(uppers) and len(set(uppers)) == len(uppers)
        part = np.concatenate([route(b, uppers) for b in blocks_of(rows, 150)])
        good = [i for i, r in enumerate(rows) if r.prompt_ids is not None]
        assert all(part[i] == 0 for i, r in enumerate(rows) if r.prompt_ids is None)
        # contiguous: in key order the part numbers never go down
        by_key = sorted(good, key=lambda i: row_key(rows[i].prompt_ids))
        assert np.all(np.diff(part[by_key]) >= 0)
        prompts = [rows[i].prompt_ids for i in good]
        members = [np.flatnonzero(part[good] == k) for k in range(num_parts)]
        # tokens computed on two parts = the common prefix across each cut, exactly
        cut = 0
        ends = [(row_key(prompts[m[0]]), row_key(prompts[m[-1]]))
                for m in (sorted(mm, key=lambda j: row_key(prompts[j])) for mm in members)
                if len(m)]
        for (_, last), (first, _) in pairwise(ends):
            cut += common_tokens(last, first)
        assert cut == brute_duplicated(prompts, members)
        # balanced: each part's own prefix tree + decode tokens near the mean
        cost = [distinct_prefixes([prompts[j] for j in m])
                + sum(int(rows[good[j]].sampling.max_tokens) for j in m) for m in members]
        assert max(cost) / np.mean(cost) < 1.15, cost


def test_equal_keys_never_split_and_few_keys_leave_parts_empty():
    same = [Row(i, i, np.array([5, 6, 7], np.int32), SamplingParams(max_tokens=9))
            for i in range(40)]
    uppers = choose_cuts([sample_block(same[:20], 8), sample_block(same[20:], 8)], 4)
    assert uppers == []
    assert set(route(same, uppers).tolist()) == {0}


def test_cut_prefers_the_boundary_that_shares_least():
    """Two templates of equal cost: the one cut between them shares 0 tokens, not the cut
    inside a template near the exact middle."""
    a = [Row(i, i, np.array([1, 2, 3, 4, 10 + i], np.int32), SamplingParams(max_tokens=5))
         for i in range(21)]
    b = [Row(i, i, np.array([9, 8, 7, 6, 10 + i], np.int32), SamplingParams(max_tokens=5))
         for i in range(19)]
    uppers = choose_cuts([sample_block(a + b, 64)], 2, tolerance=0.3)
    part = route(a + b, uppers)
    assert part[:21].tolist() == [0] * 21 and part[21:].tolist() == [1] * 19


def test_unsampled_rows_stay_with_their_subtree():
    """Sparse samples: the cut goes just below the common prefix of the sampled neighbours, so
    the rows of a subtree that no sample represents still land with it."""
    a = [Row(i, i, np.array([1, 2, 3, 50 + i], np.int32), SamplingParams(max_tokens=5))
         for i in range(31)]  # samples: every 15th row in key order, so not a's last row
    b = [Row(i, i, np.array([1, 2, 9, 50 + i], np.int32), SamplingParams(max_tokens=5))
         for i in range(29)]
    uppers = choose_cuts([sample_block(a + b, 4)], 2, tolerance=0.5)
    assert route(a + b, uppers).tolist() == [0] * 31 + [1] * 29
