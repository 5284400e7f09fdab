"""Rows waiting to run, held compact: a few arrays for the whole job, not an object per row.

A job of a million rows keeps every row from tokenization until it is written; as Row objects
(each with its id, its token array and its settings) that is several hundred bytes a row, and
more of the heap that a Python process does not give back. A RowTable holds the same rows as

  tokens    [T] uint16   every row's prompt token ids, one after another (int32 when an id
                         is 65,536 or more: rows/build.py)
  starts    [N] int32    where row k's ids begin in `tokens` (int64 past 2**31 - 1 ids)
  lengths   [N] int32    how many there are; -1 when the row failed before tokenization
  index     [N] int32    the row's index over all input files (Row.index; int64 past 2**31 - 1)
  sample    [N] int32    which of its row's n samples this record is (Row.sample)
  setting   [N] int32    its settings: settings[setting[k]], one SamplingParams per distinct set
  ids                    the input id column (an Arrow array, or a list of values)
  errors                 {k: why} for the rows that cannot run
  prompts                the rendered prompt texts (output.include_prompt), or None

and makes row k's Row when it is asked for (`table[k]`): when the row enters the engine, and when
it finishes. The Row then lives until its part is written; nothing the table holds changes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from batchllm.rows.record import Row, num_samples
from batchllm.sampling_params import SamplingParams


def ints_for(top: int) -> type:
    """The integer type of an index array whose values are at most `top`: int32 where they fit
    (4 bytes a row, not 8), else int64."""
    return np.int32 if top <= np.iinfo(np.int32).max else np.int64


def row_starts(lengths: np.ndarray) -> np.ndarray:
    """[N] where each row's ids begin when the rows are packed one after another (lengths -1:
    no ids), in the narrowest type that holds them."""
    ends = np.cumsum(np.maximum(lengths, 0), dtype=np.int64)
    starts = np.zeros(len(lengths), ints_for(int(ends[-1]) if len(ends) else 0))
    starts[1:] = ends[:-1]
    return starts


@dataclass(eq=False)
class RowTable:
    tokens: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    index: np.ndarray
    sample: np.ndarray
    setting: np.ndarray
    settings: list[SamplingParams]
    ids: pa.Array | pa.ChunkedArray | list
    errors: dict[int, str] = field(default_factory=dict)
    prompts: list[str | None] | None = None

    @classmethod
    def of(cls, rows: Sequence[Row]) -> RowTable:
        """The table of a list of fresh Rows (none finished yet)."""
        ids = [r.prompt_ids for r in rows]
        lengths = np.asarray([-1 if t is None else len(t) for t in ids], np.int32)
        starts = row_starts(lengths)
        tokens = np.concatenate([np.asarray(t, np.int32) for t in ids if t is not None]
                                or [np.zeros(0, np.int32)])
        distinct: dict[int, int] = {}  # id(SamplingParams) -> its position in settings
        settings: list[SamplingParams] = []
        for r in rows:
            if id(r.sampling) not in distinct:
                distinct[id(r.sampling)] = len(settings)
                settings.append(r.sampling)
        index = [r.index for r in rows]
        return cls(tokens, starts, lengths, np.asarray(index, ints_for(max(index, default=0))),
                   np.asarray([r.sample for r in rows], np.int32),
                   np.asarray([distinct[id(r.sampling)] for r in rows], np.int32), settings,
                   [r.id for r in rows], {k: r.error for k, r in enumerate(rows) if r.error},
                   [r.prompt for r in rows] if any(r.prompt is not None for r in rows) else None)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, k: int) -> Row:
        """Row k, made afresh."""
        n = int(self.lengths[k])
        start = int(self.starts[k])
        ids = self.ids[k]
        return Row(int(self.index[k]), ids.as_py() if isinstance(ids, pa.Scalar) else ids,
                   None if n < 0 else self.tokens[start : start + n],
                   self.settings[self.setting[k]],
                   None if self.prompts is None else self.prompts[k], self.errors.get(k),
                   int(self.sample[k]))

    def __iter__(self) -> Iterator[Row]:
        return (self[k] for k in range(len(self)))

    def prompt_tokens(self) -> np.ndarray:
        """[N] int64 each row's prompt tokens (0 where it has none), as Row.prompt_tokens."""
        return np.maximum(self.lengths, 0).astype(np.int64)

    def packed_tokens(self) -> tuple[np.ndarray, np.ndarray]:
        """(every row's prompt ids one after another [T'] (the table's dtype), [N + 1] int64
        offsets)."""
        n = self.prompt_tokens()
        offsets = np.concatenate(([0], np.cumsum(n))).astype(np.int64)
        if np.array_equal(self.starts, offsets[:-1]) and len(self.tokens) == offsets[-1]:
            return self.tokens, offsets  # packed already
        at = np.repeat(self.starts.astype(np.int64) - offsets[:-1], n) + np.arange(offsets[-1])
        return self.tokens[at], offsets

    def max_tokens(self) -> np.ndarray:
        """[N] int64 each row's sampling.max_tokens (0 for a setting whose max_tokens is not a
        valid one: its rows are error rows, and 1e20 fits no int64)."""
        per_setting = np.asarray([s.max_tokens if s.max_tokens_ok else 0
                                  for s in self.settings], np.int64)
        return per_setting[self.setting]

    def taken(self, keep: np.ndarray) -> RowTable:
        """The rows at positions `keep` ([K] int64, in that order); the tokens shared."""
        keep = np.asarray(keep, np.intp)
        arrow = isinstance(self.ids, (pa.Array, pa.ChunkedArray))
        ids = self.ids.take(pa.array(keep)) if arrow else [self.ids[k] for k in keep.tolist()]
        return RowTable(self.tokens, self.starts[keep], self.lengths[keep], self.index[keep],
                        self.sample[keep], self.setting[keep], self.settings, ids,
                        {i: self.errors[k] for i, k in enumerate(keep.tolist())
                         if k in self.errors} if self.errors else {},
                        None if self.prompts is None else [self.prompts[k]
                                                           for k in keep.tolist()])

    def with_samples(self) -> RowTable:
        """Each row as its n records (Row.samples: sample 0, then 1..n-1), in row order; the
        table itself when n = 1 everywhere."""
        n = np.asarray([num_samples(s) for s in self.settings], np.int64)[self.setting]
        if np.all(n == 1):
            return self
        keep = np.repeat(np.arange(len(self)), n)
        out = self.taken(keep)
        first = np.cumsum(n) - n
        out.sample = (np.arange(len(keep)) - np.repeat(first, n)).astype(np.int32)
        return out

    def listed(self, keys) -> np.ndarray:
        """[N] bool: whether `keys` (rows done by an earlier run) name record k, as
        Row.listed_in."""
        if not keys:
            return np.zeros(len(self), bool)
        return np.fromiter((i in keys or (i, s) in keys for i, s in
                            zip(self.index.tolist(), self.sample.tolist())), bool, len(self))
