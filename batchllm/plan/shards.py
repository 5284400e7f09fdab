"""Cutting a Plan into N shards of about equal predicted cost, at subtree boundaries.

Cost of a shard = its predicted prefill (the distinct prompt tokens of its rows: the prefix nodes
its rows need plus their own parts) + its decode tokens (sum of max_tokens). Torch-free.

How it cuts (deterministic):
1. Every plan item (prefix node or row) gets its subtree cost: the edge tokens of the prefix
   nodes under it, the own parts of the rows under it, and their max_tokens.
2. A prefix node whose subtree costs more than `tolerance` * total / N is *split*: its children
   become units of their own (a split node's ancestors cost more, so they are split too). Every
   other item belongs to the unit of its highest unsplit ancestor, so a unit is a whole subtree (or
   a row). Units are then at most a `tolerance` share of a shard, so each shard's cost is within
   about that share of total / N (a single row costing more is the exception).
3. Units, in the plan's item order (a DFS: subtrees contiguous, siblings sorted), are cut into N
   contiguous runs: the k-th cut is the unit boundary, within `tolerance` * total / N of
   k * total / N in cumulative cost, that duplicates the fewest prefix tokens (a cut just before
   an item duplicates its parent's prefix), the nearest among equals. A split node's edge tokens
   count where the node stands in that order, as the cost of reaching its children.
A split node whose children land on several shards has its prefix computed on each of them:
`duplicated_tokens` = sum of the shards' predicted prefill - the whole plan's tree tokens, exact
(each shard's prefill is `Plan.restricted_to(shard rows).tree_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchllm.plan.planner import PREFIX, ROW, Plan


@dataclass(eq=False)
class Shards:
    """N shards of a Plan. Rows are plan row ids (0 .. R-1); a shard may be empty (N > units)."""

    rows: list[np.ndarray]  # [N] of sorted int64 plan row ids
    prefill_tokens: np.ndarray  # [N] int64 predicted prefill tokens of each shard
    decode_tokens: np.ndarray  # [N] int64 sum of max_tokens of each shard's rows
    tree_tokens: int  # predicted prefill of the whole plan on one worker
    split_nodes: int  # prefix nodes whose subtree was too big for one shard

    @classmethod
    def of(cls, plan: Plan, rows: list[np.ndarray], split_nodes: int = 0) -> Shards:
        """The shards of `plan` whose plan row ids are `rows`, with their predicted figures."""
        prefill = np.array([shard_prefill(plan, s) for s in rows], np.int64)
        decode = np.array([int(plan.row_max_tokens[s].sum(dtype=np.int64)) for s in rows],
                          np.int64)
        tree = plan.tree_tokens if plan.prefix_sharing else int(plan.row_len.sum(dtype=np.int64))
        return cls(rows, prefill, decode, tree, split_nodes)

    @property
    def num_shards(self) -> int:
        return len(self.rows)

    @property
    def cost(self) -> np.ndarray:
        """[N] int64 predicted cost: prefill + decode tokens."""
        return self.prefill_tokens + self.decode_tokens

    @property
    def duplicated_tokens(self) -> int:
        """Prefix tokens computed on more than one worker (counted once per extra worker)."""
        return int(self.prefill_tokens.sum()) - self.tree_tokens

    def row_shard(self, num_rows: int) -> np.ndarray:
        """[R] int32 shard of each plan row."""
        out = np.full(num_rows, -1, np.int32)
        for k, rows in enumerate(self.rows):
            out[rows] = k
        return out

    def stats(self) -> dict:
        cost = self.cost
        mean = float(cost.mean()) if len(cost) else 0.0
        return {
            "shards": self.num_shards,
            "shard_rows": [len(r) for r in self.rows],
            "shard_prefill_tokens": self.prefill_tokens.tolist(),
            "shard_decode_tokens": self.decode_tokens.tolist(),
            "shard_cost_max_over_mean": float(cost.max()) / mean if mean else 1.0,
            "duplicated_prefix_tokens": self.duplicated_tokens,
            "split_nodes": self.split_nodes,
        }

    def pretty(self) -> str:
        head = (f"Shards n={self.num_shards} tree_tokens={self.tree_tokens} "
                f"duplicated={self.duplicated_tokens} split_nodes={self.split_nodes}")
        lines = [head]
        for k, rows in enumerate(self.rows):
            lines.append(f"  [{k}] rows={len(rows)} prefill={self.prefill_tokens[k]} "
                         f"decode={self.decode_tokens[k]} cost={self.cost[k]}")
        return "\n".join(lines)

    def check(self, plan: Plan) -> None:
        """Asserts: every plan row in exactly one shard; the figures match the plan."""
        allrows = np.concatenate(self.rows) if self.rows else np.zeros(0, np.int64)
        assert np.array_equal(np.sort(allrows), np.arange(plan.num_rows)), "rows not once"
        for k, rows in enumerate(self.rows):
            assert np.all(np.diff(rows) > 0), "shard rows not sorted"
            assert self.prefill_tokens[k] == shard_prefill(plan, rows)
            assert self.decode_tokens[k] == int(plan.row_max_tokens[rows].sum(dtype=np.int64))
        assert self.duplicated_tokens >= 0


def shard_prefill(plan: Plan, rows: np.ndarray) -> int:
    """Predicted prefill tokens of running only `rows` (plan row ids) on one worker."""
    if not plan.prefix_sharing:
        return int(plan.row_len[rows].sum(dtype=np.int64))
    keep = np.zeros(plan.num_rows, bool)
    keep[rows] = True
    return plan.restricted_to(keep).tree_tokens


def _subtree_costs(plan: Plan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[G] edge tokens, [G] subtree cost of each prefix node, [R] cost of each row."""
    g, rp = plan.num_nodes, plan.row_parent
    edge = (plan.node_end - plan.node_start).astype(np.int64)
    own_start = np.append(plan.node_end, 0)[rp] if plan.prefix_sharing else 0
    row_cost = plan.row_len.astype(np.int64) - own_start + plan.row_max_tokens
    node_cost = edge.copy()
    has = rp >= 0
    np.add.at(node_cost, rp[has], row_cost[has])
    if g:
        depth = plan.node_depth()
        for d in range(int(depth.max()), 1, -1):  # deepest first: fold each level into parents
            lvl = np.flatnonzero(depth == d)
            np.add.at(node_cost, plan.node_parent[lvl], node_cost[lvl])
    return edge, node_cost, row_cost


