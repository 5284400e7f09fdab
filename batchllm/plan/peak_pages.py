"""A job's peak KV pages, predicted from its plan's order (`batchllm plan`'s estimate)."""

from __future__ import annotations

import numpy as np

from batchllm.plan.planner import ROW, Plan


def predict_peak_pages(plan: Plan, page_size: int, max_num_seqs: int) -> int:
    """Peak KV pages of a simple simulation of the item order.

    Approximation (an upper-ish estimate, not a promise): rows are admitted in plan order,
    `max_num_seqs` at a time, and finish in the order they were admitted (row t runs while
    rows t .. t + max_num_seqs - 1 are admitted). A running row holds the pages of its own
    part at its final length (prompt past its parent's end + max_tokens; no early stop). A
    prefix node holds its pages from the admission of its first dependent row until its last
    one finishes. A page straddling a parent's end is counted again by each child (a copy).
    The token budget per step, chunked prefill and preemption are ignored.
    """
    n, ps, seqs = plan.num_rows, int(page_size), int(max_num_seqs)
    if n == 0:
        return 0

    def ceil(a: np.ndarray) -> np.ndarray:
        return -(-a // ps)

    rp = plan.row_parent
    own = np.where(rp >= 0, np.append(plan.node_end, 0)[rp], 0).astype(np.int64)
    row_pages = ceil(plan.row_len.astype(np.int64) + plan.row_max_tokens) - own // ps
    t_row = np.empty(n, np.int64)  # admission time of each row
    t_row[plan.item_id[plan.item_kind == ROW]] = np.arange(n)
    cs = np.concatenate(([0], np.cumsum(row_pages[plan.item_id[plan.item_kind == ROW]])))
    t = np.arange(n)
    use = cs[t + 1] - cs[np.maximum(t + 1 - seqs, 0)]  # [n] pages of running rows
    g = plan.num_nodes
    if g:
        lo, hi = np.full(g, n, np.int64), np.full(g, -1, np.int64)
        has = rp >= 0
        np.minimum.at(lo, rp[has], t_row[has])
        np.maximum.at(hi, rp[has], t_row[has])
        depth = plan.node_depth()
        for d in range(int(depth.max()), 1, -1):  # deepest level first: fold into parents
            lvl = np.flatnonzero(depth == d)
            np.minimum.at(lo, plan.node_parent[lvl], lo[lvl])
            np.maximum.at(hi, plan.node_parent[lvl], hi[lvl])
        pages = ceil(plan.node_end.astype(np.int64)) - plan.node_start // ps
        diff = np.zeros(n + 1, np.int64)
        np.add.at(diff, lo, pages)
        np.add.at(diff, np.minimum(hi + seqs, n), -pages)
        use = use + np.cumsum(diff)[:n]
    return int(use.max())
