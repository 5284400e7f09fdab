"""The page tables of the running sequences, kept on the device: one row per sequence, written
only where its pages changed since the step it last ran in.

A running sequence only ever appends pages; it loses them all at a reset (preemption), and then
restarts at a computed count no larger than any it ran with before (0, or the end of the prefix
it borrows again), since every step it runs in advances it. So: pages beyond those written are
new; a computed count at or below the last one seen means a reset, and the row is written anew.
Rows of sequences that stopped running are taken back least recently used first (a sequence
seen again after that just gets its row written whole). Ints only on the host side.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchllm.engine.request import Request


@dataclass
class _Row:
    seq: Request  # held, so that id(seq) is not reused while the row is
    row: int
    written: int  # leading pages of seq.pages already in the row
    computed: int  # seq.computed when it last ran
    used: int  # the step it last ran in


class BlockTable:
    def __init__(self, num_rows: int, max_pages: int, device: torch.device) -> None:
        self.table = torch.zeros(num_rows, max_pages, dtype=torch.int32, device=device)
        self.max_pages = max_pages
        self._rows: dict[int, _Row] = {}  # id(seq) -> its row
        self._free = list(range(num_rows - 1, -1, -1))
        self._step = 0

    def update(self, seqs: list[Request]) -> tuple[list[int], list[int], list[int]]:
        """The row of each of a step's sequences, and the entries to write before the step runs:
        (rows, flat indices into the table, page ids)."""
        self._step += 1
        rows, index, pages = [], [], []
        width = self.max_pages
        for seq in seqs:
            rec = self._rows.get(id(seq))
            if rec is None:
                rec = self._rows[id(seq)] = _Row(seq, self._take_row(), 0, -1, 0)
            elif seq.computed <= rec.computed or len(seq.pages) < rec.written:
                rec.written = 0  # reset since its last step: new pages throughout
            if len(seq.pages) > width:
                raise ValueError(f"a sequence holds {len(seq.pages)} pages, the table "
                                 f"{width} per row")
            base = rec.row * width
            for col in range(rec.written, len(seq.pages)):
                index.append(base + col)
                pages.append(seq.pages[col])
            rec.written, rec.computed, rec.used = len(seq.pages), seq.computed, self._step
            rows.append(rec.row)
        return rows, index, pages

    def write(self, index: torch.Tensor, pages: torch.Tensor) -> None:
        """index [n] int64 (flat), pages [n] int32, on the device: the entries update() gave."""
        if index.numel():
            self.table.view(-1).index_put_((index,), pages)

    def _take_row(self) -> int:
        if not self._free:
            idle = [r for r in self._rows.values() if r.used < self._step]
            if not idle:
                raise RuntimeError("BlockTable: more sequences in one step than rows")
            for rec in sorted(idle, key=lambda r: r.used)[: max(1, len(idle) // 2)]:
                del self._rows[id(rec.seq)]
                self._free.append(rec.row)
        return self._free.pop()
