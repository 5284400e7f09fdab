"""One `schedule()` per step: which sequences run how many tokens, against a token budget and the
page pool. Continuous batching: finished sequences leave at once, waiting ones are admitted at
every step in plan order (with `burst`, in bursts while the running ones decode: `_admit`).
When pages run out, the latest admitted sequence is preempted (its pages freed, recomputed
later). Shared prefixes live in a `PrefixStore` (prefix_store.py): a computed prefix keeps its
pages until its last dependent is admitted, and each dependent borrows them on admission. Ints
only: no tensors here.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from batchllm.engine.pages import PagePool
from batchllm.engine.prefix_store import PrefixStore
from batchllm.engine.request import Kind, Request
from batchllm.engine.row_slots import RowSlots
from batchllm.engine.step_plan import PlanBuilder, StepPlan

_LOOKAHEAD = 64  # waiting sequences scanned past one blocked on an unfinished prefix


class KVCacheTooSmall(RuntimeError):
    pass


@dataclass
class Scheduler:
    pool: PagePool
    page_size: int
    max_num_seqs: int
    max_batched_tokens: int
    node_users: dict[int, int] = field(default_factory=dict)  # prefix node -> dependents
    state: RowSlots | None = None  # the slots of every request it is given; None: the first's
    waiting: deque[Request] = field(default_factory=deque)  # hold no pages, computed 0
    prefixes: PrefixStore = field(init=False)  # `node in prefixes`: computed and held
    preemptions: int = 0
    burst: int = 0  # > 0: while every running sequence decodes, admit only once this many
    # slots are free (or every waiting one fits): decode-only steps, which a graph replays

    def __post_init__(self) -> None:
        self.prefixes = PrefixStore(self.pool, self.page_size)
        self._running: dict[int, Request] = {}  # slot -> request, in admission order
        self._slots: np.ndarray | None = None  # [R] their slots; None: to be made again

    @property
    def running(self) -> list[Request]:
        """The running sequences, in admission order."""
        return list(self._running.values())

    @property
    def num_running(self) -> int:
        return len(self._running)

    def _run(self, seq: Request) -> None:
        self._running[seq.slot] = seq
        self._slots = None

    def _stop_running(self, seq: Request) -> None:
        del self._running[seq.slot]
        self._slots = None

    def running_slots(self) -> np.ndarray:
        """[R] int64: the running sequences' slots, in admission order (made again only after
        the running set changed)."""
        if self._slots is None:
            self._slots = np.fromiter(self._running, np.int64, len(self._running))
        return self._slots

    def add(self, seq: Request) -> None:
        if self.state is None:
            self.state = seq.state
        if seq.parent in self.prefixes.evicted:
            seq.parent = -1
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self._running)

    def _pages_short(self, seq: Request, upto: int) -> int:
        return max(0, -(-upto // self.page_size) - seq.num_pages)

    def schedule(self) -> StepPlan:
        plan = PlanBuilder(self.max_batched_tokens, self.state)
        preempted = not self._schedule_running(plan)
        if not preempted:
            self._admit(plan)
        # Nothing runs and nothing fits: pinned prefixes hold the pages. Degrade: drop pinned
        # prefixes (their dependents recompute them) until the head of the queue fits.
        while not self._running and self.waiting and self._evict_prefix():
            self._admit(plan)
        if not self._running and self.waiting:
            head = self.waiting[0]
            need = -(-(head.total + 1) // self.page_size)
            raise KVCacheTooSmall(
                f"the KV cache has {self.pool.num_pages} pages of {self.page_size} tokens; "
                f"a request of {head.total} tokens needs {need}: give engine.kv_cache_memory more"
            )
        return plan.build()

    def _schedule_running(self, plan: PlanBuilder) -> bool:
        """The running sequences' tokens, in admission order, while the budget lasts: over
        their slots' arrays, Python only for those that need a page. False when pages ran
        short and some were preempted (then sequentially, as `_schedule_in_turn`)."""
        run = self.running_slots()  # [R]
        if not len(run):
            return True
        st = self.state
        computed = st.computed[run]  # [R]
        rest = st.total[run] - computed  # [R] known ids not run yet
        left = plan.budget - (np.cumsum(rest) - rest)  # [R] budget left when a row's turn comes
        taken = (rest > 0) & (left > 0)  # (rest 0: a length limit's last token in flight)
        n = np.minimum(rest, left)[taken]  # [B]
        slots = run[taken]  # [B]
        need = -(-(computed[taken] + n) // self.page_size) - st.num_pages[slots]  # [B]
        short = (need > 0).nonzero()[0]
        k = need[short]  # [N] pages each of those needs
        if int(k.sum()) > self.pool.num_free:
            return self._schedule_in_turn(plan)
        if len(short):  # one allocation: the ids the same calls in turn would give
            got = np.asarray(self.pool.allocate(int(k.sum())), dtype=np.int32)
            to = np.repeat(slots[short], k)
            at = st.num_pages[to] + np.arange(len(got)) - np.repeat(np.cumsum(k) - k, k)
            st.widen("table", int(at.max()) + 1)
            st.table[to, at] = got
            st.num_pages[slots[short]] += k
        plan.take_many(slots, n)
        return True

    def _schedule_in_turn(self, plan: PlanBuilder) -> bool:
        """The running sequences one by one, preempting the latest admitted while pages are
        short. Returns False (some were preempted)."""
        ps, pool = self.page_size, self.pool
        running = self.running
        i = 0
        while i < len(running) and plan.budget > 0:
            seq = running[i]
            computed = seq.computed
            n = min(seq.total - computed, plan.budget)
            if n <= 0:  # overlap: its last token (a length limit) is in flight, not yet read
                i += 1
                continue
            need = -(-(computed + n) // ps) - seq.num_pages
            if need > 0:
                while need > pool.num_free and running[-1] is not seq:
                    self._preempt(running.pop())
                if need > pool.num_free:
                    self._preempt(seq)
                    break
                seq.add_pages(pool.allocate(need))
            plan.take(seq, n)
            i += 1
        return False

    def _admit(self, plan: PlanBuilder) -> None:
        """Admit waiting sequences in order while the budget, max_num_seqs and the pages allow;
        the first that does not fit stops admission (a 1% watermark of the pool stays free for
        the running sequences' decode pages). Skips those whose prefix is still computing.

        With `burst`, a step whose running sequences all decode one token admits nothing until
        `burst` slots are free (or all that wait fit): new rows come in bursts, their prefill
        in a few mixed steps, and the steps between are decode-only, the steps a CUDA graph
        replays (cuda_graphs.py). A step already mixed (a prompt's chunk running) admits as
        usual. vLLM V0's scheduler_delay_factor and SGLang's separate prefill and decode
        batches trade a little occupancy the same way."""
        if self.burst and len(plan.counts) and int(plan.counts.max()) == 1 and (
                self.max_num_seqs - len(self._running) < min(self.burst, len(self.waiting))):
            return  # a decode-only step, too few slots free for a burst
        watermark = self.pool.num_pages // 100
        scanned = 0
        idx = 0
        while (idx < len(self.waiting) and scanned < _LOOKAHEAD and plan.budget > 0
               and len(self._running) < self.max_num_seqs):
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
            seq.add_pages(self.pool.allocate(need))
            del self.waiting[idx]
            if seq.parent >= 0:
                self.prefixes.unpin(seq.parent)
            self._run(seq)
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
        seq.set_pages(got.pages)
        seq.num_borrowed_pages = got.num_shared
        seq.computed = got.end
        if seq.kind is Kind.ROW:
            seq.cached_tokens = got.end
        return True, got.copy

    def _release(self, seqs: list[Request]) -> None:
        """Give back every page the sequences hold (borrowed ones drop a reference), in one
        release, in the order releases one by one would take."""
        st = self.state
        slots = np.fromiter((seq.slot for seq in seqs), np.int64, len(seqs))  # [F]
        held = st.num_pages[slots]  # [F]
        rows = np.repeat(slots, held)  # [P]
        cols = np.arange(len(rows)) - np.repeat(np.cumsum(held) - held, held)  # [P]
        self.pool.release(st.table[rows, cols])
        st.num_pages[slots] = st.borrowed[slots] = st.table[slots] = 0
        st.renewed[slots] = True

    def _reset(self, seq: Request) -> None:
        """`seq` loses its pages and starts over: nothing computed, nothing borrowed."""
        self._release([seq])
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
        self._stop_running(seq)
        self._reset(seq)
        if not self.prefixes.repin(seq.parent):
            seq.parent = -1  # the prefix is gone: compute everything itself
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def step_done(self, plan: StepPlan) -> None:
        """Advance the counters after the forward pass; completed prefixes go to the store and
        give their slots back."""
        st = self.state
        if st is None or not len(plan.slots):
            return
        st.computed[plan.slots] += plan.counts  # a step runs a sequence once: no repeats
        ends = plan.slots[~st.is_row[plan.slots]]
        ends = ends[st.computed[ends] == st.total[ends]]
        if len(ends):
            plan.keep_seqs()  # before the prefixes give their slots back
        for slot in ends.tolist():
            seq = self._running[slot]
            self._stop_running(seq)
            self.prefixes.add(seq.key, seq.pages, seq.total, self.node_users.get(seq.key, 0))
            st.give_back(slot)

    def finish(self, seq: Request) -> None:
        """A row is done: its pages go back to the pool at once."""
        self.finish_many([seq])

    def finish_many(self, seqs: list[Request]) -> None:
        """Rows done in one step: their pages go back in that order and they leave `running`.
        With overlap a row may be found done after it was preempted (its last token read one
        step late): it leaves `waiting` then, and drops the pin it held on its prefix."""
        if not seqs:
            return
        self._release(seqs)
        late = []
        for seq in seqs:
            if self._running.pop(seq.slot, None) is None:
                late.append(id(seq))
                if seq.parent >= 0:  # the pin its preemption took (it will not attach again)
                    self.prefixes.unpin(seq.parent)
        self._slots = None
        if late:
            self.waiting = deque(s for s in self.waiting if id(s) not in late)
