"""Input files as Arrow tables, whatever their format: Parquet through pyarrow, JSON Lines and CSV
through polars (its readers are multi-threaded and infer types over the whole file).

input.format `auto` picks by extension: .jsonl / .ndjson are JSON Lines, .csv is CSV, anything
else Parquet (as before formats existed). Every error is a ConfigError naming the file.

A row that one bad cell would make the whole file unreadable for is reported instead, and
the rest read (`read_table`'s second result): a text cell that is not valid UTF-8, in any
format (rows/text_cells.py), or a JSON Lines value nested deeper than config.limits.MAX_DEPTH
(polars gives up on the whole file at about 100 levels), which is read as null. A JSON Lines
file that polars refuses is read line by line in Python (also a number such as 1e400, which
polars refuses and Python reads as infinite).
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq

from batchllm.config import ConfigError
from batchllm.config.limits import MAX_DEPTH, too_deep_spans
from batchllm.rows import storage
from batchllm.rows.text_cells import mark_bad_bytes, repair

BadCells = dict[int, tuple[str, str]]  # row in the file -> (column, why)

EXTENSIONS = {".parquet": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv"}


def file_format(file: str, fmt: str) -> str:
    """parquet, jsonl or csv: `fmt` itself, or by the file's extension when it is auto."""
    if fmt != "auto":
        return fmt
    lower = file.lower()
    return next((f for ext, f in EXTENSIONS.items() if lower.endswith(ext)), "parquet")


def _polars(file: str | bytes, fmt: str, text_columns: list[str]):
    import polars as pl

    source = file
    if isinstance(file, str) and storage.is_remote(file):
        with storage.open_bytes(file) as f:
            source = f.read()
    if fmt == "jsonl":
        return pl.read_ndjson(source, infer_schema_length=None)
    # the text columns stay text (a column of numbers is still a prompt)
    return pl.read_csv(source, infer_schema_length=None,
                       schema_overrides={c: pl.String for c in text_columns})


def column_names(file: str, fmt: str) -> list[str]:
    """The columns of an input file."""
    fmt = file_format(file, fmt)
    try:
        if fmt == "parquet":
            return pq.read_schema(storage.arrow_source(file)).names
        return _polars_lenient(file, fmt, [])[0].columns
    except Exception as e:  # noqa: BLE001 - pyarrow and polars raise their own kinds
        raise _unreadable(file, fmt, e) from None


def _unreadable(file: str, fmt: str, e: BaseException) -> ConfigError:
    words = {"parquet": "Parquet", "jsonl": "JSON Lines", "csv": "CSV"}[fmt]
    return ConfigError(f"input.path: cannot read {file} as {words}: {e}")


def _json_lines(text: str) -> tuple[object, BadCells]:
    """JSON Lines read line by line in Python, as polars reads them (blank lines are no rows),
    where polars refuses the whole file: a column whose value nests deeper than MAX_DEPTH is
    read as null in that row, and the row reported with the path; a number past a float's range is infinite (for the
    row's check to refuse). ValueError naming the line for a line that is not a JSON object."""
    import polars as pl

    rows, deep = [], {}
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip(" \t\r\f\v"):
            continue
        spans = too_deep_spans(line)
        for _, start, end in reversed(spans):
            line = line[:start] + "null" + line[end:]
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError) as e:
            raise ValueError(f"line {number} is not valid JSON ({e})") from None
        if not isinstance(obj, dict):
            raise TypeError(f"line {number} is not a JSON object")
        for path, _, _ in spans:  # the whole column: Arrow's types nest 64 deep at most
            obj[path.split(".")[0].split("[")[0]] = None
        if spans:
            path = spans[0][0]
            shown = path if len(path) <= 60 else path[:57] + "..."
            column = path.split(".")[0].split("[")[0]
            deep[len(rows)] = (column, f"{shown} is nested more than {MAX_DEPTH} levels deep")
        rows.append(obj)
    return pl.from_dicts(rows, infer_schema_length=None), deep


def _polars_lenient(file: str, fmt: str, text_columns: list[str]):
    """(the file as a polars frame, the marker of bad bytes or None, rows whose too-deep values
    were read as null): read by polars as it is, and only when polars refuses it, again with
    bad bytes marked (text_cells.mark_bad_bytes) and (JSON Lines) line by line."""
    try:
        return _polars(file, fmt, text_columns), None, {}
    except Exception as e:  # noqa: BLE001 - polars raises its own kinds, and RecursionError
        first = e
    with storage.open_bytes(file) as f:
        text, marker = mark_bad_bytes(f.read())
    if fmt == "jsonl":
        frame, deep = _json_lines(text)
        return frame, marker, deep
    if marker is None:
        raise first
    try:
        return _polars(text.encode(), fmt, text_columns), marker, {}
    except Exception:  # noqa: BLE001 - what is wrong is not what was mended
        raise first from None


def read_table(file: str, fmt: str, wanted: list[str | None], text_columns: list[str],
               row_groups: list[int] | None = None) -> tuple[pa.Table, BadCells]:
    """The columns of `wanted` that the file has (None entries skipped), as an Arrow table whose
    text is valid UTF-8, and the rows with a cell that was not readable (the module's
    docstring), by their position in the file. text_columns: read as text whatever they look
    like (CSV). row_groups: Parquet only."""
    fmt = file_format(file, fmt)
    try:
        if fmt == "parquet":
            pf = pq.ParquetFile(storage.arrow_source(file))
            columns = [c for c in dict.fromkeys(wanted) if c in pf.schema_arrow.names]
            if row_groups is not None:
                return repair(pf.read_row_groups(row_groups, columns=columns))
            return repair(pf.read(columns=columns))
        frame, marker, deep = _polars_lenient(file, fmt, text_columns)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - pyarrow and polars raise their own kinds
        raise _unreadable(file, fmt, e) from None
    columns = [c for c in dict.fromkeys(wanted) if c in frame.columns]
    table, bad = repair(frame.select(columns).to_arrow(), marker)
    for row, (column, why) in deep.items():
        if column in columns:
            bad.setdefault(row, (column, why))
    return table, dict(sorted(bad.items()))


def row_count(file: str, fmt: str) -> int:
    """The rows of an input file (Parquet: from its footer)."""
    fmt = file_format(file, fmt)
    try:
        if fmt == "parquet":
            return pq.read_metadata(storage.arrow_source(file)).num_rows
        return _polars_lenient(file, fmt, [])[0].height
    except Exception as e:  # noqa: BLE001 - pyarrow and polars raise their own kinds
        raise _unreadable(file, fmt, e) from None
