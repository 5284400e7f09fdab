"""Input files as Arrow tables, whatever their format: Parquet through pyarrow, JSON Lines and CSV
through polars (its readers are multi-threaded and infer types over the whole file).

input.format `auto` picks by extension: .jsonl / .ndjson are JSON Lines, .csv is CSV, anything
else Parquet (as before formats existed). Every error is a ConfigError naming the file.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from batchllm.config import ConfigError
from batchllm.rows import storage

EXTENSIONS = {".parquet": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv"}


def file_format(file: str, fmt: str) -> str:
    """parquet, jsonl or csv: `fmt` itself, or by the file's extension when it is auto."""
    if fmt != "auto":
        return fmt
    lower = file.lower()
    return next((f for ext, f in EXTENSIONS.items() if lower.endswith(ext)), "parquet")


def _polars(file: str, fmt: str, text_columns: list[str]):
    import polars as pl

    source = file if not storage.is_remote(file) else storage.open_bytes(file).read()
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
        return _polars(file, fmt, []).columns
    except Exception as e:  # noqa: BLE001 - pyarrow and polars raise their own kinds
        raise _unreadable(file, fmt, e) from None


def _unreadable(file: str, fmt: str, e: BaseException) -> ConfigError:
    words = {"parquet": "Parquet", "jsonl": "JSON Lines", "csv": "CSV"}[fmt]
    return ConfigError(f"input.path: cannot read {file} as {words}: {e}")


def read_table(file: str, fmt: str, wanted: list[str | None], text_columns: list[str],
               row_groups: list[int] | None = None) -> pa.Table:
    """The columns of `wanted` that the file has (None entries skipped), as an Arrow table.
    text_columns: read as text whatever they look like (CSV). row_groups: Parquet only."""
    fmt = file_format(file, fmt)
    try:
        if fmt == "parquet":
            pf = pq.ParquetFile(storage.arrow_source(file))
            columns = [c for c in dict.fromkeys(wanted) if c in pf.schema_arrow.names]
            if row_groups is not None:
                return pf.read_row_groups(row_groups, columns=columns)
            return pf.read(columns=columns)
        frame = _polars(file, fmt, text_columns)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - pyarrow and polars raise their own kinds
        raise _unreadable(file, fmt, e) from None
    columns = [c for c in dict.fromkeys(wanted) if c in frame.columns]
    return frame.select(columns).to_arrow()


def row_count(file: str, fmt: str) -> int:
    """The rows of an input file (Parquet: from its footer)."""
    fmt = file_format(file, fmt)
    try:
        if fmt == "parquet":
            return pq.read_metadata(storage.arrow_source(file)).num_rows
        return _polars(file, fmt, []).height
    except Exception as e:  # noqa: BLE001 - pyarrow and polars raise their own kinds
        raise _unreadable(file, fmt, e) from None
