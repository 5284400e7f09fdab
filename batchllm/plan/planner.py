"""The plan of a job: which shared prefixes to compute and the order of all work, as plain data.

Prefix nodes are the prefix tree's nodes (length > 0) that at least two rows pass through or end
at; they are numbered in tree preorder, so a parent precedes its children. A row's parent is the
deepest prefix node on its path; its end is <= the row's prompt length. A row whose whole prompt
is its parent's prefix (a duplicate, or a prompt that is a prefix of another) is a *terminal* row:
the engine samples its first token from the logits the prefix computation kept.

Order "prefix-tree" is a DFS over the prefix nodes; among the children of a node (prefix nodes and
rows) the highest decode/prefill ratio goes first (BatchLLM): decode = sum of max_tokens of the
rows under it, prefill = distinct tokens under it (a row: its own prompt part; terminal rows have
none and go first). Ties keep lexicographic token order. Order "input" keeps rows in input order
and puts each prefix node just before its first dependent. Without prefix sharing the items are
the rows alone, in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import numpy as np

from batchllm.plan.arrays import RangeMin, node_depths
from batchllm.plan.tree import PrefixTree

ORDERS = ("prefix-tree", "input")
PREFIX, ROW = 0, 1  # item_kind values

_ARRAYS = {  # Plan array fields and their dtypes
    "row_len": np.int32, "row_max_tokens": np.int32, "row_parent": np.int32,
    "node_parent": np.int32, "node_start": np.int32, "node_end": np.int32,
    "node_source_row": np.int32, "node_users": np.int32, "node_terminal": np.int32,
    "node_rows": np.int32, "item_kind": np.int8, "item_id": np.int32,
}


@dataclass(eq=False)
class Plan:
    """Plain, serializable plan. R rows, G prefix nodes, I = G + R items (R without sharing)."""

    prefix_sharing: bool
    order: str
    tree_tokens: int  # distinct prompt tokens (of the tree, also without sharing)
    row_len: np.ndarray  # [R] int32 prompt tokens
    row_max_tokens: np.ndarray  # [R] int32
    row_parent: np.ndarray  # [R] int32 deepest prefix node on the row's path, -1 if none
    node_parent: np.ndarray  # [G] int32, -1 if none; parent id < child id
    node_start: np.ndarray  # [G] int32 = parent's end (0 if none)
    node_end: np.ndarray  # [G] int32 the node holds prompt positions [start, end)
    node_source_row: np.ndarray  # [G] int32 a row whose prompt[:end] is the node's prefix
    node_users: np.ndarray  # [G] int32 direct dependents: child nodes + rows with this parent
    node_terminal: np.ndarray  # [G] int32 rows with this parent and len(prompt) == end
    node_rows: np.ndarray  # [G] int32 rows under the node (direct or not)
    item_kind: np.ndarray  # [I] int8 PREFIX (0) or ROW (1)
    item_id: np.ndarray  # [I] int32 prefix node id or row id

    @property
    def num_rows(self) -> int:
        return len(self.row_len)

    @property
    def num_nodes(self) -> int:
        return len(self.node_end)

    @property
    def row_is_terminal(self) -> np.ndarray:
        """[R] bool: the row's prompt is exactly its parent's prefix."""
        end = np.append(self.node_end, -1)[self.row_parent]  # -1 (no parent) picks the pad
        return (self.row_parent >= 0) & (end == self.row_len)

    def node_depth(self) -> np.ndarray:
        """[G] 1 for a node without parent, 2 below it, ..."""
        return node_depths(self.node_parent) + 1

    def stats(self) -> dict:
        prompt = int(self.row_len.sum(dtype=np.int64))
        return {
            "rows": self.num_rows,
            "prompt_tokens": prompt,
            "tree_tokens": self.tree_tokens,
            "predicted_prefill_tokens": self.tree_tokens if self.prefix_sharing else prompt,
            "sharing_ratio": 1.0 - self.tree_tokens / prompt if prompt else 0.0,
            "groups": self.num_nodes,
            "levels": int(self.node_depth().max(initial=0)),
        }

    def to_dict(self) -> dict:
        """JSON-able: scalars and lists of ints."""
        return {f.name: (getattr(self, f.name).tolist() if f.name in _ARRAYS
                         else getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        names = {f.name for f in fields(cls)}
        if set(d) != names:
            raise ValueError(f"plan dict keys differ: {sorted(set(d) ^ names)}")
        return cls(**{k: np.asarray(v, _ARRAYS[k]) if k in _ARRAYS else v for k, v in d.items()})

    def check(self) -> None:
        """Asserts the plan's invariants (for tests and debugging)."""
        r, g = self.num_rows, self.num_nodes
        kind, ids = self.item_kind, self.item_id
        assert np.array_equal(np.sort(ids[kind == ROW]), np.arange(r)), "rows not covered once"
        assert np.array_equal(np.sort(ids[kind == PREFIX]), np.arange(g)), "nodes not once"
        pos_row, pos_node = np.empty(r, np.int64), np.empty(g, np.int64)
        pos_row[ids[kind == ROW]] = np.flatnonzero(kind == ROW)
        pos_node[ids[kind == PREFIX]] = np.flatnonzero(kind == PREFIX)
        par, rp = self.node_parent, self.row_parent
        assert np.all(par < np.arange(g)), "node parents must precede children"
        has, rhas = par >= 0, rp >= 0
        assert np.all(pos_node[par[has]] < pos_node[has]), "a node after one of its children"
        assert np.all(pos_node[rp[rhas]] < pos_row[rhas]), "a row before its prefix node"
        assert np.array_equal(self.node_start, np.where(has, self.node_end[par], 0))
        assert np.all(self.node_end > self.node_start), "empty prefix node"
        assert np.all(self.node_end[rp[rhas]] <= self.row_len[rhas]), "parent past prompt end"
        users = np.bincount(par[has], minlength=g) + np.bincount(rp[rhas], minlength=g)
        assert np.array_equal(self.node_users, users), "node_users"
        term = np.bincount(rp[self.row_is_terminal], minlength=g)
        assert np.array_equal(self.node_terminal, term), "node_terminal"
        assert np.all(self.node_rows >= 2), "a prefix node must be shared"
        if not self.prefix_sharing:
            assert g == 0 and not rhas.any() and len(kind) == r

    def restricted_to(self, keep: np.ndarray) -> Plan:
        """The same plan running only the rows where keep [R] is True (a resumed job): the tree,
        the parents and the order stay; prefix nodes no kept row needs are dropped, and
        node_users / node_terminal count kept dependents only. Row ids are unchanged."""
        g = self.num_nodes
        rp = self.row_parent
        kept_rows = keep & (rp >= 0)
        direct = np.bincount(rp[kept_rows], minlength=g)
        children = np.zeros(g, np.int64)
        needed = np.zeros(g, bool)
        for v in range(g - 1, -1, -1):  # children have larger ids than their parents
            needed[v] = direct[v] + children[v] > 0
            if needed[v] and self.node_parent[v] >= 0:
                children[self.node_parent[v]] += 1
        kind, ids = self.item_kind, self.item_id
        item_keep = np.where(kind == ROW, keep[np.where(kind == ROW, ids, 0)],
                             needed[np.where(kind == PREFIX, ids, 0)])
        terminal = np.bincount(rp[kept_rows & self.row_is_terminal], minlength=g)
        tree = self.tree_tokens
        if self.prefix_sharing:  # what the kept rows need computed: needed nodes + own parts
            parent_end = np.append(self.node_end, 0)[rp]
            tree = int((self.node_end - self.node_start)[needed].sum()
                       + (self.row_len - parent_end)[keep].sum())
        return replace(
            self, tree_tokens=tree, node_users=(direct + children).astype(np.int32),
            node_terminal=terminal.astype(np.int32),
            item_kind=kind[item_keep], item_id=ids[item_keep],
        )


