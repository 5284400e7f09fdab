"""Log-probabilities kept as arrays from the step that samples them to the row that is written.

Each step's records (its scored rows' chosen token, that token's log-probability and the top
alternatives: step_logprobs.py) are appended to one log of arrays when the step's ids are read,
and each row keeps, per generated token, its record's index in the log (RowSlots.lp_at): no
Python object per token per step. A finished row takes its records out as a TokenLogprobs
(rows/record.py), arrays again. When the log is full it keeps only the records of rows still
held (compaction, in the order they were written), and doubles when those fill half of it.
"""

from __future__ import annotations

import numpy as np

from batchllm.engine.row_slots import RowSlots
from batchllm.engine.step_logprobs import StepLogprobs
from batchllm.rows.record import TokenLogprobs


class LogprobLog:
    def __init__(self, slots: RowSlots, capacity: int = 4096) -> None:
        self.slots = slots
        self.size = 0  # records in the log
        self.token_id = np.zeros(capacity, dtype=np.int64)  # [N]
        self.logprob = np.zeros(capacity, dtype=np.float32)  # [N]
        self.top_id = np.zeros((capacity, 1), dtype=np.int64)  # [N, K] best first
        self.top_lp = np.zeros((capacity, 1), dtype=np.float32)  # [N, K]

    def add(self, step: StepLogprobs, rows: np.ndarray, slots: np.ndarray,
            at: np.ndarray) -> None:
        """A step's records (on the host: StepLogprobs.to_host), for the rows (indices [L] into
        the step's records) of slots [L], their token's index at [L] among their generated."""
        tokens, chosen, top_lp, top_id = step.arrays()
        n, k = len(chosen), top_lp.shape[1]
        if self.size + n > len(self.logprob):
            self._compact(n)
        if k > self.top_id.shape[1]:
            self.top_id, self.top_lp = (np.pad(a, ((0, 0), (0, k - a.shape[1])))
                                        for a in (self.top_id, self.top_lp))
        lo, hi = self.size, self.size + n
        self.token_id[lo:hi], self.logprob[lo:hi] = tokens, chosen
        self.top_id[lo:hi, :k], self.top_lp[lo:hi, :k] = top_id, top_lp
        self.size = hi
        self.slots.lp_at[slots, at] = lo + rows

    def take(self, slots: np.ndarray, counts: np.ndarray, ks: np.ndarray) -> list[TokenLogprobs]:
        """The records of the rows at slots [F] (those finishing in a step): row i's first
        counts[i] tokens, top ks[i] each; gathered in one go, each row's arrays views of them."""
        ends = np.cumsum(counts)  # [F]
        starts = ends - counts
        rows = np.repeat(slots, counts)  # [T]
        refs = self.slots.lp_at[rows, np.arange(len(rows)) - np.repeat(starts, counts)]
        kmax = int(ks.max()) if len(ks) else 0
        token_id, logprob = self.token_id[refs], self.logprob[refs]  # [T]
        # [T, kmax]; np.take gathers rows in 0.34 ms where a[refs, :kmax] takes 0.92 (65k x 5)
        top_id, top_lp = (np.take(a, refs, axis=0)[:, :kmax] for a in (self.top_id, self.top_lp))
        return [TokenLogprobs(token_id[lo:hi], logprob[lo:hi], top_id[lo:hi, :k],
                              top_lp[lo:hi, :k])
                for lo, hi, k in zip(starts.tolist(), ends.tolist(), ks.tolist())]

    def _compact(self, incoming: int) -> None:
        """Keep the records that held rows still point to, then room for `incoming` more."""
        st = self.slots
        held = ((st.logprobs > 0) & st.held).nonzero()[0]  # [H]
        cols = np.arange(st.lp_at.shape[1])
        mask = cols[None, :] < st.generated[held][:, None]  # [H, W]
        # [R] in row order; the entry of a token whose record is being added is not set yet
        refs = np.minimum(st.lp_at[held][mask], max(self.size - 1, 0))
        capacity = len(self.logprob)
        while 2 * (len(refs) + incoming) > capacity:
            capacity *= 2
        fresh = np.arange(len(refs))
        self.token_id = _moved(self.token_id, refs, capacity)
        self.logprob = _moved(self.logprob, refs, capacity)
        self.top_id = _moved(self.top_id, refs, capacity)
        self.top_lp = _moved(self.top_lp, refs, capacity)
        rows = st.lp_at[held]
        rows[mask] = fresh
        st.lp_at[held] = rows
        self.size = len(refs)


def _moved(a: np.ndarray, refs: np.ndarray, capacity: int) -> np.ndarray:
    out = np.zeros((capacity, *a.shape[1:]), dtype=a.dtype)
    np.take(a, refs, axis=0, out=out[: len(refs)])
    return out
