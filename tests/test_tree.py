"""PrefixTree against brute force (sets of prefixes, Python sorting) and hand-built examples."""

from __future__ import annotations

import os
from itertools import pairwise

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchllm.plan.arrays import RangeMin, concat_ranges, node_depths
from batchllm.plan.tree import PrefixTree


def arrays(prompts: list[list[int]]) -> list[np.ndarray]:
    return [np.array(p, np.int32) for p in prompts]


def brute_prefixes(prompts: list[list[int]]) -> set[tuple[int, ...]]:
    return {tuple(p[:i]) for p in prompts for i in range(1, len(p) + 1)}


def node_prefix(tree: PrefixTree, v: int) -> tuple[int, ...]:
    if v == 0:
        return ()
    return tuple(tree.prompt(int(tree.node_source[v]))[: tree.node_end[v]].tolist())


def assert_matches_brute_force(prompts: list[list[int]], tree: PrefixTree) -> None:
    tree.check()
    assert tree.tree_tokens == len(brute_prefixes(prompts))
    assert tree.order.tolist() == sorted(range(len(prompts)), key=lambda r: (prompts[r], r))
    for (a, b), lcp in zip(pairwise(tree.order), tree.lcp):
        pa, pb = prompts[a], prompts[b]
        k = next((i for i, (x, y) in enumerate(zip(pa, pb)) if x != y), min(len(pa), len(pb)))
        assert lcp == k
    for v in range(tree.num_nodes):
        pre = node_prefix(tree, v)
        under = [r for r, p in enumerate(prompts) if tuple(p[: len(pre)]) == pre]
        assert tree.node_rows[v] == len(under)
        assert tree.node_terminal[v] == sum(len(prompts[r]) == len(pre) for r in under)
    for r, p in enumerate(prompts):
        assert node_prefix(tree, tree.row_node[r]) == tuple(p)


prompt_lists = st.lists(st.lists(st.integers(0, 3), max_size=8), max_size=16)


@settings(max_examples=300, deadline=None)
@given(prompt_lists)
def test_random_small_vocab_matches_brute_force(prompts):
    assert_matches_brute_force(prompts, PrefixTree.build(arrays(prompts)))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=4),
       st.lists(st.tuples(st.integers(0, 3), st.integers(0, 90), st.integers(0, 2**31 - 1)),
                max_size=12))
def test_long_shared_prefixes_and_flat_form(stems, specs):
    # long stems (> the 64-token comparison window) with big token ids, then a short tail
    prompts = [([stems[s % len(stems)]] * 3 + list(range(cut)))[:cut] + [tail]
               for s, cut, tail in specs]
    tree = PrefixTree.build(arrays(prompts))
    assert_matches_brute_force(prompts, tree)
    lens = np.array([len(p) for p in prompts], np.int64)
    flat = np.array([t for p in prompts for t in p], np.int32)
    flat_tree = PrefixTree.build(flat, np.concatenate(([0], np.cumsum(lens))))
    for name in ("order", "lcp", "node_parent", "node_end", "node_first", "row_node"):
        assert np.array_equal(getattr(tree, name), getattr(flat_tree, name)), name


def test_exact_structure_of_a_small_job():
    prompts = [[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 2, 3], [1, 2, 3], [7, 8], [1, 9]]
    tree = PrefixTree.build(arrays(prompts))
    tree.check()
    # preorder: root, [1], [1 2 3], [.. 4], [.. 5 6], [1 9], [7 8]
    assert tree.node_parent.tolist() == [-1, 0, 1, 2, 2, 1, 0]
    assert tree.node_start.tolist() == [0, 0, 1, 3, 3, 1, 0]
    assert tree.node_end.tolist() == [0, 1, 3, 4, 5, 2, 2]
    assert tree.node_rows.tolist() == [6, 5, 4, 1, 1, 1, 1]
    assert tree.node_terminal.tolist() == [0, 0, 2, 1, 1, 1, 1]
    assert tree.row_node.tolist() == [3, 4, 2, 2, 6, 5]
    assert tree.order.tolist() == [2, 3, 0, 1, 5, 4]
    assert tree.lcp.tolist() == [3, 3, 3, 1, 0]
    assert tree.node_subtree_end.tolist() == [7, 6, 5, 4, 5, 6, 7]
    assert tree.tree_tokens == 9
    assert tree.edge(4).tolist() == [5, 6]
    text = tree.pretty()
    assert "tree_tokens=9" in text and "    [4] 3:5 rows=1 term=1 | 5 6" in text


@pytest.mark.parametrize("prompts, tokens, nodes", [
    ([], 0, 1),
    ([[]], 0, 1),
    ([[], [], [4]], 1, 2),
    ([[5, 5, 5]] * 4, 3, 2),
    ([[1], [1, 2], [1, 2, 3], [1, 2, 3, 4]], 4, 5),
    ([[3, 1], [2, 1], [1, 1]], 6, 4),
])
def test_edge_cases(prompts, tokens, nodes):
    tree = PrefixTree.build(arrays(prompts))
    assert_matches_brute_force(prompts, tree)
    assert (tree.tree_tokens, tree.num_nodes) == (tokens, nodes)


def test_templated_job_against_python_sort():
    rng = np.random.default_rng(7)
    heads = [rng.integers(0, 50_000, 150).tolist() for _ in range(3)]
    docs = [rng.integers(0, 50_000, rng.integers(50, 200)).tolist() for _ in range(40)]
    prompts = [heads[d % 3] + docs[d] + rng.integers(0, 5, rng.integers(0, 6)).tolist()
               for d in rng.integers(0, 40, 1500)]
    tree = PrefixTree.build(arrays(prompts))
    tree.check()
    srt = sorted(range(len(prompts)), key=lambda r: (prompts[r], r))
    assert tree.order.tolist() == srt
    lcps = [len(os.path.commonprefix([prompts[a], prompts[b]])) for a, b in pairwise(srt)]
    assert tree.lcp.tolist() == lcps
    distinct = sum(len(p) for p in prompts) - sum(lcps)
    assert tree.tree_tokens == distinct


def test_helpers():
    values = np.array([5, 3, 8, 3, 9, 1, 7])
    table = RangeMin(values)
    lo, hi = np.array([0, 2, 4, 6, 0]), np.array([2, 5, 7, 7, 7])
    assert table.range_min(lo, hi).tolist() == [3, 3, 1, 7, 1]
    k = np.arange(7)
    assert table.prev_smaller(k, values).tolist() == [-1, -1, 1, -1, 3, -1, 5]
    assert table.next_smaller(k, values).tolist() == [1, 5, 3, 5, 5, 7, 7]
    assert node_depths(np.array([-1, 0, 1, 0, 3, -1])).tolist() == [0, 1, 2, 1, 2, 0]
    assert concat_ranges(np.array([4, 0, 9]), np.array([2, 0, 3])).tolist() == [4, 5, 9, 10, 11]


def test_bad_offsets_are_rejected():
    with pytest.raises(ValueError):
        PrefixTree.build(np.zeros(4, np.int32), np.array([0, 3, 2]))
    with pytest.raises(ValueError):
        PrefixTree.build(np.zeros(4, np.int32), np.array([0, 5]))
