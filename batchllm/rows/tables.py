"""Input files as Arrow tables, whatever their format: Parquet through pyarrow, JSON Lines through
pyarrow's reader (multi-threaded, and strict: it refuses a column whose values change type,
where polars turned a prompt of 5 into the text "5"), CSV through polars (types inferred over
the whole file).

input.format `auto` picks by extension: .jsonl / .ndjson are JSON Lines, .csv is CSV, anything
else Parquet (as before formats existed). Every error is a ConfigError naming the file.

A row that one bad cell would make the whole file unreadable for is reported instead, and
the rest read (`read_table`'s second result): a text cell that is not valid UTF-8, in any
format (rows/text_cells.py); in the text formats, a cell that is not what its column must hold
(rows/cells.py: a temperature of "hot", a prompt that is a number, an integer past 64 bits);
in JSON Lines, a value nested deeper than config.limits.MAX_DEPTH, and a line that is not a JSON
object when the rows have no id column (with one, the row's id is unknown: the file is refused,
naming the line). A JSON Lines file whose wanted columns pyarrow's reader does not give as
their kinds is read line by line in Python (also a number such as 1e400, read as infinite).
In CSV, a record with more or fewer fields than the header (a blank line too), which polars
refuses or pads, is reported the same way, naming its line (rows/csv_records.py).
"""

from __future__ import annotations

import functools
import json

import pyarrow as pa
import pyarrow.parquet as pq

from batchllm.config import ConfigError
from batchllm.config.limits import MAX_DEPTH, too_deep_spans
from batchllm.rows import csv_records, storage
from batchllm.rows.cells import column, fits, json_cell, text_cell
from batchllm.rows.text_cells import mark_bad_bytes, repair

BadCells = dict[int, tuple[str, str]]  # row in the file -> (column, why)
Kinds = dict[str, str]  # column -> the kind of its cells (rows/cells.py); "id": the id column

