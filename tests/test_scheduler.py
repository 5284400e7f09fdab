"""The Scheduler (with its PrefixStore) on tiny hand-built cases: exact page ids given to a prefix and
borrowed by its dependents, copies of partial last pages, pins, eviction order, preemption order,
the token budget, max_num_seqs, the watermark and KVCacheTooSmall. No model: a step is
schedule -> step_done -> one sampled token per row that reached its end, as engine.py does."""

from __future__ import annotations

import pytest

from batchllm.engine.pages import PagePool
from batchllm.engine.request import Kind, Request
from batchllm.engine.row_slots import RowSlots
from batchllm.engine.scheduler import KVCacheTooSmall, Scheduler, StepPlan
from tests.scheduler_check import check_scheduler

SLOTS = RowSlots(4)  # the slots of this module's requests, as an engine's (grown as needed)


def row(key: int, prompt: int, parent: int = -1) -> Request:
    return Request(Kind.ROW, key, list(range(prompt)), prompt, parent=parent, state=SLOTS)


def prefix(key: int, end: int, parent: int = -1) -> Request:
    return Request(Kind.PREFIX, key, list(range(end)), end, parent=parent, state=SLOTS)


def scheduler(num_pages: int, page_size: int, *seqs: Request, max_num_seqs: int = 8,
              max_batched_tokens: int = 64, users: dict[int, int] | None = None) -> Scheduler:
    sched = Scheduler(PagePool(num_pages), page_size, max_num_seqs, max_batched_tokens,
                      users or {})
    for seq in seqs:
        sched.add(seq)
    return sched


def step(sched: Scheduler) -> StepPlan:
    """One engine step without the model; checks the bookkeeping after it."""
    plan = sched.schedule()
    sched.step_done(plan)
    ran_to_end = [s for s in plan.seqs if s.kind is Kind.ROW and s.computed == s.total]
    for seq in ran_to_end + plan.from_prefix:
        seq.append(7)
    check_scheduler(sched)
    return plan


def keys(seqs: list[Request]) -> list[int]:
    return [s.key for s in seqs]


def test_dependents_borrow_the_full_pages_and_copy_the_partial_last_page() -> None:
    p, r0, r1 = prefix(0, 6), row(0, 9, parent=0), row(1, 8, parent=0)
    sched = scheduler(16, 4, p, r0, r1, users={0: 2})
    plan = step(sched)
    assert (keys(plan.seqs), plan.num_tokens) == ([0], [6])  # the rows wait for their prefix
    assert keys(sched.waiting) == [0, 1]
    entry = sched.prefixes.entry(0)
    assert (entry.pages, entry.end, entry.pins) == ([0, 1], 6, 2)
    plan = step(sched)
    assert (keys(plan.seqs), plan.num_tokens) == ([0, 1], [3, 2])
    assert plan.copies == [(1, 2), (1, 4)]  # page 1 holds positions 4, 5 of the prefix
    assert (r0.pages, r0.num_borrowed_pages, r0.cached_tokens) == ([0, 2, 3], 1, 6)
    assert (r1.pages, r1.num_borrowed_pages, r1.cached_tokens) == ([0, 4], 1, 6)
    # The last pin went with r1's admission: the prefix gave its references back.
    assert 0 not in sched.prefixes
    assert sched.pool.refs[:5] == [2, 0, 1, 1, 1]


def test_page_aligned_prefix_is_borrowed_whole_without_a_copy() -> None:
    p, r = prefix(0, 8), row(0, 10, parent=0)
    sched = scheduler(8, 4, p, r, users={0: 1})
    step(sched)
    plan = step(sched)
    assert plan.copies == []
    assert (r.pages, r.num_borrowed_pages, r.computed) == ([0, 1, 2], 2, 10)
    assert plan.num_tokens == [2]


def test_row_that_is_its_whole_prefix_samples_from_it_without_running() -> None:
    p, r = prefix(0, 6), row(0, 6, parent=0)
    sched = scheduler(8, 4, p, r, users={0: 1})
    step(sched)
    plan = step(sched)
    assert (plan.seqs, keys(plan.from_prefix)) == ([], [0])
    assert plan.copies == [(1, 2)]
    assert (r.pages, r.computed, r.total) == ([0, 2], 6, 7)  # its first token was sampled


