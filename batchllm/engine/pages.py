"""The page pool: fixed-size KV pages handed out by id, with reference counts, in arrays."""

from __future__ import annotations

import numpy as np


class PageRefs:
    """The pool's reference counts, read like a list of ints (`refs[p]`, `refs[:4] == [...]`);
    `array` is the int32 array itself, for vectorised checks."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def __getitem__(self, key: int | slice) -> int | list[int]:
        got = self.array[key]
        return got.tolist() if isinstance(key, slice) else int(got)

    def __len__(self) -> int:
        return len(self.array)

    def __iter__(self):
        return iter(self.array.tolist())

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other) if isinstance(other, (list, tuple, PageRefs)) else False

    def __repr__(self) -> str:
        return repr(self.array)


class PagePool:
    """Pages 0..num_pages-1. A page is free when its reference count is 0.

    `allocate` gives pages with count 1: a fresh pool hands out the lowest ids first, then freed
    pages come back last freed first (a stack, so the touched part of the cache stays compact);
    `share` adds a reference; `release` drops one and frees pages that reach 0.
    "Does not fit" is a None from `allocate`, never an exception.

    Held in two int32 arrays, O(1) per page: the counts, and a stack of freed ids above a high
    water mark (`_fresh`: ids from it up were never handed out). Both are allocated untouched
    (np.zeros / np.empty), so a pool of 10^8 pages costs memory only for the pages it uses.
    """

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self.refs = PageRefs(np.zeros(num_pages, dtype=np.int32))
        self._stack = np.empty(num_pages, dtype=np.int32)  # freed ids, the last freed on top
        self._top = 0  # entries in _stack
        self._fresh = 0  # ids >= _fresh never handed out
        self.peak_used = 0
        self.num_shared = 0  # pages referenced more than once right now
        self.peak_shared = 0

    @property
    def num_free(self) -> int:
        return self._top + self.num_pages - self._fresh

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    def allocate(self, n: int) -> list[int] | None:
        free = self.num_free
        if n > free:
            return None
        refs = self.refs.array
        reused = min(n, self._top)
        pages: list[int] = []
        if reused:  # the top of the stack, the last freed first
            top = self._top
            got = self._stack[top - reused : top][::-1]
            refs[got] = 1
            self._top = top - reused
            pages = got.tolist()
        if n > reused:  # then ids never handed out, in order
            lo, hi = self._fresh, self._fresh + n - reused
            refs[lo:hi] = 1
            self._fresh = hi
            pages += range(lo, hi)
        self.peak_used = max(self.peak_used, self.num_pages - free + n)
        return pages

    def share(self, pages: list[int]) -> None:
        """One more reference to each of `pages` (distinct: one holder's), all in use."""
        if not len(pages):
            return
        at = np.asarray(pages, dtype=np.int64)
        refs = self.refs.array
        now = refs[at]
        if not now.all():
            raise AssertionError(f"page {int(at[now == 0][0])} is free and cannot be shared")
        refs[at] = now + 1
        self.num_shared += int(np.count_nonzero(now == 1))
        self.peak_shared = max(self.peak_shared, self.num_shared)

    def release(self, pages: np.ndarray | list[int]) -> None:
        """One reference fewer for each entry of `pages`, as if released one by one in that
        order (a page may repeat: several holders' pages at once); a page whose count reaches 0
        goes on the free stack then, so the freed pages are stacked in the order of their last
        entries."""
        at = np.asarray(pages, dtype=np.int64)
        if not len(at):
            return
        refs = self.refs.array
        # distinct pages, each one's last entry (its first in the reversed list), and entries
        ids, first_back, times = np.unique(at[::-1], return_index=True, return_counts=True)
        before = refs[ids]
        after = before - times
        if after.min() < 0:
            raise AssertionError(
                f"page {int(ids[after < 0][0])} released more often than referenced")
        refs[ids] = after
        self.num_shared -= int(np.count_nonzero((before > 1) & (after <= 1)))
        freed = after == 0
        self._push_free(ids[freed][np.argsort(-first_back[freed])])

    def _push_free(self, pages: np.ndarray | list[int]) -> None:
        self._stack[self._top : self._top + len(pages)] = pages
        self._top += len(pages)

    def check(self) -> None:
        """Assert that the free pages (the stack and the ids never handed out) are exactly the
        pages with count 0, once each, and that `num_shared` counts the pages referenced more
        than once. Vectorised: a second at 10^8 pages."""
        refs = self.refs.array
        stacked = self._stack[:self._top]
        assert len(np.unique(stacked)) == self._top, "a page is twice in the free list"
        free = np.zeros(self.num_pages, dtype=bool)
        free[stacked] = True
        free[self._fresh:] = True
        wrong = ((refs == 0) != free).nonzero()[0]
        if len(wrong):
            p = int(wrong[0])
            raise AssertionError(f"page {p}: refs {int(refs[p])}, free {bool(free[p])}")
        assert self.num_shared == int(np.count_nonzero(refs > 1)), "shared page count"
