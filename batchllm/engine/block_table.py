"""The page tables of the running sequences, kept on the device: one row per sequence, written
only where its pages changed since the step it last ran in.

Sequences are known by their slot (row_slots.py), whose `table` row holds their page ids on the
host. A running sequence only ever appends pages; its pages are replaced at a reset
(preemption, then a borrowed prefix again) or when the slot passes to a new sequence, and the
slot's `renewed` flag says so: its row is then written whole. Else the entries from the last
written count on are new. Rows of slots that stopped running are taken back least recently used
first (a slot seen again after that just gets its row written whole). Arrays over the step's
slots; Python only for rows taken or taken back.
"""

from __future__ import annotations

import numpy as np
import torch

from batchllm.engine.row_slots import RowSlots


class BlockTable:
    def __init__(self, num_rows: int, max_pages: int, device: torch.device) -> None:
        self.table = torch.zeros(num_rows, max_pages, dtype=torch.int32, device=device)
        self.max_pages = max_pages
        self._row = np.full(0, -1, dtype=np.int64)  # slot -> its row, -1: none
        self._written = np.zeros(0, dtype=np.int64)  # slot -> leading pages in its row
        self._used = np.zeros(num_rows, dtype=np.int64)  # row -> the step it last ran in
        self._slot_of = np.full(num_rows, -1, dtype=np.int64)  # row -> its slot, -1: free
        self._step = 0

    def update(self, slots: np.ndarray, state: RowSlots
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The row of each of a step's sequences (slots [B]), and the entries to write before
        the step runs: (rows [B], flat indices into the table [n] int64, page ids [n] int32)."""
        self._step += 1
        if len(self._row) < state.capacity:  # the slots grew
            grow = state.capacity - len(self._row)
            self._row = np.concatenate([self._row, np.full(grow, -1, dtype=np.int64)])
            self._written = np.concatenate([self._written, np.zeros(grow, dtype=np.int64)])
        renewed = slots[state.renewed[slots]]
        self._written[renewed] = 0  # new pages throughout
        state.renewed[renewed] = False
        missing = slots[self._row[slots] < 0]
        if len(missing):
            self._take_rows(missing)
        rows = self._row[slots]  # [B]
        self._used[rows] = self._step
        pages = state.num_pages[slots]  # [B]
        if int(pages.max(initial=0)) > self.max_pages:
            raise ValueError(f"a sequence holds {int(pages.max())} pages, the table "
                             f"{self.max_pages} per row")
        new = pages - self._written[slots]  # [B]
        self._written[slots] = pages
        if not new.any():
            return rows, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32)
        at = np.repeat(np.cumsum(new) - new, new)  # [n]
        cols = np.arange(int(new.sum())) - at + np.repeat(pages - new, new)  # [n]
        index = np.repeat(rows, new) * self.max_pages + cols
        return rows, index, state.table[np.repeat(slots, new), cols]

    def write(self, index: torch.Tensor, pages: torch.Tensor) -> None:
        """index [n] int64 (flat), pages [n] int32, on the device: the entries update() gave."""
        if index.numel():
            self.table.view(-1).index_put_((index,), pages)

    def _take_rows(self, slots: np.ndarray) -> None:
        """Rows for slots that have none: free ones first, then idle ones, least recently used
        first (their slots lose them)."""
        free = (self._slot_of < 0).nonzero()[0]
        if len(free) < len(slots):
            idle = ((self._slot_of >= 0) & (self._used < self._step)).nonzero()[0]
            if len(idle) < len(slots) - len(free):
                raise RuntimeError("BlockTable: more sequences in one step than rows")
            back = idle[np.argsort(self._used[idle], kind="stable")]
            back = back[: max(len(slots) - len(free), len(idle) // 2)]
            self._row[self._slot_of[back]] = -1
            self._slot_of[back] = -1
            free = (self._slot_of < 0).nonzero()[0]
        rows = free[: len(slots)]
        self._row[slots] = rows
        self._slot_of[rows] = slots
        self._written[slots] = 0
