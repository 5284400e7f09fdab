"""The computed shared prefixes and their pages, kept while dependents still need them. Ints only.

Reference counting: a stored prefix holds one reference on each of its pages (the references
its computation took, handed over when it finished). Each dependent that attaches adds one
reference to the prefix's *full* pages and gets a page of its own for a partial last page, into
which the engine copies the prefix's positions before the step. So a page's count in the pool is
(1 if a stored prefix holds it) + (the running sequences that borrowed it) + (child prefixes,
stored or running, that borrowed it).

Pins: a prefix is stored with `pins` = its dependents not yet admitted (rows and child prefixes
of the plan). Admitting one unpins once; a preempted dependent that will borrow again pins once
more. At 0 pins the prefix releases its references and is gone; a prefix nobody depends on is
never stored.

Eviction: when nothing runs and nothing fits (pinned prefixes hold the pages), the scheduler
evicts the most recently computed prefix first, which releases its references at once. Sequences
already running keep the pages they borrowed; dependents not yet admitted compute the prefix's
tokens themselves. The node is remembered in `evicted` so that dependents added later know it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from batchllm.engine.pages import PagePool


@dataclass
class PrefixEntry:
    """A computed shared prefix: its pages hold positions [0, end)."""

    pages: list[int]
    end: int
    pins: int  # dependents not yet admitted; always > 0 while stored


class Borrowed(NamedTuple):
    """What a dependent gets from `PrefixStore.attach`."""

    pages: list[int]  # the prefix's full pages (shared), then its own copy of a partial last page
    num_shared: int  # leading entries of `pages` that are the prefix's (not to be written)
    end: int  # positions [0, end) are in `pages` once the copy is made
    copy: tuple[int, int] | None  # (source page, destination page) to copy before the step


class PrefixStore:
    """Computed shared prefixes by node id, in the order they were computed."""

    def __init__(self, pool: PagePool, page_size: int) -> None:
        self.pool = pool
        self.page_size = page_size
        self._entries: dict[int, PrefixEntry] = {}  # insertion order = order computed
        self.evicted: set[int] = set()  # nodes dropped by `evict`; never stored again

    def __contains__(self, node: int) -> bool:
        """Whether `node` is computed and its pages are held."""
        return node in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def entry(self, node: int) -> PrefixEntry:
        return self._entries[node]

    def add(self, node: int, pages: list[int], end: int, pins: int) -> None:
        """Store a prefix just computed; takes over the references its computation held on
        `pages`. With no dependents (`pins` 0) they are released at once."""
        assert node not in self._entries and node not in self.evicted, f"prefix {node} again"
        if pins == 0:
            self.pool.release(pages)
            return
        self._entries[node] = PrefixEntry(pages, end, pins)

    def attach(self, node: int) -> Borrowed | None:
        """Borrow the pages of stored prefix `node` for a dependent (the pin is not dropped:
        that is `unpin`, once the dependent is admitted). None when the page for the copy of a
        partial last page does not fit; nothing is then held."""
        entry = self._entries[node]
        full = entry.end // self.page_size
        pages = entry.pages[:full]
        self.pool.share(pages)
        if entry.end % self.page_size == 0:
            return Borrowed(pages, full, entry.end, None)
        own = self.pool.allocate(1)
        if own is None:
            self.pool.release(pages)
            return None
        return Borrowed(pages + own, full, entry.end, (entry.pages[full], own[0]))

    def unpin(self, node: int) -> None:
        """A dependent of `node` was admitted; the last one releases the prefix's pages."""
        entry = self._entries[node]
        entry.pins -= 1
        if entry.pins == 0:
            self.pool.release(entry.pages)
            del self._entries[node]

    def repin(self, node: int) -> bool:
        """A dependent that lost its pages will attach again: pin `node` once more. False when
        the prefix is no longer held (the dependent must compute it itself)."""
        if node not in self._entries:
            return False
        self._entries[node].pins += 1
        return True

    def evict(self) -> int | None:
        """Release the most recently computed prefix; returns its node, or None when empty."""
        if not self._entries:
            return None
        node = next(reversed(self._entries))
        self.pool.release(self._entries.pop(node).pages)
        self.evicted.add(node)
        return node

    def held(self) -> dict[int, int]:
        """Page -> references the stored prefixes hold on it."""
        refs: dict[int, int] = {}
        for entry in self._entries.values():
            for p in entry.pages:
                refs[p] = refs.get(p, 0) + 1
        return refs

    def check(self) -> None:
        """Assert the invariants: pins > 0, one page per started page of [0, end), distinct
        pages per prefix, never more references held than the pool counts, evicted not held."""
        for node, e in self._entries.items():
            assert e.pins > 0, f"prefix {node} stored with {e.pins} pins"
            assert len(e.pages) == -(-e.end // self.page_size), f"prefix {node}: page count"
            assert len(set(e.pages)) == len(e.pages), f"prefix {node}: a page twice"
            assert node not in self.evicted, f"prefix {node} evicted yet held"
        for p, n in self.held().items():
            assert self.pool.refs[p] >= n, f"page {p}: {self.pool.refs[p]} refs, prefixes hold {n}"

    def pretty(self) -> str:
        """One line per stored prefix (oldest first), then the evicted nodes."""
        lines = [f"prefix {node}: end {e.end}, pins {e.pins}, pages {e.pages}"
                 for node, e in self._entries.items()]
        if self.evicted:
            lines.append(f"evicted: {sorted(self.evicted)}")
        return "\n".join(lines) if lines else "(no prefixes)"


if __name__ == "__main__":
    # A prefix of 6 tokens on pages of 4: one full page, one partial; two dependents.
    pool = PagePool(8)
    store = PrefixStore(pool, page_size=4)
    store.add(0, pool.allocate(2), end=6, pins=2)
    print(store.pretty())
    b = store.attach(0)
    print("borrowed", b)
    store.unpin(0)
    print(store.pretty(), "| refs", pool.refs)
    store.check()
