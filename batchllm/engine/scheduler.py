"""One `schedule()` per step: which sequences run how many tokens, against a token budget and the
page pool. Continuous batching: finished sequences leave at once, waiting ones are admitted at
every step in plan order. When pages run out, the latest admitted sequence is preempted (its
pages freed, recomputed later). Shared prefixes: a prefix node, once computed, keeps its pages
pinned until its last dependent is admitted; each dependent borrows the full pages (reference
counts) and gets its own copy of a partial last page. Ints only: no tensors here.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from batchllm.engine.pages import PagePool
from batchllm.engine.request import Kind, Sequence

_LOOKAHEAD = 64  # waiting sequences scanned past one blocked on an unfinished prefix


@dataclass
class PrefixEntry:
    """A computed shared prefix: its pages hold positions [0, end)."""

    pages: list[int]
    end: int
    pins: int  # dependents not yet admitted; the entry holds one reference while > 0


class StepPlan(NamedTuple):
    seqs: list[Sequence]  # sequences that run tokens this step, in admission order
    num_tokens: list[int]  # tokens each runs
    copies: list[tuple[int, int]]  # (source page, destination page), to copy before the step
    from_prefix: list[Sequence]  # rows admitted whose whole prompt is a computed prefix


class KVCacheTooSmall(RuntimeError):
    pass


@dataclass
class Scheduler:
    pool: PagePool
    page_size: int
    max_num_seqs: int
    max_batched_tokens: int
    node_users: dict[int, int] = field(default_factory=dict)  # prefix node -> dependents
    waiting: deque[Sequence] = field(default_factory=deque)
    running: list[Sequence] = field(default_factory=list)
    prefixes: dict[int, PrefixEntry] = field(default_factory=dict)
    evicted: set[int] = field(default_factory=set)  # prefixes dropped under memory pressure
    preemptions: int = 0

    def add(self, seq: Sequence) -> None:
        if seq.parent in self.evicted:
            seq.parent = -1
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _pages_short(self, seq: Sequence, upto: int) -> int:
        return max(0, -(-upto // self.page_size) - len(seq.pages))

    def schedule(self) -> StepPlan:
        budget = self.max_batched_tokens
        seqs: list[Sequence] = []
        counts: list[int] = []
        copies: list[tuple[int, int]] = []
        from_prefix: list[Sequence] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.total - seq.computed, budget)
            need = self._pages_short(seq, seq.computed + n)
            while need > self.pool.num_free and self.running[-1] is not seq:
                self._preempt(self.running[-1])
                preempted = True
            if need > self.pool.num_free:
                self._preempt(seq)
                preempted = True
                break
            seq.pages += self.pool.allocate(need)
            seqs.append(seq)
            counts.append(n)
            budget -= n
            i += 1
        if not preempted:
            self._admit(budget, seqs, counts, copies, from_prefix)
        # Nothing runs and nothing fits: pinned prefixes hold the pages. Degrade: drop pinned
        # prefixes (their dependents recompute them) until the head of the queue fits.
        while not self.running and self.waiting and self._evict_prefix():
            self._admit(budget, seqs, counts, copies, from_prefix)
        if not self.running and self.waiting:
            head = self.waiting[0]
            need = -(-(head.total + 1) // self.page_size)
            raise KVCacheTooSmall(
                f"the KV cache has {self.pool.num_pages} pages of {self.page_size} tokens; "
                f"a request of {head.total} tokens needs {need}: give engine.kv_cache_memory more"
            )
        return StepPlan(seqs, counts, copies, from_prefix)

    def _admit(self, budget, seqs, counts, copies, from_prefix) -> None:
        watermark = self.pool.num_pages // 100
        scanned = 0
        idx = 0
        while (idx < len(self.waiting) and scanned < _LOOKAHEAD and budget > 0
               and len(self.running) < self.max_num_seqs):
            seq = self.waiting[idx]
            scanned += 1
            if seq.parent >= 0 and seq.parent not in self.prefixes:
                idx += 1  # its prefix is still being computed
                continue
            fits, copy = self._attach(seq)
            n = min(seq.total - seq.computed, budget)
            need = self._pages_short(seq, seq.computed + n)
            if not fits or need > self.pool.num_free - watermark:
                self._detach(seq)
                break
            seq.pages += self.pool.allocate(need)
            del self.waiting[idx]
            self._unpin(seq.parent)
            self.running.append(seq)
            if copy is not None:
                copies.append(copy)
            if n == 0:
                from_prefix.append(seq)
            else:
                seqs.append(seq)
                counts.append(n)
                budget -= n

    def _attach(self, seq: Sequence) -> tuple[bool, tuple[int, int] | None]:
        """Borrow the parent prefix's pages. Returns whether a page for the copy of a partial
        last page could be had, and that copy (source, destination), if any."""
        if seq.parent < 0:
            seq.computed = 0
            return True, None
        entry = self.prefixes[seq.parent]
        full = entry.end // self.page_size
        seq.pages = entry.pages[:full]
        self.pool.share(seq.pages)
        seq.num_borrowed_pages = full
        seq.computed = entry.end
        if seq.kind is Kind.ROW:
            seq.cached_tokens = entry.end
        if entry.end % self.page_size == 0:
            return True, None
        own = self.pool.allocate(1)
        if own is None:
            return False, None
        seq.pages.append(own[0])
        return True, (entry.pages[full], own[0])

    def _detach(self, seq: Sequence) -> None:
        self.pool.release(seq.pages)
        seq.pages = []
        seq.num_borrowed_pages = 0
        seq.computed = 0
        seq.cached_tokens = 0

    def _unpin(self, node: int) -> None:
        if node < 0:
            return
        entry = self.prefixes[node]
        entry.pins -= 1
        if entry.pins == 0:
            self.pool.release(entry.pages)
            del self.prefixes[node]

    def _evict_prefix(self) -> bool:
        """Release the most recently computed pinned prefix; False when there is none."""
        if not self.prefixes:
            return False
        node = next(reversed(self.prefixes))
        self.pool.release(self.prefixes.pop(node).pages)
        self.evicted.add(node)
        for seq in self.waiting:
            if seq.parent == node:
                seq.parent = -1
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's pages and put it first in line, to be recomputed."""
        self.running.remove(seq)
        self.pool.release(seq.pages)
        seq.pages = []
        seq.num_borrowed_pages = 0
        seq.computed = 0
        seq.cached_tokens = 0
        if seq.parent in self.prefixes:
            self.prefixes[seq.parent].pins += 1  # it will borrow again
        else:
            seq.parent = -1  # the prefix is gone: compute everything itself
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def step_done(self, plan: StepPlan) -> list[Sequence]:
        """Advance the counters after the forward pass; returns the prefixes completed now."""
        done = []
        for seq, n in zip(plan.seqs, plan.num_tokens):
            seq.computed += n
            if seq.kind is Kind.PREFIX and seq.computed == seq.total:
                self.running.remove(seq)
                pins = self.node_users.get(seq.key, 0)
                self.prefixes[seq.key] = PrefixEntry(seq.pages, seq.total, pins)
                if pins == 0:
                    self.pool.release(seq.pages)
                    del self.prefixes[seq.key]
                done.append(seq)
        return done

    def finish(self, seq: Sequence) -> None:
        """A row is done: its pages go back to the pool at once."""
        self.running.remove(seq)
        self.pool.release(seq.pages)
        seq.pages = []
