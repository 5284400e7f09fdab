"""CSV records that do not have the header's number of fields: found with Python's csv module,
and the file read around them.

polars refuses a whole file for one record with more fields than the header, and pads one with
fewer (a blank line too) with nulls, so that a record cut short would run with the job's
defaults in its missing cells. Python's csv module reads the records as written (a quoted cell
may span lines: a record's index is not a line number, and its lines are named from the
reader's line count): `scan` finds each record whose field count differs from the header's,
with why in words naming its line, and `read_around` has polars read the file without them
(the same types as polars gives any file) and puts them back as rows of nulls, each its row's
error (rows/tables.py), or refuses the file where the rows have ids (that row's id is unknown).
Lines end at "\\n" alone, as polars reads them (a "\\r" inside a cell is part of it).
"""

from __future__ import annotations

import csv
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa


@dataclass(frozen=True)
class Records:
    """What scan found: the number of records after the header; those (by their index, the
    row) whose field count differs from the header's, with why; the file's text without them
    (None when there are none)."""

    rows: int
    ragged: dict[int, str]
    kept: str | None

    def put_back(self, kept: pa.Table) -> pa.Table:
        """The table of the kept records (polars' reading of `kept`) with each ragged record
        back in its place as a row of nulls."""
        index = np.full(self.rows, -1, np.int64)
        good = np.ones(self.rows, bool)
        good[list(self.ragged)] = False
        index[good] = np.arange(kept.num_rows)
        return kept.take(pa.array(index, mask=~good))


def _fields(n: int) -> str:
    return f"{n} field" if n == 1 else f"{n} fields"


def _why(fields: int, header: int, first: int, last: int) -> str:
    if fields == 0:
        return f"CSV line {first} is empty, the header has {_fields(header)}"
    where = f"line {first}" if first == last else f"lines {first}-{last}"
    return f"CSV record on {where} has {_fields(fields)}, the header has {header}"


def _as_read(lines: list[str]) -> Iterator[str]:
    """The lines as csv.reader reads them: a "\\r" ending a line dropped and any other made a
    space (the reader would end a record at it, where polars keeps it in the cell)."""
    for line in lines:
        if "\r" in line:
            line = line.removesuffix("\r").replace("\r", " ")
        yield line + "\n"


def _reader(lines: list[str], longest: int):
    """A strict csv.reader of the lines (polars refuses what it refuses), whose cells may be as
    long as `longest` (the module's limit, 131,072 characters, is raised for the process)."""
    csv.field_size_limit(max(csv.field_size_limit(), longest + 1))
    return csv.reader(_as_read(lines), strict=True)


def may_be_short(frame, data: Callable[[], bytes | str]) -> bool:
    """Whether a record of a file that polars read (`frame`; `data()` the file's bytes or
    text) may have had fewer fields than the header, padded with nulls: False where the last
    column has no null, or where each record of a row with a null there has the header's
    fields, its lines found from the newlines its cells hold (a row's first line is the
    header's lines, plus one per earlier row, plus the earlier rows' cells' newlines). True
    calls for `scan` (also where those lines do not add up to the file's)."""
    import polars as pl

    if not frame.width or not frame[:, -1].null_count():
        return False
    text = [c for c, t in frame.schema.items() if t == pl.String]
    extra = np.zeros(frame.height, np.int64)  # [H] each row's lines past its first
    if text:
        extra += frame.select(pl.sum_horizontal(pl.col(text).str.count_matches(
            "\n", literal=True).fill_null(0))).to_series().to_numpy()
    first = (1 + sum(c.count("\n") for c in frame.columns) + np.arange(frame.height)
             + np.concatenate(([0], np.cumsum(extra)[:-1])))  # [H] each row's first line
    raw = data()
    raw = raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogateescape")
    ends = np.flatnonzero(np.frombuffer(raw, np.uint8) == ord("\n"))
    if raw and not raw.endswith(b"\n"):
        ends = np.append(ends, len(raw))
    if len(ends) != first[-1] + extra[-1] + 1:
        return True
    starts = np.concatenate(([0], ends[:-1] + 1))
    rows = frame[:, -1].is_null().arg_true().to_numpy()
    lines, quoted = [], 0  # the records with a quote, read by the csv module
    for a, b in zip(starts[first[rows]].tolist(), ends[(first + extra)[rows]].tolist(),
                    strict=True):
        if raw.find(b'"', a, b) >= 0:
            lines += raw[a:b].decode("utf-8", "replace").split("\n")
            quoted += 1
        elif a == b or raw.count(b",", a, b) + 1 != frame.width:  # a blank line has no field
            return True
    try:
        fields = [len(f) for f in _reader(lines, len(raw))]
    except csv.Error:
        return True
    return fields != [frame.width] * quoted


def scan(text: str) -> Records:
    """The records of a CSV file's text (its first record the header) that do not have the
    header's number of fields. ValueError naming the line where a record cannot be read: a
    quote never closed, a character after a closing quote (polars refuses both)."""
    lines = text.removeprefix("\ufeff").split("\n")  # a byte-order mark, as polars drops it
    if lines[-1] == "":
        lines.pop()
    reader = _reader(lines, len(text))
    ragged: dict[int, str] = {}
    spans: list[tuple[int, int]] = []  # the ragged records' lines: [start, end)
    start = rows = 0
    try:
        header = len(next(reader, []))
        start = reader.line_num
        for row, fields in enumerate(reader):
            if len(fields) != header:
                ragged[row] = _why(len(fields), header, start + 1, reader.line_num)
                spans.append((start, reader.line_num))
            start, rows = reader.line_num, row + 1
    except csv.Error as e:
        if "unexpected end of data" in str(e):
            raise ValueError(f"the CSV record on line {start + 1} opens a quote that is never "
                             f"closed (the file ends inside it)") from None
        raise ValueError(f"CSV line {reader.line_num}: {e}") from None
    if not ragged:
        return Records(rows, {}, None)
    kept, last = [], 0
    for begin, end in spans:
        kept += lines[last:begin]
        last = end
    kept += lines[last:]
    return Records(rows, ragged, "\n".join(kept) + "\n")


def read_around(text: str, read: Callable[[str], pa.Table], height: int | None,
                id_column: str | None) -> tuple[pa.Table, dict[int, str]] | None:
    """(the table of a CSV file's text with each ragged record a row of nulls, why for each by
    row): `read` (polars) reads the text without them. height: polars' row count of the whole
    file, None where it refused it. None where no record is ragged, or where polars and the
    csv module do not agree on the records (polars' reading, or refusal, stands). ValueError
    naming the line where a record cannot be read and polars refused the file too, and where
    the table has `id_column` (a ragged record's id is unknown, the file is refused: a comma
    too many may be in any cell, a record cut short may be the start of the next)."""
    try:
        records = scan(text)
    except ValueError:
        if height is None:
            raise
        return None
    if records.kept is None or height not in (None, records.rows):
        return None
    try:
        kept = read(records.kept)
    except Exception:  # noqa: BLE001 - polars raises its own kinds
        return None
    if kept.num_rows + len(records.ragged) != records.rows:
        return None
    if id_column in kept.column_names:
        n = len(records.ragged)
        also = f"; {n} records in all do not have the header's fields" if n > 1 else ""
        why = next(iter(records.ragged.values()))
        raise ValueError(f"{why}, so the row's {id_column!r} is unknown{also}")
    return records.put_back(kept), records.ragged