EXTENSIONS = {".parquet": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv"}


def file_format(file: str, fmt: str) -> str:
    """parquet, jsonl or csv: `fmt` itself, or by the file's extension when it is auto."""
    if fmt != "auto":
        return fmt
    lower = file.lower()
    return next((f for ext, f in EXTENSIONS.items() if lower.endswith(ext)), "parquet")


def column_names(file: str, fmt: str) -> list[str]:
    """The columns of an input file."""
    fmt = file_format(file, fmt)
    try:
        if fmt == "parquet":
            return pq.read_schema(storage.arrow_source(file)).names
        return _text_table(file, fmt, {})[3]
    except Exception as e:  # noqa: BLE001 - pyarrow and polars raise their own kinds
        raise _unreadable(file, fmt, e) from None


def _unreadable(file: str, fmt: str, e: BaseException) -> ConfigError:
    words = {"parquet": "Parquet", "jsonl": "JSON Lines", "csv": "CSV"}[fmt]
    return ConfigError(f"input.path: cannot read {file} as {words}: {e}")


def _source_bytes(file: str) -> bytes:
    with storage.open_bytes(file) as f:
        return f.read()


def _text_column(kinds: Kinds) -> str:
    """The column of the prompts or messages ("" where kinds names none)."""
    return next((c for c, k in kinds.items() if k in ("text", "messages")), "")


def _id_column(kinds: Kinds) -> str | None:
    return next((c for c, k in kinds.items() if k == "id"), None)


def _csv(source: str | bytes, kinds: Kinds):
    """A CSV file as a polars frame; the text columns stay text (a column of numbers is still
    a prompt), integers past 64 bits (polars' Int128, which Arrow has not) are read as text."""
    import polars as pl

    if isinstance(source, str) and storage.is_remote(source):
        source = _source_bytes(source)
    text = [c for c, k in kinds.items() if k in ("text", "string", "schema", "stop", "choice")]
    frame = pl.read_csv(source, infer_schema_length=None,
                        schema_overrides={c: pl.String for c in text})
    wide = [c for c, t in frame.schema.items() if t == pl.Int128]
    return frame.with_columns(pl.col(wide).cast(pl.String)) if wide else frame


def _typed_csv(table: pa.Table, kinds: Kinds) -> tuple[pa.Table, BadCells]:
    """Each integer, number or boolean column of a CSV table that is not of its kind as a whole
    (a word among numbers: read as text) read cell by cell; the cells that do not fit reported."""
    bad: BadCells = {}
    for name in table.column_names:
        kind = kinds.get(name)
        if kind not in ("integer", "number", "boolean") or fits(kind, table.column(name).type):
            continue
        values, why = [], {}
        for row, text in enumerate(table.column(name).to_pylist()):
            value, wrong = text_cell(kind, text)
            values.append(value)
            if wrong:
                why[row] = wrong
        array = column(kind, values, why)
        table = table.set_column(table.schema.get_field_index(name), name, array)
        for row, wrong in why.items():
            bad.setdefault(row, (name, wrong))
    return table, bad


def _json_fast(source: str | bytes, kinds: Kinds) -> pa.Table | None:
    """A JSON Lines file through pyarrow's reader, or None where it refuses the file or gives a
    wanted column not as its kind (a value of another type, an integer read as a float)."""
    import pyarrow.json as pj

    try:
        table = pj.read_json(pa.BufferReader(source) if isinstance(source, bytes)
                             else storage.arrow_source(source))
    except (pa.ArrowException, OSError):
        return None
    for name, kind in kinds.items():
        if name not in table.column_names:
            continue
        t = table.column(name).type
        if not (fits(kind, t) if kind != "id" else fits("integer", t) or fits("text", t)):
            return None
    return table


def _json_lines(text: str, kinds: Kinds) -> tuple[pa.Table, BadCells, list[str]]:
    """JSON Lines read line by line in Python, as pyarrow reads them (blank lines are no rows):
    (the columns of `kinds`, each cell checked against its kind, the rows with a cell read as
    null, every column's name in the order first seen). A cell that does not fit, or nests
    deeper than MAX_DEPTH, is null and reported; a line that is not a JSON object is a row of
    nulls, reported, where there is no id column (ValueError naming the line where there is
    one: that row's id is unknown)."""
    values: dict[str, list] = {name: [] for name in kinds}
    names: dict[str, None] = {}
    bad: BadCells = {}
    text_column = _text_column(kinds)
    broken = None  # the first line that is not a JSON object: (its number, why)
    row = 0
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip(" \t\r\f\v"):
            continue
        spans = too_deep_spans(line)
        for _, start, end in reversed(spans):
            line = line[:start] + "null" + line[end:]
        try:
            obj = json.loads(line)
            why = None if isinstance(obj, dict) else "is not a JSON object"
        except (ValueError, RecursionError) as e:
            obj, why = None, f"is not valid JSON ({e})"
        if why is not None:
            broken = broken or (number, why)
            bad[row] = (text_column, f"line {number} {why}")
            obj = {}
        names.update(dict.fromkeys(obj))
        deep = {}
        for path, _, _ in spans:  # the whole column: Arrow's types nest 64 deep at most
            shown = path if len(path) <= 60 else path[:57] + "..."
            deep.setdefault(path.split(".")[0].split("[")[0],
                            f"{shown} is nested more than {MAX_DEPTH} levels deep")
        for name, kind in kinds.items():
            v = None if name in deep else obj.get(name)
            if kind != "id":
                v, wrong = json_cell(kind, v)
                if wrong or name in deep:
                    bad.setdefault(row, (name, wrong or deep[name]))
            values[name].append(v)
        row += 1
    id_column = _id_column(kinds)
    if broken is not None and id_column in names:
        raise ValueError(f"line {broken[0]} {broken[1]}, so the row's {id_column!r} is unknown")
    arrays = {}
    for name in (c for c in kinds if c in names):
        if kinds[name] == "id":
            try:
                arrays[name] = pa.array(values[name])
            except (pa.ArrowException, TypeError, OverflowError) as e:
                raise ConfigError(f"input.id_column: column {name!r} holds ids of more than "
                                  f"one type, or integers past 64 bits ({e})") from None
            continue
        out_of_range: dict[int, str] = {}
        arrays[name] = column(kinds[name], values[name], out_of_range)
        for r, wrong in out_of_range.items():
            bad.setdefault(r, (name, wrong))
    table = pa.table(arrays) if arrays else pa.table({"_": pa.nulls(row)}).drop_columns(["_"])
    return table, bad, list(names)


def _text_table(file: str, fmt: str, kinds: Kinds
                ) -> tuple[pa.Table, str | None, BadCells, list[str]]:
    """(a JSON Lines or CSV file as an Arrow table, the marker of bad bytes or None, the rows
    with a cell read as null, the file's column names): read fast as it is; JSON Lines whose
    wanted columns are not of their kinds line by line (_json_lines); a CSV file through
    _csv_table."""
    if fmt == "jsonl":
        table = _json_fast(file, kinds)
        if table is not None:
            return table, None, {}, table.column_names
        text, marker = mark_bad_bytes(_source_bytes(file))
        table, cells, names = _json_lines(text, kinds)
        return table, marker, cells, names
    table, marker, cells = _csv_table(file, kinds)
    names = table.column_names
    table, typed = _typed_csv(table, kinds)
    for row, cell in typed.items():
        cells.setdefault(row, cell)
    return table, marker, cells, names


def _csv_table(file: str, kinds: Kinds) -> tuple[pa.Table, str | None, BadCells]:
    """(a CSV file as polars reads it, the marker of bad bytes or None, its ragged records):
    polars reads the file, again with bad bytes marked where it refuses them; where it still
    refuses it, or a null in the last column may be a record cut short, it is read around the
    records whose field count is not the header's (rows/csv_records.py)."""
    frame = error = text = marker = None
    raw = functools.cache(lambda: _source_bytes(file))  # read here once at most
    try:
        frame = _csv(file, kinds)
    except Exception as e:  # noqa: BLE001 - polars raises its own kinds
        error = e
        text, marker = mark_bad_bytes(raw())
        if marker is not None:
            try:
                frame = _csv(text.encode(), kinds)
            except Exception:  # noqa: BLE001, S110 - ragged too, perhaps: read around below
                pass
    if frame is not None and not csv_records.may_be_short(
            frame, lambda: text if text is not None else raw()):
        return frame.to_arrow(), marker, {}
    if text is None:
        text, marker = mark_bad_bytes(raw())
    got = csv_records.read_around(text, lambda kept: _csv(kept.encode(), kinds).to_arrow(),
                                  None if frame is None else frame.height, _id_column(kinds))
    if got is None:  # no ragged record, or none that polars and the csv module agree on
        if frame is None:
            raise error
        return frame.to_arrow(), marker, {}
    return got[0], marker, {row: (_text_column(kinds), why) for row, why in got[1].items()}


def read_table(file: str, fmt: str, wanted: list[str | None], kinds: Kinds,
               row_groups: list[int] | None = None) -> tuple[pa.Table, BadCells]:
    """The columns of `wanted` that the file has (None entries skipped), as an Arrow table whose
    text is valid UTF-8, and the rows with a cell that was not readable (the module's
    docstring), by their position in the file. kinds: what the text formats' columns hold
    (rows/cells.py). row_groups: Parquet only."""
    fmt = file_format(file, fmt)
    try:
        if fmt == "parquet":
            pf = pq.ParquetFile(storage.arrow_source(file))
            columns = [c for c in dict.fromkeys(wanted) if c in pf.schema_arrow.names]
            if row_groups is not None:
                return repair(pf.read_row_groups(row_groups, columns=columns))
            return repair(pf.read(columns=columns))
        table, marker, cells, _ = _text_table(file, fmt, kinds)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - pyarrow and polars raise their own kinds
        raise _unreadable(file, fmt, e) from None
    columns = [c for c in dict.fromkeys(wanted) if c in table.column_names]
    table, bad = repair(table.select(columns), marker)
    for row, cell in cells.items():
        bad.setdefault(row, cell)
    return table, dict(sorted(bad.items()))


def row_count(file: str, fmt: str) -> int:
    """The rows of an input file (Parquet: from its footer)."""
    fmt = file_format(file, fmt)
    try:
        if fmt == "parquet":
            return pq.read_metadata(storage.arrow_source(file)).num_rows
        return _text_table(file, fmt, {})[0].num_rows
    except Exception as e:  # noqa: BLE001 - pyarrow and polars raise their own kinds
        raise _unreadable(file, fmt, e) from None