def test_prefix_without_dependents_frees_its_pages_when_computed() -> None:
    sched = scheduler(4, 2, prefix(0, 3))
    step(sched)
    assert 0 not in sched.prefixes and len(sched.prefixes) == 0
    assert sched.pool.num_used == 0 and not sched.has_work


def test_pins_dropping_to_zero_release_the_prefix_pages() -> None:
    p, r0, r1 = prefix(0, 4), row(0, 5, parent=0), row(1, 6, parent=0)
    sched = scheduler(8, 4, p, r0, r1, users={0: 2}, max_num_seqs=1)
    step(sched)
    step(sched)  # r0 admitted; r1 waits for a seat (max_num_seqs 1)
    assert sched.prefixes.entry(0).pins == 1
    assert sched.pool.refs[0] == 2  # the store and r0
    sched.finish(r0)
    assert sched.pool.refs[0] == 1
    step(sched)  # r1 admitted: the last pin
    assert 0 not in sched.prefixes and r1.pages == [0, 1]
    assert sched.pool.refs[0] == 1  # r1 alone
    sched.finish(r1)
    assert sched.pool.num_used == 0


def test_eviction_drops_the_most_recently_computed_prefix_first() -> None:
    a, b = prefix(0, 4), prefix(1, 4)
    x = row(0, 12)  # needs 3 of the 4 pages while the two prefixes hold 2
    ra, rb = row(1, 6, parent=0), row(2, 6, parent=1)
    sched = scheduler(4, 4, a, b, x, ra, rb, users={0: 1, 1: 1})
    plan = step(sched)
    assert keys(plan.seqs) == [0, 1] and (a.pages, b.pages) == ([0], [1])
    assert sched.prefixes.pretty() == (
        "prefix 0: end 4, pins 1, pages [0]\nprefix 1: end 4, pins 1, pages [1]")
    plan = step(sched)  # x does not fit and nothing runs: evict prefix 1, not prefix 0
    assert (keys(plan.seqs), plan.num_tokens) == ([0], [12])
    assert x.pages == [1, 2, 3]
    assert sched.prefixes.evicted == {1}
    assert 0 in sched.prefixes and 1 not in sched.prefixes
    assert (ra.parent, rb.parent) == (0, -1)  # rb now computes prefix 1's tokens itself
    late = row(3, 5, parent=1)
    sched.add(late)
    assert late.parent == -1


def test_eviction_goes_on_until_the_head_of_the_queue_fits() -> None:
    a, b, x = prefix(0, 4), prefix(1, 4), row(0, 16)
    sched = scheduler(4, 4, a, b, x, row(1, 6, parent=0), row(2, 6, parent=1),
                      users={0: 1, 1: 1})
    step(sched)
    plan = step(sched)
    assert keys(plan.seqs) == [0] and x.pages == [0, 1, 2, 3]
    assert sched.prefixes.evicted == {0, 1} and len(sched.prefixes) == 0


def test_preemption_takes_the_latest_admitted_and_leaves_it_nothing() -> None:
    r0, r1, r2 = row(0, 2), row(1, 2), row(2, 2)
    sched = scheduler(6, 2, r0, r1, r2)
    assert step(sched).num_tokens == [2, 2, 2]  # pages 0, 1, 2
    step(sched)  # one decode page each: 3, 4, 5; the pool is full
    step(sched)  # the 4th token fits in the pages held
    plan = step(sched)  # each needs a 3rd page: r2 (latest admitted) gives its pages up
    assert keys(plan.seqs) == [0, 1]
    assert (r0.pages, r1.pages) == ([0, 3, 5], [1, 4, 2])  # r2's pages, last freed first
    assert sched.preemptions == 1 and keys(sched.running) == [0, 1]
    assert list(sched.waiting) == [r2]
    assert (r2.pages, r2.computed, r2.num_borrowed_pages, r2.total) == ([], 0, 0, 5)


def test_preempted_sequence_is_first_in_line_before_later_rows() -> None:
    r0, r1, late = row(0, 2), row(1, 2), row(2, 1)
    sched = scheduler(3, 2, r0, r1)
    step(sched)  # pages 0 | 1
    sched.add(late)
    plan = step(sched)  # r0 takes page 2 for its 3rd token; r1 needs one too: preempted
    assert keys(plan.seqs) == [0] and keys(sched.waiting) == [1, 2]  # and late not admitted
    sched.finish(r0)
    plan = step(sched)  # r1 recomputes its 3 known tokens before the later row runs
    assert (keys(plan.seqs), plan.num_tokens) == ([1, 2], [3, 1])


