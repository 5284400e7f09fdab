"""PrefixStore on its own: exact pages borrowed, reference counts after attach, unpin, repin
and evict, eviction order (most recently computed first), check() and pretty()."""

from __future__ import annotations

import pytest

from batchllm.engine.pages import PagePool
from batchllm.engine.prefix_store import Borrowed, PrefixStore


def test_store_attach_unpin_repin_and_evict() -> None:
    pool = PagePool(8)
    store = PrefixStore(pool, page_size=4)
    store.add(3, pool.allocate(2), end=6, pins=2)  # pages 0, 1
    store.add(5, pool.allocate(1), end=4, pins=1)  # page 2
    assert store.attach(3) == Borrowed([0, 3], 1, 6, (1, 3))
    assert store.attach(5) == Borrowed([2], 1, 4, None)
    assert pool.refs[:4] == [2, 1, 2, 1]
    store.unpin(5)
    assert 5 not in store and pool.refs[2] == 1
    assert store.repin(3) and store.entry(3).pins == 3
    assert not store.repin(5)
    store.add(4, pool.allocate(1), end=1, pins=1)  # page 4
    assert (store.evict(), store.evict(), store.evict()) == (4, 3, None)
    assert store.evicted == {3, 4} and pool.refs[:5] == [1, 0, 1, 1, 0]
    store.check()


def test_store_attach_without_a_page_for_the_copy_holds_nothing() -> None:
    pool = PagePool(2)
    store = PrefixStore(pool, page_size=4)
    store.add(0, pool.allocate(2), end=6, pins=1)
    assert store.attach(0) is None
    assert pool.refs == [1, 1] and pool.num_shared == 0 and pool.peak_shared == 1
    store.check()


def test_store_check_catches_a_page_freed_under_a_prefix() -> None:
    pool = PagePool(4)
    store = PrefixStore(pool, page_size=4)
    store.add(0, pool.allocate(2), end=5, pins=1)
    store.check()
    pool.release([1])
    with pytest.raises(AssertionError, match="page 1: 0 refs, prefixes hold 1"):
        store.check()


def test_store_add_without_pins_releases_at_once() -> None:
    pool = PagePool(3)
    store = PrefixStore(pool, page_size=2)
    store.add(7, pool.allocate(2), end=3, pins=0)
    assert 7 not in store and len(store) == 0 and pool.num_used == 0


def test_store_pretty_lists_prefixes_oldest_first_then_the_evicted() -> None:
    pool = PagePool(6)
    store = PrefixStore(pool, page_size=2)
    assert store.pretty() == "(no prefixes)"
    store.add(2, pool.allocate(2), end=3, pins=1)
    store.add(0, pool.allocate(1), end=2, pins=4)
    store.add(9, pool.allocate(1), end=1, pins=1)
    store.evict()
    assert store.pretty() == (
        "prefix 2: end 3, pins 1, pages [0, 1]\n"
        "prefix 0: end 2, pins 4, pages [2]\n"
        "evicted: [9]"
    )


def test_store_check_catches_a_prefix_kept_without_pins() -> None:
    pool = PagePool(2)
    store = PrefixStore(pool, page_size=2)
    store.add(0, pool.allocate(1), end=2, pins=1)
    store.entry(0).pins = 0
    with pytest.raises(AssertionError, match="prefix 0 stored with 0 pins"):
        store.check()