def make_plan(
    prompts: Sequence[np.ndarray] | np.ndarray | PrefixTree,
    max_tokens: int | Sequence[int] | np.ndarray,
    prefix_sharing: bool = True,
    order: str = "prefix-tree",
    *,
    offsets: np.ndarray | None = None,
) -> Plan:
    """Plans a job. `prompts`: a list of 1-D int32 token arrays, a flat token array with [R + 1]
    `offsets`, or a built PrefixTree. `max_tokens`: one int or one per row."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    tree = prompts if isinstance(prompts, PrefixTree) else PrefixTree.build(prompts, offsets)
    n, lens = tree.num_rows, tree.lengths
    mt = np.asarray(max_tokens, np.int64)
    if mt.ndim and mt.shape != (n,):
        raise ValueError(f"max_tokens: expected one value or {n}, got shape {mt.shape}")
    if np.any(mt < 0):
        raise ValueError("max_tokens must be >= 0")
    mt = np.broadcast_to(mt, (n,))
    if 2 * n >= np.iinfo(np.int32).max:  # rows and prefix nodes are int32 ids (Plan)
        raise ValueError(f"a plan holds fewer than 2**30 rows, got {n}")
    is_prefix = (tree.node_rows >= 2) & (tree.node_end > 0)  # [N] over tree nodes
    pid = np.cumsum(is_prefix) - 1  # tree node -> prefix node id (where is_prefix)
    tn = np.flatnonzero(is_prefix)  # [G] tree node of each prefix node
    tp = tree.node_parent[tn]
    node_parent = np.where(is_prefix[tp], pid[tp], -1)
    rn = tree.row_node
    up = np.where(is_prefix[rn], rn, np.maximum(tree.node_parent[rn], 0))
    row_parent = np.where(is_prefix[up], pid[up], -1)
    end = tree.node_end[tn]
    if order == "input":
        first_row = RangeMin(tree.order).range_min(tree.node_first[tn], tree.node_last[tn])
        inf = np.full(n, np.iinfo(np.int64).max)
        items = np.lexsort((np.concatenate((end, inf)), np.concatenate((first_row, np.arange(n)))))
    else:
        items = _dfs_items(tree, is_prefix, node_parent, row_parent, mt)
    g = len(tn)
    if not prefix_sharing:
        items, g = items[items >= g] - g, 0
        row_parent = np.full(n, -1)
    kind = (items >= g).astype(np.int8)
    rhas = row_parent >= 0
    terminal = rhas & (np.append(end, -1)[row_parent] == lens)
    keep = slice(0, g)
    return Plan(
        prefix_sharing=bool(prefix_sharing), order=order, tree_tokens=tree.tree_tokens,
        row_len=lens.astype(np.int32), row_max_tokens=mt.astype(np.int32),
        row_parent=row_parent.astype(np.int32), node_parent=node_parent[keep].astype(np.int32),
        node_start=tree.node_start[tn][keep].astype(np.int32), node_end=end[keep].astype(np.int32),
        node_source_row=tree.node_source[tn][keep].astype(np.int32),
        node_users=(np.bincount(node_parent[keep][node_parent[keep] >= 0], minlength=g)
                    + np.bincount(row_parent[rhas], minlength=g)).astype(np.int32),
        node_terminal=np.bincount(row_parent[terminal], minlength=g).astype(np.int32),
        node_rows=tree.node_rows[tn][keep].astype(np.int32),
        item_kind=kind, item_id=np.where(kind == ROW, items - g, items).astype(np.int32),
    )


def _dfs_items(tree: PrefixTree, is_prefix, node_parent, row_parent, mt) -> np.ndarray:
    """Items (prefix node g, or row r as G + r) in DFS order, children by decode/prefill ratio.

    Positions come without a walk: in a preorder of the plan tree (the token order) an item's
    subtree is a range of `size` items, so its DFS position is the sum, over its ancestors and
    itself, of 1 + the sizes of the siblings that go before it (a difference array + cumsum).
    Indices are int32 (make_plan bounds the rows) and each array goes once it is used: this is
    the plan's largest transient (~310 B a row when every array was int64 and kept)."""
    tn = np.flatnonzero(is_prefix).astype(np.int32)
    n, g = tree.num_rows, len(tn)
    it = np.int32
    rank = np.empty(n, it)
    rank[tree.order] = np.arange(n, dtype=it)
    pre = np.lexsort((np.concatenate((tree.node_end[tn], np.full(n, np.iinfo(it).max, it))),
                      np.concatenate((tree.node_first[tn], rank))))
    del rank
    q = np.empty(g + n, it)  # position of each item in that preorder
    q[pre] = np.arange(g + n, dtype=it)
    del pre
    sub_end = tree.node_subtree_end[tn]
    cs_pref = np.concatenate(([0], np.cumsum(is_prefix, dtype=it)))
    cs_edge = np.concatenate(([0], np.cumsum(tree.node_end - tree.node_start)))
    cs_mt = np.concatenate(([0], np.cumsum(mt[tree.order])))
    first, last = tree.node_first[tn], tree.node_last[tn]
    own_start = np.append(tree.node_end[tn], 0)[row_parent]
    size = np.concatenate((cs_pref[sub_end] - cs_pref[tn] + last - first,
                           np.ones(n, it))).astype(it)
    decode = np.concatenate((cs_mt[last] - cs_mt[first], mt)).astype(np.float64)
    prefill = np.concatenate((cs_edge[sub_end] - cs_edge[tn], tree.lengths - own_start))
    del cs_pref, cs_edge, cs_mt, own_start
    ratio = np.divide(decode, prefill, out=np.full(g + n, np.inf), where=prefill > 0)
    del decode, prefill
    parent = np.concatenate((node_parent, row_parent)).astype(it)
    sib = np.lexsort((q, -ratio, parent))  # siblings together, best ratio first
    del ratio
    size_s, par_s = size[sib], parent[sib]
    del parent
    before = np.cumsum(size_s, dtype=np.int64) - size_s
    head = np.ones(len(par_s), bool)
    head[1:] = par_s[1:] != par_s[:-1]
    before -= before[np.flatnonzero(head)][np.cumsum(head) - 1]
    del head, size_s
    w = np.empty(g + n, it)
    w[sib] = before + (par_s >= 0)
    del sib, before, par_s
    diff = np.zeros(g + n + 1, np.int64)
    diff[q] += w
    np.add.at(diff, q + size, -w)
    del w, size
    pos = np.cumsum(diff)[q]
    del diff, q
    items = np.empty(g + n, it)
    items[pos] = np.arange(g + n, dtype=it)
    return items
