"""Vectorized array helpers of the planner: range minimum / nearest smaller element, node depths
from parent ids, concatenated ranges. numpy only; no Python loop per element."""

from __future__ import annotations

import numpy as np


def index_dtype(top: int) -> type:
    """The integer type of index arrays whose values are at most `top`: int32 where they fit
    (half the planner's transient arrays: ~310 B a row at int64), else int64."""
    return np.int32 if top <= np.iinfo(np.int32).max else np.int64


class RangeMin:
    """Sparse table over a 1-D integer array: range minimum and nearest smaller element."""

    def __init__(self, values: np.ndarray) -> None:
        self.size = len(values)
        self.levels = [np.asarray(values)]  # levels[t][i] = min(values[i : i + 2**t])
        step = 1
        while 2 * step <= self.size:
            prev = self.levels[-1]
            self.levels.append(np.minimum(prev[:-step], prev[step:]))
            step *= 2

    def range_min(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """min(values[lo:hi]) for each pair (requires lo < hi)."""
        lo, hi = np.asarray(lo, np.int64), np.asarray(hi, np.int64)
        t = np.frexp((hi - lo).astype(np.float64))[1] - 1  # floor(log2(hi - lo)), exact
        out = np.empty(len(lo), self.levels[0].dtype)
        for level in np.unique(t):
            m = t == level
            table = self.levels[level]
            out[m] = np.minimum(table[lo[m]], table[hi[m] - (1 << int(level))])
        return out

    def prev_smaller(self, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """For each query, the largest j < k with values[j] < v, or -1."""
        cur = np.array(k)  # invariant: values[cur:k] >= v (k's integer type)
        for t in range(len(self.levels) - 1, -1, -1):
            step = 1 << t
            ok = cur >= step
            jump = ok & (self.levels[t][np.where(ok, cur - step, 0)] >= v)
            cur -= jump * step
        return cur - 1

    def next_smaller(self, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """For each query, the smallest j > k with values[j] < v, or len(values)."""
        cur = np.asarray(k) + 1  # invariant: values[k + 1:cur] >= v (k's integer type)
        for t in range(len(self.levels) - 1, -1, -1):
            step = 1 << t
            ok = cur <= self.size - step
            jump = ok & (self.levels[t][np.where(ok, cur, 0)] >= v)
            cur += jump * step
        return cur


def node_depths(parent: np.ndarray) -> np.ndarray:
    """Depth of each node of a forest given parent ids (-1 for a root, depth 0), by pointer
    jumping: O(n log depth), no Python loop per node."""
    jump = np.asarray(parent, np.int64).copy()
    depth = (jump >= 0).astype(np.int64)
    while True:
        has = np.flatnonzero(jump >= 0)
        has = has[jump[has] >= 0]
        if not len(has):
            return depth
        up = jump[has]
        depth[has] += depth[up]
        jump[has] = jump[up]


def concat_ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """np.concatenate([arange(s, s + n) for s, n in zip(starts, lens)]), vectorized (int64)."""
    lens = np.asarray(lens, np.int64)
    total = int(lens.sum())
    shift = np.asarray(starts, np.int64) - (np.cumsum(lens) - lens)
    return np.repeat(shift, lens) + np.arange(total, dtype=np.int64)


_CHUNK_ELEMS = 1 << 20  # tokens of the windows compared at once (a few MiB, whatever the job)


def _windows(tokens: np.ndarray, starts: np.ndarray, width: int) -> np.ndarray:
    """[len(starts), width]: tokens[s : s + width] per start; positions past the end of `tokens`
    read clipped values (callers mask every position past a prompt's end)."""
    if len(tokens) < width:
        tokens = np.concatenate([tokens, np.zeros(width - len(tokens), tokens.dtype)])
    last = len(tokens) - width
    # one overlapping "void" item per window start: a 1-D gather copies whole windows at once
    item = np.dtype((np.void, tokens.itemsize * width))
    view = np.ndarray((last + 1,), item, buffer=tokens, strides=(tokens.itemsize,))
    out = view[np.minimum(starts, last)].view(tokens.dtype).reshape(len(starts), width)
    late = np.flatnonzero(starts > last)
    if len(late):
        out[late] = tokens[np.minimum(starts[late, None] + np.arange(width), len(tokens) - 1)]
    return out


def window_agreement(tokens: np.ndarray, at: np.ndarray, head_at: np.ndarray,
               width: int) -> np.ndarray:
    """[M] how many of the `width` tokens from `at` equal those from `head_at` before the first
    difference (width when all do). Compared _CHUNK_ELEMS tokens at a time: the windows of a
    whole round (2 x M x width ids and M x width flags, ~580 bytes a row at width 64) would
    be the plan's largest temporary, growing with the job's rows."""
    agree = np.empty(len(at), np.int32)  # <= width
    step = max(1, _CHUNK_ELEMS // width)
    for lo in range(0, len(at), step):
        hi = lo + step
        neq = _windows(tokens, at[lo:hi], width) != _windows(tokens, head_at[lo:hi], width)
        first = neq.argmax(axis=1)
        agree[lo:hi] = np.where(neq[np.arange(len(first)), first], first, width)
    return agree
