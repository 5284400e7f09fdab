"""The scheduler's bookkeeping checked whole (test_scheduler calls it after every step): the pool's
reference counts are exactly what the stored prefixes and the running sequences hold, each
running sequence's slot table row is its pages (0 past them), waiting sequences hold nothing."""

from __future__ import annotations

from collections import Counter

from batchllm.engine.scheduler import Scheduler


def check_scheduler(sched: Scheduler) -> None:
    """Assert the invariants above, and the pool's and the prefix store's own."""
    sched.pool.check()
    sched.prefixes.check()
    table, num_pages = sched.state.table, sched.state.num_pages
    refs = Counter(sched.prefixes.held())
    for seq in sched.running:
        refs.update(seq.pages)
        row = table[seq.slot, : num_pages[seq.slot]].tolist()
        assert row == seq.pages, f"{seq.kind} {seq.key}: slot table {row}, pages {seq.pages}"
        assert not table[seq.slot, len(row) :].any(), (
            f"{seq.kind} {seq.key}: page ids past its {len(row)} pages")
    for p, r in enumerate(sched.pool.refs):
        assert refs[p] == r, f"page {p}: pool counts {r}, holders {refs[p]}"
    for seq in sched.waiting:
        assert not seq.pages and seq.computed == 0, f"waiting {seq.kind} {seq.key} holds KV"
    assert sched.num_running <= sched.max_num_seqs, "more running than max_num_seqs"
