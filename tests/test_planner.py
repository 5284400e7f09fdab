"""make_plan against a brute-force planner over Python tuples, and exact small plans."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchllm.plan.peak_pages import predict_peak_pages
from batchllm.plan.planner import PREFIX, Plan, make_plan
from batchllm.plan.tree import PrefixTree

SMALL = [[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 2, 3], [1, 2, 3], [7, 8], [1, 9]]
SMALL_MAX = [5, 1, 2, 3, 4, 1]


def arrays(prompts: list[list[int]]) -> list[np.ndarray]:
    return [np.array(p, np.int32) for p in prompts]


def reference(prompts: list[list[int]], max_tokens: list[int], order: str) -> dict:
    """The plan spelled out on tuples: prefix nodes, parents, and the item order."""
    ps = [tuple(p) for p in prompts]
    rows_at = Counter(p[:i] for p in ps for i in range(1, len(p) + 1))
    nexts: dict[tuple, set] = {}
    for p in ps:
        for i in range(len(p)):
            nexts.setdefault(p[:i], set()).add(p[i])
    ends = set(ps)
    nodes = sorted(q for q in rows_at  # sorted tuples = preorder of the token trie
                   if rows_at[q] >= 2 and (q in ends or len(nexts.get(q, ())) >= 2))
    nid = {q: i for i, q in enumerate(nodes)}

    def deepest(p: tuple, longest: int) -> int:
        return max((nid[p[:i]] for i in range(1, longest + 1) if p[:i] in nid),
                   key=lambda v: len(nodes[v]), default=-1)

    node_parent = [deepest(q, len(q) - 1) for q in nodes]
    row_parent = [deepest(p, len(p)) for p in ps]
    distinct = {p[:i] for p in ps for i in range(1, len(p) + 1)}
    kids: dict[int, list] = {}
    for v, par in enumerate(node_parent):
        kids.setdefault(par, []).append(("n", v))
    for r, par in enumerate(row_parent):
        kids.setdefault(par, []).append(("r", r))

    def key(item: tuple) -> tuple:
        kind, i = item
        if kind == "r":
            e = len(nodes[row_parent[i]]) if row_parent[i] >= 0 else 0
            dec, pre, tie = max_tokens[i], len(ps[i]) - e, (ps[i], i)
        else:
            q = nodes[i]
            e = len(nodes[node_parent[i]]) if node_parent[i] >= 0 else 0
            under = [r for r, p in enumerate(ps) if p[: len(q)] == q]
            dec = sum(max_tokens[r] for r in under)
            pre = sum(1 for d in distinct if len(d) > e and (d[: len(q)] == q or q[: len(d)] == d))
            tie = min((ps[r], r) for r in under)
        return (-(dec / pre if pre else float("inf")), tie)

    items: list[tuple] = []

    def visit(item: tuple) -> None:
        items.append(item)
        if item[0] == "n":
            for child in sorted(kids.get(item[1], []), key=key):
                visit(child)

    if order == "prefix-tree":
        for child in sorted(kids.get(-1, []), key=key):
            visit(child)
    else:
        done: set[int] = set()
        for r in range(len(ps)):
            chain, v = [], row_parent[r]
            while v >= 0 and v not in done:
                chain.append(v)
                v = node_parent[v]
            done.update(chain)
            items += [("n", v) for v in reversed(chain)] + [("r", r)]
    return {"nodes": nodes, "node_parent": node_parent, "row_parent": row_parent, "items": items}


def plan_items(plan: Plan) -> list[tuple]:
    return [("n" if k == PREFIX else "r", int(i)) for k, i in zip(plan.item_kind, plan.item_id)]


prompt_lists = st.lists(st.lists(st.integers(0, 3), max_size=7), max_size=14)


@settings(max_examples=250, deadline=None)
@given(prompt_lists, st.data(), st.sampled_from(["prefix-tree", "input"]))
def test_matches_reference_planner(prompts, data, order):
    max_tokens = data.draw(st.lists(st.integers(1, 9), min_size=len(prompts),
                                    max_size=len(prompts)))
    plan = make_plan(arrays(prompts), np.array(max_tokens, np.int32), True, order)
    plan.check()
    ref = reference(prompts, max_tokens, order)
    got_nodes = [tuple(prompts[s][:e]) for s, e in zip(plan.node_source_row, plan.node_end)]
    assert got_nodes == ref["nodes"]
    assert plan.node_parent.tolist() == ref["node_parent"]
    assert plan.row_parent.tolist() == ref["row_parent"]
    assert plan_items(plan) == ref["items"]
    off = make_plan(arrays(prompts), max_tokens, False, order)
    off.check()
    assert plan_items(off) == [it for it in ref["items"] if it[0] == "r"]
    assert plan.stats()["tree_tokens"] == off.stats()["tree_tokens"] == PrefixTree.build(
        arrays(prompts)).tree_tokens


def test_exact_small_plan():
    plan = make_plan(arrays(SMALL), np.array(SMALL_MAX, np.int32))
    plan.check()
    # prefix nodes: 0 = [1] (5 rows), 1 = [1 2 3] (4 rows, two of them duplicates ending there)
    assert plan.node_parent.tolist() == [-1, 0]
    assert plan.node_start.tolist() == [0, 1] and plan.node_end.tolist() == [1, 3]
    assert plan.node_users.tolist() == [2, 4]
    assert plan.node_terminal.tolist() == [0, 2]
    assert plan.node_rows.tolist() == [5, 4]
    assert plan.row_parent.tolist() == [1, 1, 1, 1, -1, 0]
    assert plan.row_is_terminal.tolist() == [False, False, True, True, False, False]
    # root: row 4 (4/2) before node 0 (12/7); node 0: node 1 (11/5) before row 5 (1/1);
    # node 1: terminal rows 2, 3 (no prefill) first, then row 0 (5/1), row 1 (1/2)
    assert plan_items(plan) == [("r", 4), ("n", 0), ("n", 1), ("r", 2), ("r", 3), ("r", 0),
                                ("r", 1), ("r", 5)]
    assert plan.stats() == {"rows": 6, "prompt_tokens": 19, "tree_tokens": 9,
                            "predicted_prefill_tokens": 9, "sharing_ratio": 1 - 9 / 19,
                            "groups": 2, "levels": 2}
    # rows run t=0..5 as 4, 2, 3, 0, 1, 5 with own pages 3, 2, 2, 4, 2, 2 (page size 2);
    # nodes 0 (1 page) and 1 (2 pages) live from t=1 to t=5: peak at t=3: 2 + 4 + 3
    assert predict_peak_pages(plan, page_size=2, max_num_seqs=2) == 9
    assert predict_peak_pages(plan, page_size=2, max_num_seqs=100) == 3 + 2 + 2 + 4 + 2 + 2 + 3


def test_input_order_and_sharing_off():
    plan = make_plan(arrays(SMALL), 3, order="input")
    plan.check()
    assert plan_items(plan) == [("n", 0), ("n", 1)] + [("r", r) for r in range(6)]
    off = make_plan(arrays(SMALL), SMALL_MAX, prefix_sharing=False)
    off.check()
    assert off.num_nodes == 0 and off.row_parent.tolist() == [-1] * 6
    assert plan_items(off) == [("r", r) for r in (4, 2, 3, 0, 1, 5)]
    assert off.stats()["predicted_prefill_tokens"] == 19 and off.stats()["groups"] == 0
    # full prompt + max_tokens pages per row: 3, 3, 3, 5, 3, 2 in that order, two at a time
    assert predict_peak_pages(off, page_size=2, max_num_seqs=2) == 8
    off_in = make_plan(arrays(SMALL), SMALL_MAX, prefix_sharing=False, order="input")
    assert plan_items(off_in) == [("r", r) for r in range(6)]


def test_round_trip_through_json():
    for sharing in (True, False):
        plan = make_plan(arrays(SMALL), SMALL_MAX, sharing)
        back = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
        back.check()
        for name, value in plan.to_dict().items():
            got = getattr(back, name)
            if isinstance(got, np.ndarray):
                assert got.dtype == getattr(plan, name).dtype
                assert np.array_equal(got, getattr(plan, name)), name
            else:
                assert got == value, name
    with pytest.raises(ValueError):
        Plan.from_dict({"order": "input"})


def test_flat_input_tree_input_and_errors():
    lens = [len(p) for p in SMALL]
    flat = np.array([t for p in SMALL for t in p], np.int32)
    a = make_plan(flat, SMALL_MAX, offsets=np.concatenate(([0], np.cumsum(lens))))
    b = make_plan(PrefixTree.build(arrays(SMALL)), SMALL_MAX)
    assert a.to_dict() == b.to_dict() == make_plan(arrays(SMALL), SMALL_MAX).to_dict()
    with pytest.raises(ValueError):
        make_plan(arrays(SMALL), SMALL_MAX, order="random")
    with pytest.raises(ValueError):
        make_plan(arrays(SMALL), [1, 2])
    with pytest.raises(ValueError):
        make_plan(arrays(SMALL), -1)


def test_empty_and_degenerate_jobs():
    empty = make_plan([], [])
    empty.check()
    make_plan([], [], order="input").check()
    assert empty.stats()["rows"] == 0 and predict_peak_pages(empty, 16, 4) == 0
    same = make_plan(arrays([[4, 4]] * 3 + [[]]), 2)
    same.check()
    assert same.node_end.tolist() == [2] and same.node_terminal.tolist() == [3]
    assert same.row_parent.tolist() == [0, 0, 0, -1]
    assert plan_items(same) == [("r", 3), ("n", 0), ("r", 0), ("r", 1), ("r", 2)]
