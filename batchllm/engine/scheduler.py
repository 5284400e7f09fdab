"""One `schedule()` per step: which sequences run how many tokens, against a token budget and the
page pool. Continuous batching: finished sequences leave at once, waiting ones are admitted at
every step in plan order. When pages run out, the latest admitted sequence is preempted (its
pages freed, recomputed later). Shared prefixes live in a `PrefixStore` (prefix_store.py): a
computed prefix keeps its pages until its last dependent is admitted, and each dependent borrows
them on admission. Ints only: no tensors here.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import NamedTuple

from batchllm.engine.pages import PagePool
from batchllm.engine.prefix_store import PrefixStore
from batchllm.engine.request import Kind, Request

_LOOKAHEAD = 64  # waiting sequences scanned past one blocked on an unfinished prefix


class StepPlan(NamedTuple):
    seqs: list[Request]  # sequences that run tokens this step, in admission order
    num_tokens: list[int]  # tokens each runs
    copies: list[tuple[int, int]]  # (source page, destination page), to copy before the step
    from_prefix: list[Request]  # rows admitted whose whole prompt is a computed prefix


@dataclass
class _PlanBuilder:
    """The step plan as it is filled, with the token budget left."""

    budget: int
    seqs: list[Request] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    from_prefix: list[Request] = field(default_factory=list)

    def take(self, seq: Request, n: int) -> None:
        self.seqs.append(seq)
        self.num_tokens.append(n)
        self.budget -= n

    def build(self) -> StepPlan:
        return StepPlan(self.seqs, self.num_tokens, self.copies, self.from_prefix)


class KVCacheTooSmall(RuntimeError):
    pass


@dataclass
class Scheduler:
    pool: PagePool
    page_size: int
    max_num_seqs: int
    max_batched_tokens: int
    node_users: dict[int, int] = field(default_factory=dict)  # prefix node -> dependents
    waiting: deque[Request] = field(default_factory=deque)  # hold no pages, computed 0
    running: list[Request] = field(default_factory=list)  # in admission order
    prefixes: PrefixStore = field(init=False)  # `node in prefixes`: computed and held
    preemptions: int = 0

    def __post_init__(self) -> None:
        self.prefixes = PrefixStore(self.pool, self.page_size)

    def add(self, seq: Request) -> None:
        if seq.parent in self.prefixes.evicted:
            seq.parent = -1
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _pages_short(self, seq: Request, upto: int) -> int:
        return max(0, -(-upto // self.page_size) - len(seq.pages))

    def schedule(self) -> StepPlan:
        plan = _PlanBuilder(self.max_batched_tokens)
        preempted = False
        i = 0
        ps, running, pool = self.page_size, self.running, self.pool
        seqs, num_tokens = plan.seqs, plan.num_tokens  # filled here directly: one row's cost
        budget = plan.budget  # is a few operations, most of them a decode's, needing no page
        while i < len(running) and budget > 0:
            seq = running[i]
            computed = seq.computed
            n = min(len(seq.token_ids) - computed, budget)
            if n <= 0:  # overlap: its last token (a length limit) is in flight, not yet read
                i += 1
                continue
            need = -(-(computed + n) // ps) - len(seq.pages)
            if need > 0:
                while need > pool.num_free and running[-1] is not seq:
                    self._preempt(running[-1])
                    preempted = True
                if need > pool.num_free:
                    self._preempt(seq)
                    preempted = True
                    break
                seq.pages += pool.allocate(need)
            seqs.append(seq)
            num_tokens.append(n)
            budget -= n
            i += 1
        plan.budget = budget
        if not preempted:
            self._admit(plan)
        # Nothing runs and nothing fits: pinned prefixes hold the pages. Degrade: drop pinned
        # prefixes (their dependents recompute them) until the head of the queue fits.
        while not self.running and self.waiting and self._evict_prefix():
            self._admit(plan)
        if not self.running and self.waiting:
            head = self.waiting[0]
            need = -(-(head.total + 1) // self.page_size)
            raise KVCacheTooSmall(
                f"the KV cache has {self.pool.num_pages} pages of {self.page_size} tokens; "
                f"a request of {head.total} tokens needs {need}: give engine.kv_cache_memory more"
            )
        return plan.build()

    def _admit(self, plan: _PlanBuilder) -> None:
        """Admit waiting sequences in order while the budget, max_num_seqs and the pages allow;
        the first that does not fit stops admission (a 1% watermark of the pool stays free for
        the running sequences' decode pages). Skips those whose prefix is still computing."""
        watermark = self.pool.num_pages // 100
        scanned = 0
        idx = 0
        while (idx < len(self.waiting) and scanned < _LOOKAHEAD and plan.budget > 0
               and len(self.running) < self.max_num_seqs):
            seq = self.waiting[idx]
            scanned += 1
            if seq.parent >= 0 and seq.parent not in self.prefixes:
                idx += 1  # its prefix is still being computed
                continue
            fits, copy = self._attach(seq)
            n = min(seq.total - seq.computed, plan.budget)
            need = self._pages_short(seq, seq.computed + n)
            if not fits or need > self.pool.num_free - watermark:
                self._reset(seq)
                break
            seq.pages += self.pool.allocate(need)
            del self.waiting[idx]
            if seq.parent >= 0:
                self.prefixes.unpin(seq.parent)
            self.running.append(seq)
            if copy is not None:
                plan.copies.append(copy)
            if n == 0:
                plan.from_prefix.append(seq)
            else:
                plan.take(seq, n)

    def _attach(self, seq: Request) -> tuple[bool, tuple[int, int] | None]:
        """Borrow the parent prefix's pages, if it has one. Returns whether the page for the
        copy of a partial last page could be had, and that copy (source, destination), if any."""
        if seq.parent < 0:
            return True, None
        got = self.prefixes.attach(seq.parent)
        if got is None:
            return False, None
        seq.pages = got.pages
        seq.num_borrowed_pages = got.num_shared
        seq.computed = got.end
        if seq.kind is Kind.ROW:
            seq.cached_tokens = got.end
        return True, got.copy

    def _release(self, seq: Request) -> None:
        """Give back every page `seq` holds (borrowed ones drop a reference)."""
        self.pool.release(seq.pages)
        seq.pages = []
        seq.num_borrowed_pages = 0

    def _reset(self, seq: Request) -> None:
        """`seq` loses its pages and starts over: nothing computed, nothing borrowed."""
        self._release(seq)
        seq.computed = 0
        seq.cached_tokens = 0

    def _evict_prefix(self) -> bool:
        """Evict the most recently computed prefix; False when there is none."""
        node = self.prefixes.evict()
        if node is None:
            return False
        for seq in self.waiting:
            if seq.parent == node:
                seq.parent = -1
        return True

    def _preempt(self, seq: Request) -> None:
        """Free a running sequence's pages and put it first in line, to be recomputed."""
        self.running.remove(seq)
        self._reset(seq)
        if not self.prefixes.repin(seq.parent):
            seq.parent = -1  # the prefix is gone: compute everything itself
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def step_done(self, plan: StepPlan) -> None:
        """Advance the counters after the forward pass; completed prefixes go to the store."""
        for seq, n in zip(plan.seqs, plan.num_tokens):
            seq.computed += n
            if seq.kind is Kind.PREFIX and seq.computed == seq.total:
                self.running.remove(seq)
                self.prefixes.add(seq.key, seq.pages, seq.total, self.node_users.get(seq.key, 0))

    def finish(self, seq: Request) -> None:
        """A row is done: its pages go back to the pool at once."""
        self.finish_many([seq])

    def finish_many(self, seqs: list[Request]) -> None:
        """Rows done in one step: their pages go back in that order, and `running` is rebuilt
        once (not one O(running) removal per row). With overlap a row may be found done after
        it was preempted (its last token read one step late): it leaves `waiting` then."""
        if not seqs:
            return
        for seq in seqs:
            self._release(seq)
        done = {id(s) for s in seqs}
        before = len(self.running)
        self.running = [s for s in self.running if id(s) not in done]
        if before - len(self.running) < len(seqs):
            self.waiting = deque(s for s in self.waiting if id(s) not in done)

    def check(self) -> None:
        """Assert that the pool's reference counts are exactly what the stored prefixes and the
        running sequences hold, that waiting sequences hold nothing, and the store's invariants."""
        self.pool.check()
        self.prefixes.check()
        refs = Counter(self.prefixes.held())
        for seq in self.running:
            refs.update(seq.pages)
        for p, r in enumerate(self.pool.refs):
            assert refs[p] == r, f"page {p}: pool counts {r}, holders {refs[p]}"
        for seq in self.waiting:
            assert not seq.pages and seq.computed == 0, f"waiting {seq.kind} {seq.key} holds KV"
        assert len(self.running) <= self.max_num_seqs, "more running than max_num_seqs"
