"""The one planning entry of a job: rows in, the rows that can run and their plan out.

Used by the run (engine/runtime.py), `batchllm plan` and both sharding modes, so that every
prediction is made over exactly the rows that will run.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from batchllm.plan.planner import Plan, make_plan
from batchllm.rows.admission import admit
from batchllm.rows.record import Row


@dataclass(eq=False)
class RowsPlan:
    """rows[k] is the plan's row k: the admitted rows, in their given order."""

    plan: Plan
    rows: list[Row]

    def restricted_to(self, skip: Collection[int | tuple[int, int]]) -> RowsPlan:
        """The same plan without the rows listed in `skip` (done by an earlier run: a row index,
        or (index, sample) for one sample of it)."""
        if not skip:
            return self
        keep = np.asarray([not r.listed_in(skip) for r in self.rows], dtype=bool)
        return RowsPlan(self.plan.restricted_to(keep), self.rows)


def plan_rows(rows: Sequence[Row], max_model_len: int, prefix_sharing: bool,
              order: str) -> RowsPlan:
    """Admit the rows (the others are failed with their reason) and plan the admitted ones."""
    good = admit(rows, max_model_len)
    plan = make_plan(
        [r.prompt_ids for r in good],
        np.asarray([r.sampling.max_tokens for r in good], dtype=np.int32),
        prefix_sharing=prefix_sharing,
        order=order,
    )
    return RowsPlan(plan, good)
