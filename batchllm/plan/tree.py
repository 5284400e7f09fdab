"""Token-level compressed prefix tree (radix tree) over every tokenized prompt of a job.

Stored as flat numpy arrays, nodes numbered in DFS preorder (parent id < child id), node 0 the
root (end 0). Node v covers prompt positions [node_start[v], node_end[v]) of the rows
order[node_first[v]:node_last[v]] (rows in lexicographic token order); its edge tokens are any of
those rows' tokens there. Nodes exist where prompts branch and where a prompt ends, so duplicate
prompts and a prompt that is a prefix of another end at an inner node (`row_node`).

Built without a Python object per token or per node:
1. `_sort_with_lcp`: MSD-radix-style refinement. A group of rows sharing `depth` tokens compares
   a window of its next tokens with its first member; a group that agrees advances by the window,
   one that does not is split by the token at the first disagreement. Out come the lexicographic
   order and the longest common prefix (LCP) of each adjacent pair.
2. `_nodes_from_lcp`: the LCP intervals are the inner nodes (an interval is named by its value
   and the previous strictly smaller LCP); a row ending deeper than both neighbouring LCPs adds a
   leaf. Previous/next smaller values come from a sparse table (`RangeMin`).
3. Sorting nodes by (first row in sorted order, depth) gives DFS preorder.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from batchllm.plan.arrays import (
    RangeMin,
    concat_ranges,
    index_dtype,
    node_depths,
    window_agreement,
)

_WINDOW_ELEMS = 1 << 25  # a round with more members compares fewer tokens a member (>= 4)
_MAX_WIDTH = 64  # longer windows waste more compares where a group splits
_END = np.iinfo(np.int64).min  # split key of "the prompt ends here": sorts before every token


def _sort_with_lcp(
    tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Rows in lexicographic order (ties in input order) and lcp[k] = LCP(order[k], order[k+1])."""
    n = len(lengths)
    it = index_dtype(max(n, len(tokens)))  # rows, positions and depths: int32 where they fit
    starts, lengths = starts.astype(it), lengths.astype(it)
    order = np.arange(n, dtype=it)
    lcp = np.zeros(max(n - 1, 0), it)
    # active groups: segments order[lo:hi] of >= 2 rows sharing their first `depth` tokens
    live = int(n > 1)
    g_lo, g_hi, g_depth = np.zeros(live, it), np.full(live, n, it), np.zeros(live, it)
    while len(g_lo):
        sizes = g_hi - g_lo
        head = np.cumsum(sizes, dtype=it) - sizes  # member index of each group's first member
        gi = np.repeat(np.arange(len(sizes), dtype=it), sizes)  # [M] group of each member
        pos = np.arange(len(gi), dtype=it) + (g_lo - head)[gi]  # [M] position in `order`
        rows = order[pos]
        rem = lengths[rows] - g_depth[gi]  # tokens left past the group's depth
        width = int(max(1, min(rem.max(), _MAX_WIDTH, max(4, _WINDOW_ELEMS // len(gi)))))
        at = starts[rows] + g_depth[gi]  # [M] where each member's window starts
        agree = window_agreement(tokens, at, at[head][gi], width)
        agree = np.minimum(np.minimum(agree, rem), np.repeat(rem[head], sizes))
        shared = np.minimum.reduceat(agree, head)  # [G] tokens all members share past depth
        split = shared < width
        nxt = [(g_lo[~split], g_hi[~split], g_depth[~split] + width)]
        idx = np.flatnonzero(split[gi])
        if len(idx):
            sg, cut = gi[idx], shared[gi[idx]]
            inside = cut < rem[idx]  # the token at the first disagreement, or the prompt's end
            key = np.full(len(idx), _END, np.int64)
            key[inside] = tokens[at[idx][inside] + cut[inside]]
            srt = np.lexsort((key, sg))  # stable: equal prompts keep input order
            sg, key, sp = sg[srt], key[srt], pos[idx]
            order[sp] = rows[idx][srt]
            cut_depth = (g_depth + shared)[sg]
            same = sg[1:] == sg[:-1]
            change = key[1:] != key[:-1]
            done = same & (change | (key[1:] == _END))
            lcp[sp[:-1][done]] = cut_depth[:-1][done]
            new = np.flatnonzero(np.concatenate(([True], ~same | change)))
            sub = np.diff(np.append(new, len(sg)))
            live = (sub >= 2) & (key[new] != _END)
            lo = sp[new][live]
            nxt.append((lo, lo + sub[live], cut_depth[new][live] + 1))
        g_lo, g_hi, g_depth = (np.concatenate(a).astype(it, copy=False) for a in zip(*nxt))
    return order, lcp


def _nodes_from_lcp(lcp: np.ndarray, lengths_sorted: np.ndarray):
    """Tree nodes from the LCP array: (parent, end, first, last) in preorder, and for each sorted
    row the node where its prompt ends."""
    n, nb = len(lengths_sorted), len(lcp)
    it = index_dtype(2 * n + 2)  # rows, nodes (< 2n) and depths (prompt lengths are int32)
    lcp, lengths_sorted = lcp.astype(it, copy=False), lengths_sorted.astype(it, copy=False)
    k = np.arange(nb, dtype=it)
    table = RangeMin(lcp.astype(np.int32, copy=False))  # prompt lengths fit in int32
    ps = table.prev_smaller(k, lcp)
    ns = table.next_smaller(k, lcp)
    del k
    inner = np.flatnonzero(lcp > 0)
    node_key = (ps[inner] + np.int64(1)) * (int(lcp.max(initial=0)) + 1) + lcp[inner]  # (ps, value)
    _, rep, inv = np.unique(node_key, return_index=True, return_inverse=True)
    del node_key
    rep, n_in = inner[rep], len(rep)
    # indexed by boundary + 1, with sentinels past both ends: lcp -1, node 0 (the root)
    lcp_ext = np.pad(lcp, 1, constant_values=-1)
    node_ext = np.zeros(nb + 2, it)
    node_ext[inner + 1] = 1 + inv.ravel()
    del inner, inv

    def parent_via(left: np.ndarray, right: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The node of the deeper of two boundaries (the root if neither is above depth 0)."""
        lv, rv = lcp_ext[left + 1], lcp_ext[right + 1]
        return node_ext[np.where(lv >= rv, left, right) + 1], np.maximum(lv, rv)

    in_parent, _ = parent_via(ps[rep], ns[rep])
    s = np.arange(n, dtype=it)
    row_parent, mx = parent_via(s - 1, s)
    del s
    mx = np.maximum(mx, 0)
    leaf = np.flatnonzero(lengths_sorted > mx)
    n_leaf = len(leaf)
    ends_at = row_parent.copy()
    ends_at[leaf] = 1 + n_in + np.arange(n_leaf)
    one = np.ones(1, it)
    parent = np.concatenate((-one, in_parent, row_parent[leaf]))
    end = np.concatenate((0 * one, lcp[rep], lengths_sorted[leaf]))
    first = np.concatenate((0 * one, ps[rep] + 1, leaf.astype(it)))
    last = np.concatenate((n * one, ns[rep] + 1, leaf.astype(it) + 1))
    del ps, ns, row_parent, mx, leaf
    pre = np.lexsort((end, first))  # DFS preorder
    new_id = np.empty(len(pre), it)
    new_id[pre] = np.arange(len(pre), dtype=it)
    parent = np.where(parent[pre] >= 0, new_id[np.maximum(parent[pre], 0)], -1).astype(it)
    return parent, end[pre], first[pre], last[pre], new_id[ends_at]


class PrefixTree:
    """Compressed token prefix tree of all prompts; see the module docstring for the layout."""

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray) -> None:
        self.tokens = tokens  # [T] flat token ids of every row
        self.offsets = offsets  # [R + 1] int64: row r is tokens[offsets[r]:offsets[r + 1]]
        it = index_dtype(max(len(tokens), 2 * len(offsets)))  # int32 where every index fits
        self.lengths = np.diff(offsets).astype(it)  # [R]
        self.order, self.lcp = _sort_with_lcp(tokens, offsets[:-1], self.lengths)  # [R], [R-1]
        parent, end, first, last, ends_sorted = _nodes_from_lcp(self.lcp, self.lengths[self.order])
        self.node_parent = parent  # [N] int32 (int64 where needed), -1 for the root
        self.node_end = end  # [N]: covers prompt positions [node_start, node_end)
        self.node_start = np.where(parent >= 0, end[np.maximum(parent, 0)], 0)
        self.node_first = first  # [N] rows order[first:last] pass through (or end at) the node
        self.node_last = last
        self.node_subtree_end = np.searchsorted(first, last).astype(it)  # [N] subtree [v, this)
        self.row_node = np.empty(len(self.lengths), it)  # [R] node where the row ends
        self.row_node[self.order] = ends_sorted
        self.node_terminal = np.bincount(self.row_node, minlength=len(parent))  # rows ending here
        self.tree_tokens = int((end - self.node_start).sum())  # distinct prefixes of all rows

    @classmethod
    def build(
        cls, prompts: Sequence[np.ndarray] | np.ndarray, offsets: np.ndarray | None = None
    ) -> PrefixTree:
        """From a list of 1-D token arrays, or from one flat token array plus [R + 1] offsets."""
        if offsets is None:
            lens = np.array([len(p) for p in prompts], np.int64)
            offsets = np.concatenate(([0], np.cumsum(lens)))
            flat = [np.asarray(p).ravel() for p in prompts]
            tokens = np.concatenate(flat) if flat else np.zeros(0, np.int32)
        else:
            tokens, offsets = np.ascontiguousarray(prompts), np.asarray(offsets, np.int64)
            if tokens.ndim != 1 or offsets.ndim != 1 or len(offsets) < 1 or offsets[0] != 0:
                raise ValueError("expected flat 1-D tokens and offsets starting at 0")
            if np.any(np.diff(offsets) < 0) or offsets[-1] > len(tokens):
                raise ValueError("offsets must be non-decreasing and within the tokens")
        return cls(tokens, offsets)

    @property
    def num_rows(self) -> int:
        return len(self.lengths)

    @property
    def num_nodes(self) -> int:
        return len(self.node_parent)

    @property
    def node_rows(self) -> np.ndarray:
        """[N] rows whose prompt passes through or ends at each node."""
        return self.node_last - self.node_first

    @property
    def node_source(self) -> np.ndarray:
        """[N] a row whose prompt[:node_end] is the node's whole prefix (-1 in an empty tree)."""
        if self.num_rows == 0:
            return np.full(self.num_nodes, -1, np.int64)
        return self.order[np.minimum(self.node_first, self.num_rows - 1)]

    def prompt(self, row: int) -> np.ndarray:
        return self.tokens[self.offsets[row] : self.offsets[row + 1]]

    def edge(self, node: int) -> np.ndarray:
        """The tokens of the node's edge, prompt positions [node_start, node_end)."""
        src = self.offsets[self.node_source[node]]
        return self.tokens[src + self.node_start[node] : src + self.node_end[node]]

    def check(self) -> None:
        """Asserts every invariant; O(total prompt tokens), for tests and debugging."""
        n, nn = self.num_rows, self.num_nodes
        par, end, first, last = self.node_parent, self.node_end, self.node_first, self.node_last
        assert np.array_equal(np.sort(self.order), np.arange(n)), "order is not a permutation"
        self._check_lcp()
        assert par[0] == -1 and end[0] == 0 and first[0] == 0 and last[0] == n, "bad root"
        v = np.arange(1, nn)
        p = par[1:]
        assert np.all((p >= 0) & (p < v)), "parents must precede children (preorder)"
        assert np.all(end[1:] > end[p]), "every edge must hold at least one token"
        assert np.all((first[p] <= first[1:]) & (last[1:] <= last[p])), "rows not nested"
        assert np.all(first[1:] < last[1:]), "empty node"
        kids = np.bincount(p, minlength=nn)
        rows_kids = np.bincount(p, weights=last[1:] - first[1:], minlength=nn)
        assert np.array_equal(self.node_rows, self.node_terminal + rows_kids), "row counts"
        assert np.all((kids[1:] >= 2) | (self.node_terminal[1:] > 0)), "node not compressed"
        assert np.array_equal(self.node_subtree_end, np.searchsorted(first, last))
        if n > 1:  # rows under a node share its prefix, and the node is maximal
            inner = np.flatnonzero(last - first >= 2)
            assert np.all(RangeMin(self.lcp).range_min(first[inner], last[inner] - 1)
                          >= end[inner]), "rows under a node differ within its prefix"
            lcp_ext = np.concatenate(([-1], self.lcp, [-1]))
            assert np.all(lcp_ext[first[1:]] < end[1:]) and np.all(lcp_ext[last[1:]] < end[1:])
        # siblings (same parent) follow in preorder with strictly increasing first edge tokens
        src = self.offsets[self.node_source[1:]] + self.node_start[1:]
        tok0 = self.tokens[src].astype(np.int64) if nn > 1 else np.zeros(0, np.int64)
        sib = np.argsort(p, kind="stable")
        same = p[sib][1:] == p[sib][:-1]
        assert np.all(tok0[sib][1:][same] > tok0[sib][:-1][same]), "siblings out of order"
        rank = np.empty(n, np.int64)
        rank[self.order] = np.arange(n)
        rn = self.row_node
        assert np.array_equal(self.lengths, end[rn]), "a row must end exactly at its node"
        assert np.all((first[rn] <= rank) & (rank < last[rn])), "a row outside its end node"
        assert np.array_equal(self.node_terminal, np.bincount(rn, minlength=nn))
        distinct = int(self.lengths.sum() - self.lcp.sum())  # distinct non-empty prefixes
        assert self.tree_tokens == int((end - self.node_start).sum()) == distinct

    def _check_lcp(self, chunk: int = 1 << 22) -> None:
        """Adjacent sorted rows: equal on [0, lcp), then in order (or the first one ends)."""
        a, b, lcp = self.order[:-1], self.order[1:], self.lcp
        la, lb = self.lengths[a], self.lengths[b]
        assert np.all((lcp <= la) & (lcp <= lb)), "lcp longer than a prompt"
        oa, ob = self.offsets[a], self.offsets[b]
        tok = self.tokens if len(self.tokens) else np.zeros(1, np.int64)
        ta = tok[np.minimum(oa + lcp, len(tok) - 1)].astype(np.int64)
        tb = tok[np.minimum(ob + lcp, len(tok) - 1)].astype(np.int64)
        assert np.all((lcp == la) | ((lcp < lb) & (ta < tb))), "out of order or lcp too short"
        cum = np.cumsum(lcp)
        cuts = np.searchsorted(cum, np.arange(chunk, int(cum[-1]) + 1 if len(cum) else 0, chunk))
        lo = 0
        for hi in [*np.unique(cuts + 1).tolist(), len(lcp)]:  # about `chunk` tokens at a time
            if hi > lo:
                ia = concat_ranges(oa[lo:hi], lcp[lo:hi])
                ib = concat_ranges(ob[lo:hi], lcp[lo:hi])
                assert np.array_equal(self.tokens[ia], self.tokens[ib]), "lcp too long"
                lo = hi

    def pretty(
        self, max_nodes: int = 64, max_tokens: int = 8,
        decode: Callable[[list[int]], str] | None = None,
    ) -> str:
        """Indented dump of the first `max_nodes` nodes in preorder: [id] start:end, rows under,
        rows ending here, and the edge's first tokens (or `decode(tokens)` text)."""
        depth = node_depths(self.node_parent)
        head = (f"PrefixTree rows={self.num_rows} nodes={self.num_nodes} "
                f"tree_tokens={self.tree_tokens} prompt_tokens={int(self.lengths.sum())}")
        lines = [head]
        for v in range(min(max_nodes, self.num_nodes)):
            edge = self.edge(v)[:max_tokens].tolist()
            shown = repr(decode(edge)) if decode else " ".join(map(str, edge))
            more = " ..." if self.node_end[v] - self.node_start[v] > max_tokens else ""
            lines.append(f"{'  ' * int(depth[v])}[{v}] {self.node_start[v]}:{self.node_end[v]} "
                         f"rows={self.node_rows[v]} term={self.node_terminal[v]} "
                         f"| {shown}{more}")
        if self.num_nodes > max_nodes:
            lines.append(f"... {self.num_nodes - max_nodes} more nodes")
        return "\n".join(lines)


if __name__ == "__main__":
    demo = [[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 2, 3], [1, 2, 3], [7, 8], [1, 9]]
    tree = PrefixTree.build([np.array(p, np.int32) for p in demo])
    tree.check()
    print(tree.pretty())