def test_preempted_dependent_borrows_again_while_its_prefix_is_pinned() -> None:
    p, x = prefix(0, 2), row(0, 2)
    r0, r1 = row(1, 4, parent=0), row(2, 3, parent=0)
    sched = scheduler(4, 2, p, x, r0, r1, users={0: 2}, max_num_seqs=2)
    step(sched)  # p: page 0, x: page 1
    step(sched)  # x decodes into page 2; r0 borrows page 0 and takes page 3; r1 has no seat
    assert (r0.pages, sched.prefixes.entry(0).pins) == ([0, 3], 1)
    plan = step(sched)  # r0 needs a 3rd page, none is free: preempted, pinned again
    assert keys(plan.seqs) == [0] and sched.preemptions == 1
    assert (r0.pages, r0.computed, r0.cached_tokens, r0.parent) == ([], 0, 0, 0)
    assert sched.prefixes.entry(0).pins == 2 and sched.pool.refs[0] == 1
    sched.finish(x)
    plan = step(sched)
    assert (keys(plan.seqs), plan.num_tokens) == ([1, 2], [3, 1])
    assert (r0.pages, r0.num_borrowed_pages, r0.cached_tokens) == ([0, 2, 1], 1, 2)
    assert 0 not in sched.prefixes  # r1 took the last pin


def test_preempted_dependent_computes_alone_once_its_prefix_is_gone() -> None:
    p, x, r = prefix(0, 2), row(0, 2), row(1, 4, parent=0)
    sched = scheduler(4, 2, p, x, r, users={0: 1})
    step(sched)
    step(sched)  # r borrows page 0 (the last pin: the prefix is released) and takes page 3
    assert 0 not in sched.prefixes and r.pages == [0, 3]
    step(sched)  # r is preempted
    assert (r.parent, r.pages) == (-1, [])
    sched.finish(x)
    plan = step(sched)
    assert plan.num_tokens == [5] and (r.num_borrowed_pages, r.cached_tokens) == (0, 0)


def test_token_budget_splits_a_long_prompt_into_chunks() -> None:
    a, b = row(0, 12), row(1, 4)
    sched = scheduler(8, 4, a, b, max_batched_tokens=5)
    chunks = []
    for _ in range(3):
        plan = step(sched)
        chunks.append(list(zip(keys(plan.seqs), plan.num_tokens)))
    assert chunks == [[(0, 5)], [(0, 5)], [(0, 2), (1, 3)]]
    assert (a.pages, b.pages) == ([0, 1, 2], [3])
    assert (a.total, b.computed, b.total) == (13, 3, 4)  # a sampled, b is mid-prompt


def test_max_num_seqs_caps_the_running_set() -> None:
    r0, r1, r2 = row(0, 2), row(1, 2), row(2, 2)
    sched = scheduler(8, 2, r0, r1, r2, max_num_seqs=2)
    assert keys(step(sched).seqs) == [0, 1]
    assert keys(step(sched).seqs) == [0, 1]
    sched.finish(r0)
    assert keys(step(sched).seqs) == [1, 2]


def test_one_request_that_can_never_fit_raises_kv_cache_too_small() -> None:
    sched = scheduler(2, 4, row(0, 12))
    with pytest.raises(KVCacheTooSmall, match="has 2 pages of 4 tokens; a request of 12 "
                                             "tokens needs 4"):
        sched.schedule()


def test_watermark_holds_back_admission_but_not_running_sequences() -> None:
    a, b = row(0, 197), row(1, 2)  # 200 pages of 1 token: a watermark of 2 pages
    sched = scheduler(200, 1, a, b, max_batched_tokens=256)
    assert keys(step(sched).seqs) == [0]  # b would leave 1 free page, under the watermark
    for free in (2, 1, 0):
        assert keys(step(sched).seqs) == [0]  # a decodes into the last pages
        assert sched.pool.num_free == free
    assert sched.preemptions == 0 and keys(sched.waiting) == [1]
    sched.finish(a)
    assert keys(step(sched).seqs) == [1]


def test_scheduler_check_catches_a_reference_nobody_holds() -> None:
    sched = scheduler(4, 2, row(0, 3))
    step(sched)
    sched.pool.share([1])
    with pytest.raises(AssertionError, match="page 1: pool counts 2, holders 1"):
        check_scheduler(sched)
