"""n samples per row and log-probabilities in checkpoint parts and the final file.

A part line is one sample of one input row: its "row" index, its "sample" (0..n-1) and the
row's n ("samples"), so that resume knows which samples of a row are done and finalize can check
that every row has all of its samples. The final file has one line per (row, sample), in input
order then sample order; its `sample` column only when some row has n > 1 and its `logprobs`
column only when some row asked for them (DESIGN.md "Output Parquet").
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from batchllm.rows.record import Row, TokenLogprob

_TOP = pa.struct([pa.field("token_id", pa.int32()), pa.field("logprob", pa.float32())])
LOGPROBS_TYPE = pa.list_(pa.struct([
    pa.field("token_id", pa.int32()), pa.field("logprob", pa.float32()),
    pa.field("top", pa.list_(_TOP)),
]))
SAMPLE_FIELDS = [
    pa.field("sample", pa.int32()),
    pa.field("samples", pa.int32()),  # the row's n: in parts only
    pa.field("logprobs", LOGPROBS_TYPE),
]


def logprob_values(logprobs: list[TokenLogprob] | None) -> list[dict] | None:
    """TokenLogprob records as the values of LOGPROBS_TYPE."""
    if logprobs is None:
        return None
    return [{"token_id": t.token_id, "logprob": t.logprob,
             "top": [{"token_id": i, "logprob": v} for i, v in t.top]} for t in logprobs]


def sample_values(row: Row) -> dict:
    """A record's values of SAMPLE_FIELDS. A row that asked for logprobs has a list (empty
    when it failed); one that did not, null."""
    return {"sample": row.sample, "samples": row.num_samples,
            "logprobs": logprob_values(row.logprobs)}


def done_keys(rows: np.ndarray, samples: np.ndarray, n: np.ndarray) -> set:
    """What resume skips, from the part lines' row, sample and samples columns: the index of
    each row with all its samples in parts, and (index, sample) for each done sample of a row
    with some still missing (Row.listed_in reads both)."""
    if not len(rows) or n.max() == 1:  # n = 1 everywhere: the row indices, as before samples
        return set(rows.tolist())
    done: set = set()
    have: dict[int, set[int]] = {}
    for r, s in zip(rows.tolist(), samples.tolist()):
        have.setdefault(r, set()).add(s)
    need = dict(zip(rows.tolist(), n.tolist()))
    for r, got in have.items():
        if len(got) >= need[r]:
            done.add(r)
        else:
            done.update((r, s) for s in got)
    return done


def whole_rows(done: set) -> int:
    """How many rows `done` (done_keys) holds with all their samples."""
    return sum(1 for k in done if isinstance(k, int))


def check_complete(table: pa.Table, num_rows: int) -> None:
    """RuntimeError unless the unique lines cover rows 0..num_rows-1, each with its n samples."""
    rows = table.column("row").to_numpy()
    starts = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]][: len(rows)])
    present = rows[starts]
    if not np.array_equal(present, np.arange(num_rows)):
        missing = np.setdiff1d(np.arange(num_rows), present)
        raise RuntimeError(f"finalize: {len(missing)} of {num_rows} rows are missing "
                           f"(e.g. {missing[:5].tolist()}), or rows beyond {num_rows - 1}")
    have = np.diff(np.r_[starts, len(rows)])
    want = table.column("samples").to_numpy()[starts]
    short = present[have != want]
    if len(short):
        raise RuntimeError(f"finalize: {len(short)} rows miss some of their samples "
                           f"(e.g. rows {short[:5].tolist()})")


def extra_fields(table: pa.Table) -> list[pa.Field]:
    """The final file's sample and logprobs fields that these lines call for."""
    fields = []
    if table.num_rows and (pc.max(table.column("samples")).as_py() or 1) > 1:
        fields.append(SAMPLE_FIELDS[0])
    if table.column("logprobs").null_count < table.num_rows:
        fields.append(SAMPLE_FIELDS[2])
    return fields
