"""The page pool: fixed-size KV pages handed out by id, with reference counts. Ints only."""

from __future__ import annotations


class PagePool:
    """Pages 0..num_pages-1. A page is free when its reference count is 0.

    `allocate` gives pages with count 1: a fresh pool hands out the lowest ids first, then freed
    pages come back last freed first (a stack, so the touched part of the cache stays compact);
    `share` adds a reference; `release` drops one and frees pages that reach 0.
    "Does not fit" is a None from `allocate`, never an exception.
    """

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self.refs = [0] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: pop() gives the lowest id
        self.peak_used = 0
        self.num_shared = 0  # pages referenced more than once right now
        self.peak_shared = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self.refs[p] = 1
        self.peak_used = max(self.peak_used, self.num_used)
        return pages

    def share(self, pages: list[int]) -> None:
        for p in pages:
            assert self.refs[p] > 0, f"page {p} is free and cannot be shared"
            self.refs[p] += 1
            if self.refs[p] == 2:
                self.num_shared += 1
        self.peak_shared = max(self.peak_shared, self.num_shared)

    def release(self, pages: list[int]) -> None:
        for p in pages:
            assert self.refs[p] > 0, f"page {p} released more often than referenced"
            self.refs[p] -= 1
            if self.refs[p] == 1:
                self.num_shared -= 1
            elif self.refs[p] == 0:
                self._free.append(p)

    def check(self) -> None:
        """Assert that the free list holds exactly the pages with count 0, once each, and that
        `num_shared` counts the pages referenced more than once."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is twice in the free list"
        for p, r in enumerate(self.refs):
            assert (r == 0) == (p in free), f"page {p}: refs {r}, free {p in free}"
        assert self.num_shared == sum(1 for r in self.refs if r > 1), "shared page count"
