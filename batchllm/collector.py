"""Python's cyclic garbage collector during a job's start-up.

Importing torch and loading the model make ~180,000 long-lived objects (SmolLM2-135M). With the
collector on, making them ran ~530 collections, 4 of them full ones over every object (a full
one: ~0.07 s): 0.3 s of the short bench job's start-up (gc.callbacks), and the whole process
took 0.3-0.45 s less with them gone. `start_up()` turns the collector off for that stretch,
then freezes what it made (gc.freeze: left out of every later collection, as objects that live
as long as the process) and turns it back on: the run collects its own cycles as before.

Only for processes batchllm owns (`batchllm run`): a frozen object is never collected, which a
caller of the Python API did not ask for.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def start_up() -> Iterator[None]:
    """The collector off inside; on leaving, what exists is frozen and the collector is on again
    (if it was on)."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_on:
            gc.enable()
