"""PagePool on tiny pools: exact page ids, reference counts, peaks, "does not fit", check()."""

from __future__ import annotations

import pytest

from batchllm.engine.pages import PagePool


def test_fresh_pool_hands_out_lowest_ids_first() -> None:
    pool = PagePool(6)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    assert (pool.num_used, pool.num_free) == (5, 1)
    assert pool.refs == [1, 1, 1, 1, 1, 0]


def test_freed_pages_come_back_last_freed_first() -> None:
    pool = PagePool(6)
    assert pool.allocate(4) == [0, 1, 2, 3]
    pool.release([1, 2])
    assert pool.allocate(3) == [2, 1, 4]
    pool.release([3])
    pool.release([0])
    assert pool.allocate(2) == [0, 3]
    pool.check()


def test_does_not_fit_is_none_and_takes_nothing() -> None:
    pool = PagePool(3)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(2) is None
    assert pool.num_free == 1
    assert pool.allocate(0) == []
    assert pool.allocate(1) == [2]
    assert pool.allocate(1) is None
    pool.check()


def test_share_and_release_count_references() -> None:
    pool = PagePool(4)
    assert pool.allocate(2) == [0, 1]
    pool.share([0, 1])
    pool.share([0])
    assert pool.refs == [3, 2, 0, 0]
    assert (pool.num_shared, pool.peak_shared) == (2, 2)
    pool.release([0, 1])
    assert pool.refs == [2, 1, 0, 0]
    assert (pool.num_shared, pool.num_free) == (1, 2)  # one reference still holds each page
    pool.release([0, 1])
    assert pool.refs == [1, 0, 0, 0]
    assert (pool.num_shared, pool.num_free) == (0, 3)
    pool.release([0])
    assert (pool.num_used, pool.num_shared, pool.peak_shared) == (0, 0, 2)
    pool.check()


def test_several_holders_released_at_once_free_in_the_order_one_by_one_would() -> None:
    """Rows under one prefix each hold its shared pages and their own: their pages released in
    one call (the scheduler's finish_many) leave the same counts, shared count and free stack
    as the holders released one after another; here pages 0-1 are shared by three holders:
    the last one's release frees them, then its own pages 4-5 (the stack's top)."""
    holders = [[0, 1, 2], [0, 1, 3], [0, 1, 4, 5]]
    pools = [PagePool(8), PagePool(8)]
    for pool in pools:
        assert pool.allocate(6) == [0, 1, 2, 3, 4, 5]
        pool.share([0, 1])
        pool.share([0, 1])
    for pages in holders:
        pools[0].release(pages)
    pools[1].release([p for pages in holders for p in pages])
    one_by_one, at_once = pools
    assert at_once.refs == one_by_one.refs == [0] * 8
    assert at_once.num_shared == one_by_one.num_shared == 0
    assert at_once.allocate(8) == one_by_one.allocate(8) == [5, 4, 1, 0, 3, 2, 6, 7]
    for pool in pools:
        pool.release(list(range(8)))
        pool.check()


def test_peak_used_is_the_high_water_mark() -> None:
    pool = PagePool(5)
    pool.allocate(3)
    pool.release([0, 2])
    assert pool.allocate(1) == [2]
    assert (pool.num_used, pool.peak_used) == (2, 3)
    pool.allocate(3)
    assert pool.peak_used == 5


def test_sharing_a_free_page_fails() -> None:
    pool = PagePool(2)
    pool.allocate(1)
    with pytest.raises(AssertionError, match="page 1 is free"):
        pool.share([0, 1])


def test_releasing_a_page_twice_fails() -> None:
    pool = PagePool(2)
    pool.allocate(2)
    pool.release([1])
    with pytest.raises(AssertionError, match="page 1 released more often"):
        pool.release([1])


def test_check_catches_a_double_free() -> None:
    pool = PagePool(3)
    pool.allocate(2)
    pool.release([1])
    pool.check()
    pool._push_free([1])  # what a second free that skipped the count would leave
    with pytest.raises(AssertionError, match="twice in the free list"):
        pool.check()


def test_check_catches_a_used_page_on_the_free_list() -> None:
    pool = PagePool(3)
    pool.allocate(2)
    pool._push_free([0])  # page 0 still has a reference
    with pytest.raises(AssertionError, match="page 0: refs 1, free True"):
        pool.check()


def test_check_catches_a_wrong_shared_count() -> None:
    pool = PagePool(2)
    pool.allocate(1)
    pool.share([0])
    pool.num_shared = 0
    with pytest.raises(AssertionError, match="shared page count"):
        pool.check()


def test_a_pool_of_10_8_pages_costs_memory_only_for_the_pages_in_use() -> None:
    psutil = pytest.importorskip("psutil")
    process = psutil.Process()
    before = process.memory_info().rss
    pool = PagePool(10**8)  # page size 1 on an H200: a Python list of ids would take GBs
    first = pool.allocate(1000)
    pool.release(first[:10])
    assert pool.allocate(3) == [9, 8, 7]  # the same ids and order as a small pool's
    assert pool.allocate(8) == [6, 5, 4, 3, 2, 1, 0, 1000]
    grown = process.memory_info().rss - before
    assert grown < 64 << 20, f"a 10^8-page pool with 1,001 pages in use took {grown >> 20} MiB"
    pool.check()
    assert (pool.num_used, pool.num_free) == (1001, 10**8 - 1001)
