"""batchllm/collector.py: the garbage collector off through a job's start-up, what it made then
frozen, the collector back as it was."""

from __future__ import annotations

import gc

from batchllm import collector


def test_start_up_turns_the_collector_off_then_freezes_what_it_made() -> None:
    gc.enable()
    frozen = gc.get_freeze_count()
    try:
        with collector.start_up():
            assert not gc.isenabled()
            made = [[] for _ in range(1000)]  # objects the collector tracks
        assert gc.isenabled()
        assert gc.get_freeze_count() >= frozen + len(made)
        collected = {id(o) for o in gc.get_objects()}  # the frozen are not among them
        assert not any(id(x) in collected for x in made)
    finally:
        gc.unfreeze()


def test_a_collector_that_was_off_stays_off() -> None:
    gc.disable()
    try:
        with collector.start_up():
            pass
        assert not gc.isenabled()
    finally:
        gc.unfreeze()
        gc.enable()
