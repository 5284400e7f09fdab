"""Sharding a plan (batchllm/plan/shards.py): every row in exactly one shard, balanced cost, and
duplicated prefix tokens equal to a brute-force count of distinct prefixes per shard."""

from __future__ import annotations

import numpy as np
import pytest

from batchllm.plan.planner import make_plan
from batchllm.plan.shards import make_shards

SYSTEM = list(range(100, 108))  # an 8-token prefix shared by every row of the nested job


def nested_job() -> list[np.ndarray]:
    """Two task prompts under one system prompt, each with questions; one unrelated row."""
    rows = []
    for task, body in ((1, [10, 11, 12, 13]), (2, [20, 21, 22, 23])):
        for q in range(6):
            rows.append(SYSTEM + body + [30 + q, 40 + q * task])
    rows.append(SYSTEM + [10, 11])  # stops inside task 1's prefix
    rows.append(SYSTEM + [10, 11, 12, 13, 30, 40])  # a duplicate of a row above
    rows.append([7, 8, 9])
    return [np.array(r, np.int32) for r in rows]


def distinct_prefixes(prompts: list[np.ndarray]) -> int:
    """Brute force: the number of distinct non-empty prefixes = tokens of their prefix tree."""
    return len({tuple(p[:k].tolist()) for p in prompts for k in range(1, len(p) + 1)})


def brute_duplicated(prompts: list[np.ndarray], shards: list[np.ndarray]) -> int:
    per_shard = sum(distinct_prefixes([prompts[i] for i in s]) for s in shards)
    return per_shard - distinct_prefixes(prompts)


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_nested_job_duplicated_tokens_match_brute_force(n):
    prompts = nested_job()
    plan = make_plan(prompts, 4)
    shards = make_shards(plan, n)
    shards.check(plan)
    assert shards.tree_tokens == distinct_prefixes(prompts)
    for k, rows in enumerate(shards.rows):
        assert shards.prefill_tokens[k] == distinct_prefixes([prompts[i] for i in rows])
    assert shards.duplicated_tokens == brute_duplicated(prompts, shards.rows)


def test_two_shards_of_one_shared_prefix_duplicate_it_exactly():
    prompts = nested_job()[:12]  # every row under SYSTEM, task 1 then task 2
    plan = make_plan(prompts, 4)
    shards = make_shards(plan, 2)
    # the cut lands between the tasks: only SYSTEM is computed twice
    assert sorted(map(len, shards.rows)) == [6, 6]
    assert shards.duplicated_tokens == len(SYSTEM)
    assert shards.split_nodes >= 1


def test_one_shard_is_the_whole_plan():
    prompts = nested_job()
    plan = make_plan(prompts, 4)
    shards = make_shards(plan, 1)
    assert len(shards.rows) == 1 and np.array_equal(shards.rows[0], np.arange(len(prompts)))
    assert shards.duplicated_tokens == 0 and shards.split_nodes == 0
    assert shards.prefill_tokens[0] == plan.tree_tokens


@pytest.mark.parametrize("order", ["prefix-tree", "input"])
@pytest.mark.parametrize("seed", range(6))
def test_random_jobs_rows_once_balanced_and_counted(seed, order):
    rng = np.random.default_rng(seed)
    heads = [rng.integers(0, 50, rng.integers(1, 30)) for _ in range(5)]
    prompts = []
    for _ in range(300):
        head = heads[rng.integers(0, len(heads))][: rng.integers(1, 31)]
        prompts.append(np.concatenate((head, rng.integers(0, 4, rng.integers(0, 6)))).astype(
            np.int32))
    max_tokens = rng.integers(1, 16, len(prompts))
    plan = make_plan(prompts, max_tokens, order=order)
    for n in (2, 4, 7):
        shards = make_shards(plan, n)
        shards.check(plan)  # every row in exactly one shard, figures from the plan
        assert shards.duplicated_tokens == brute_duplicated(prompts, shards.rows)
        cost = shards.cost
        assert cost.max() <= 1.25 * cost.mean(), shards.pretty()


def test_without_prefix_sharing_nothing_is_duplicated():
    prompts = nested_job()
    plan = make_plan(prompts, 4, prefix_sharing=False)
    shards = make_shards(plan, 3)
    shards.check(plan)
    assert shards.duplicated_tokens == 0
    assert shards.prefill_tokens.sum() == sum(len(p) for p in prompts)


def test_bad_arguments_and_empty_plan():
    plan = make_plan(nested_job(), 4)
    with pytest.raises(ValueError, match="num_shards"):
        make_shards(plan, 0)
    with pytest.raises(ValueError, match="tolerance"):
        make_shards(plan, 2, tolerance=0)
    empty = make_shards(make_plan([], 4), 3)
    assert [len(r) for r in empty.rows] == [0, 0, 0] and empty.duplicated_tokens == 0