def _cut_positions(cost: np.ndarray, shared: np.ndarray, head: np.ndarray, target: float,
                   num_shards: int, tolerance: float) -> np.ndarray:
    """[N - 1] positions in the item order where shards 1 .. N-1 start. For the mark k * target:
    among the unit heads whose cost before them is within tolerance * target of the mark, the
    one whose cut duplicates the fewest prefix tokens (then the nearest); without such a head,
    the nearest head."""
    before = np.cumsum(cost) - cost  # [I] cost of the items before each position
    heads = np.flatnonzero(head)
    hb = before[heads]  # non-decreasing
    cuts = np.empty(num_shards - 1, np.int64)
    for k in range(1, num_shards):
        mark, slack = k * target, tolerance * target
        lo, hi = np.searchsorted(hb, [mark - slack, mark + slack], side="left")
        if hi > lo:
            cand = heads[lo:hi]
            cuts[k - 1] = cand[np.lexsort((np.abs(before[cand] - mark), shared[cand]))[0]]
        else:
            j = np.clip(np.searchsorted(hb, mark) + np.array([-1, 0]), 0, len(heads) - 1)
            cuts[k - 1] = heads[j[np.argmin(np.abs(hb[j] - mark))]]
    return np.maximum.accumulate(cuts) if len(cuts) else cuts


def make_shards(plan: Plan, num_shards: int, tolerance: float = 0.1) -> Shards:
    """Cut `plan` into `num_shards` shards (see the module docstring). A smaller `tolerance`
    (a share of one shard's cost) balances better and may duplicate more prefix tokens."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    if not 0 < tolerance <= 1:
        raise ValueError(f"tolerance must be in (0, 1], got {tolerance}")
    g, r = plan.num_nodes, plan.num_rows
    if r == 0:
        empty = np.zeros(num_shards, np.int64)
        return Shards([np.zeros(0, np.int64)] * num_shards, empty, empty.copy(), 0, 0)
    edge, node_cost, row_cost = _subtree_costs(plan)
    total = int(edge.sum() + row_cost.sum()) if plan.prefix_sharing else int(row_cost.sum())
    target = total / num_shards
    split = node_cost > tolerance * target if num_shards > 1 else np.zeros(g, bool)
    # unit of each node: itself when its parent is split (or it has none), else its parent's unit
    unit = np.arange(g, dtype=np.int64)
    if g:
        depth = plan.node_depth()
        for d in range(2, int(depth.max()) + 1):  # parents before children
            lvl = np.flatnonzero(depth == d)
            par = plan.node_parent[lvl]
            unit[lvl] = np.where(split[par], lvl, unit[par])
    # items are numbered: node v -> v, row i -> g + i
    rp = plan.row_parent
    row_unit = g + np.arange(r)
    if g:  # a row under an unsplit prefix node belongs to that node's unit
        p = np.maximum(rp, 0)
        row_unit = np.where((rp >= 0) & ~split[p], unit[p], row_unit)
    # the sequence to cut: split nodes (cost: edge) and unit heads (cost: subtree), in item order
    kind, ids = plan.item_kind, plan.item_id
    item = np.where(kind == ROW, g + ids, ids)
    is_head_node = np.zeros(g, bool)
    is_head_node[np.unique(unit)] = True
    seq_cost = np.zeros(g + r, np.int64)
    seq_cost[:g] = np.where(split, edge, np.where(is_head_node, node_cost, 0))
    seq_cost[g:] = np.where(row_unit == g + np.arange(r), row_cost, 0)
    shared = np.zeros(g + r, np.int64)  # prefix tokens a cut just before the item duplicates
    shared[:g] = plan.node_start
    if g:
        shared[g:] = np.where(rp >= 0, plan.node_end[np.maximum(rp, 0)], 0)
    head = np.zeros(g + r, bool)
    head[:g] = split | is_head_node
    head[g:] = row_unit == g + np.arange(r)
    cut = _cut_positions(seq_cost[item], shared[item], head[item], target, num_shards,
                         tolerance)
    shard_of_pos = np.searchsorted(cut, np.arange(len(item)), side="right")
    pos = np.empty(g + r, np.int64)
    pos[item] = np.arange(len(item))
    row_shard = shard_of_pos[pos[row_unit]]
    order = np.argsort(row_shard, kind="stable")
    counts = np.bincount(row_shard, minlength=num_shards)
    rows = np.split(order.astype(np.int64), np.cumsum(counts)[:-1])
    return Shards.of(plan, rows, int(split.sum()))


__all__ = ["PREFIX", "ROW", "Shards", "make_shards", "shard_prefill"]
