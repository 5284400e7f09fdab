"""The one planning entry of a job: rows in, the rows that can run and their plan out.

Used by the run (engine/runtime.py), `batchllm plan` and both sharding modes, so that every
prediction is made over exactly the rows that will run.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from batchllm.plan.planner import Plan, make_plan
from batchllm.rows.admission import admit, admit_table
from batchllm.rows.record import Row
from batchllm.rows.table import RowTable


@dataclass(eq=False)
class RowsPlan:
    """rows[k] is the plan's row k: the admitted rows, in their given order; failed: the rows
    that cannot run, failed with their reason, in order."""

    plan: Plan
    rows: RowTable
    failed: list[Row]

    def restricted_to(self, skip: Collection[int | tuple[int, int]]) -> RowsPlan:
        """The same plan without the rows listed in `skip` (done by an earlier run: a row index,
        or (index, sample) for one sample of it)."""
        if not skip:
            return self
        return RowsPlan(self.plan.restricted_to(~self.rows.listed(skip)), self.rows, self.failed)


def plan_rows(rows: Sequence[Row] | RowTable, max_model_len: int, prefix_sharing: bool,
              order: str) -> RowsPlan:
    """Admit the rows (the others are failed with their reason: Rows of a list in place) and
    plan the admitted ones."""
    if isinstance(rows, RowTable):
        good, failed = admit_table(rows, max_model_len)
    else:
        admitted = admit(rows, max_model_len)
        good, failed = RowTable.of(admitted), [r for r in rows if not r.ok]
    tokens, offsets = good.packed_tokens()
    plan = make_plan(tokens, good.max_tokens().astype(np.int32), prefix_sharing=prefix_sharing,
                     order=order, offsets=offsets)
    return RowsPlan(plan, good, failed)
