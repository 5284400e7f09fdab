"""What one `Scheduler.schedule()` decides: the sequences that run how many tokens, the page
copies to make first, the rows that sample from a computed prefix without running. Sequences are
held as their slots (row_slots.py) and counts, arrays; their Requests are listed on demand."""

from __future__ import annotations

import numpy as np

from batchllm.engine.request import Request
from batchllm.engine.row_slots import RowSlots


class StepPlan:
    def __init__(self, slots: np.ndarray, counts: np.ndarray, state: RowSlots,
                 copies: list[tuple[int, int]], from_prefix: list[Request]) -> None:
        self.slots = slots  # [B] int64: the sequences that run tokens, in admission order
        self.counts = counts  # [B] int64: tokens each runs
        self.state = state
        self.copies = copies  # (source page, destination page), to copy before the step
        self.from_prefix = from_prefix  # rows admitted whose whole prompt is a computed prefix
        self._seqs: list[Request] | None = None

    @property
    def seqs(self) -> list[Request]:
        """The Requests, listed once (`keep_seqs`)."""
        if self._seqs is None:
            owner = self.state.owner
            self._seqs = [owner[s] for s in self.slots.tolist()]
        return self._seqs

    def keep_seqs(self) -> None:
        """List the Requests now, while every sequence of the step holds its slot."""
        self._seqs = self.seqs

    @property
    def num_tokens(self) -> list[int]:
        return self.counts.tolist()


class PlanBuilder:
    """The step plan as it is filled, with the token budget left."""

    def __init__(self, budget: int, state: RowSlots | None) -> None:
        self.budget = budget
        self.state = state
        self.slots = np.zeros(0, dtype=np.int64)  # the running ones, taken at once
        self.counts = np.zeros(0, dtype=np.int64)
        self.taken: list[Request] = []  # then those taken one by one
        self.numbers: list[int] = []
        self.copies: list[tuple[int, int]] = []
        self.from_prefix: list[Request] = []

    def take_many(self, slots: np.ndarray, counts: np.ndarray) -> None:
        """The first sequences of the plan, their slots and counts [B] as arrays."""
        self.slots, self.counts = slots, counts
        self.budget -= int(counts.sum())

    def take(self, seq: Request, n: int) -> None:
        self.taken.append(seq)
        self.numbers.append(n)
        self.budget -= n

    def build(self) -> StepPlan:
        slots, counts = self.slots, self.counts
        if self.taken:
            slots = np.concatenate([slots, [s.slot for s in self.taken]]).astype(np.int64)
            counts = np.concatenate([counts, self.numbers]).astype(np.int64)
        state = self.state if self.state is not None else RowSlots(1)
        return StepPlan(slots, counts, state, self.copies, self.from_prefix)
