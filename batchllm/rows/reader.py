"""Rows in: a file, a folder or a glob (local or on object storage) -> InputRows (plain data).

Parquet, JSON Lines and CSV files (input.format, by extension when auto: rows/tables.py), or an
OpenAI Batch file (input.format: openai-batch: rows/openai_batch.py, read line by line). Files
are read in sorted path order, rows in file order; the row index over all files is the row's
identity for checkpoints and output order. Only the needed columns are read.

What is wrong with the whole input (a missing column, a column of the wrong type, duplicate
ids) stops the job before it starts (ConfigError); what is wrong with one row (a cell that is
not valid UTF-8, a value nested too deep, a per-row value out of range; in JSON Lines and CSV a
cell of the wrong type, rows/cells.py) makes that row an error row naming the field, and the
other rows run.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from batchllm.config import SAMPLING_FIELDS, ConfigError, InputConfig
from batchllm.rows import storage
from batchllm.rows.cells import FIELD_KINDS
from batchllm.rows.json_lines import lines
from batchllm.rows.openai_batch import parse_batch
from batchllm.rows.overrides import check_override, integral_field, override
from batchllm.rows.tables import EXTENSIONS, BadCells, column_names, read_table


@dataclass(frozen=True)
class InputRows:
    """The rows of a job. One of `prompts` / `messages` is set (both for an OpenAI Batch file,
    whose rows are chat or completion requests: per row at most one of them is not None).

    ids: the input id column, or an int64 row index when there is none.
    prompts: text per row; None where the cell is null (the engine makes that an error row).
    messages: per row a list of {"role", "content"} dicts (None for a null message, which
        rows/build.py leaves out), or None where the cell is null.
    overrides: per-row values of input columns named like sampling fields (None: job default).
    errors: rows found invalid while reading (row position -> why); they become error rows.
    prompts_as_is: the prompts skip the chat template (OpenAI /v1/completions requests).
    """

    ids: pa.Array
    prompts: list[str | None] | None
    messages: list[list[dict | None] | None] | None
    overrides: dict[str, list]
    num_rows: int
    files: tuple[str, ...] = ()
    errors: dict[int, str] = field(default_factory=dict)
    prompts_as_is: bool = False


def _folder_files(path: str, fmt: str) -> list[str]:
    """A folder's input files (hidden and _-prefixed ones skipped: _SUCCESS, _tmp): those of
    the format's extensions; for auto, the .parquet files, else the JSON Lines, else the CSV."""
    files = storage.walk_files(path)
    kinds = {"auto": ("parquet", "jsonl", "csv"), "openai-batch": ("jsonl",)}.get(fmt, (fmt,))
    for kind in kinds:
        mine = [f for f in files if any(f.lower().endswith(ext)
                                        for ext, k in EXTENSIONS.items() if k == kind)]
        if mine:
            return mine
    other = "" if fmt != "auto" else " (nor .jsonl, .ndjson or .csv files)"
    ext = ", ".join(e for e, k in EXTENSIONS.items() if k in kinds[:1])
    raise ConfigError(f"input.path: the folder {path!r} holds no {ext} files{other}")


def input_files(path: str, fmt: str = "auto") -> list[str]:
    """The input files named by input.path, sorted; ConfigError when there are none."""
    if any(c in path for c in "*?["):
        files = storage.glob(path)
        if not files:
            raise ConfigError(f"input.path: no files match {path!r}")
        return files
    if storage.is_dir(path):
        return _folder_files(path, fmt)
    if not storage.exists(path):
        raise ConfigError(f"input.path: {path!r} does not exist")
    return [path]


def _missing(field: str, column: str, file: str, names: list[str]) -> ConfigError:
    close = difflib.get_close_matches(column, names, n=1)
    hint = f"; did you mean {close[0]}?" if close else f"; columns are: {', '.join(names)}"
    if {"custom_id", "body"} <= set(names):
        hint += "; this looks like an OpenAI Batch file: set input.format: openai-batch"
    return ConfigError(f"{field}: column {column!r} not found in {file}{hint}")


def _read(file: str, cfg: InputConfig, wanted: list[str | None],
          row_groups: list[int] | None = None) -> tuple[pa.Table, BadCells]:
    text = _text_field(cfg)[0]
    kinds = {name: FIELD_KINDS[name] for name in wanted if name in FIELD_KINDS}
    kinds[text] = "messages" if cfg.messages_column else "text"
    if cfg.id_column:
        kinds[cfg.id_column] = "id"
    return read_table(file, cfg.format, wanted, kinds, row_groups)


def _check_string(t: pa.DataType, field: str, name: str) -> None:
    if not (pa.types.is_string(t) or pa.types.is_large_string(t)):
        raise ConfigError(f"{field}: column {name!r} has type {t}; expected string")


def _check_messages(t: pa.DataType, name: str) -> None:
    ok = (pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_struct(t.value_type)
    if not ok or not {"role", "content"} <= {f.name for f in t.value_type}:
        raise ConfigError(f"input.messages_column: column {name!r} has type {t}; expected "
                          "list<struct<role: string, content: string>>")


def _plain(col: pa.ChunkedArray | pa.Array) -> pa.ChunkedArray | pa.Array:
    """A dictionary-encoded column decoded to its values; any other column as it is."""
    return col.cast(col.type.value_type) if pa.types.is_dictionary(col.type) else col


def _strings(col: pa.ChunkedArray, field: str, name: str) -> list[str | None]:
    col = _plain(col)
    _check_string(col.type, field, name)
    return col.to_pylist()


def _messages(col: pa.ChunkedArray, name: str) -> list[list[dict | None] | None]:
    _check_messages(col.type, name)
    return [None if row is None else [None if m is None else
                                      {"role": m["role"], "content": m["content"]} for m in row]
            for row in col.to_pylist()]


def _ids(table: pa.Table, cfg: InputConfig, files: list[str], tables: list[pa.Table],
         num_rows: int) -> pa.Array:
    name = cfg.id_column
    having = [name in t.column_names for t in tables] if name else [False]
    if name and not all(having) and (name != "id" or any(having)):
        file = files[having.index(False)]
        raise _missing("input.id_column", name, file, column_names(file, cfg.format))
    if not name or not all(having):
        return pa.array(range(num_rows), pa.int64())
    ids = _plain(table.column(name).combine_chunks())
    if not (pa.types.is_integer(ids.type) or pa.types.is_string(ids.type)
            or pa.types.is_large_string(ids.type)):
        raise ConfigError(f"input.id_column: column {name!r} has type {ids.type}; "
                          "expected integers or strings")
    if ids.null_count:
        raise ConfigError(f"input.id_column: column {name!r} has {ids.null_count} null values")
    counts = pc.value_counts(ids)
    dup = counts.filter(pc.greater(counts.field("counts"), 1)).field("values").to_pylist()
    if dup:
        shown = ", ".join(repr(d) for d in dup[:5]) + (", ..." if len(dup) > 5 else "")
        raise ConfigError(f"input.id_column: {len(dup)} ids appear more than once: {shown}")
    return ids


def _check_schema(schema: pa.Schema, cfg: InputConfig,
                  sampling_fields: tuple[str, ...]) -> None:
    """The column types read_input checks, from a file's schema alone (a float column for an
    integer field is checked by value when its block is read: pandas writes integers with nulls
    as floats)."""
    def value_type(name: str) -> pa.DataType:
        t = schema.field(name).type
        return t.value_type if pa.types.is_dictionary(t) else t

    text, field = _text_field(cfg)
    if cfg.messages_column:
        _check_messages(value_type(text), text)
    else:
        _check_string(value_type(text), field, text)
    for name in sampling_fields:
        if name in schema.names and name != text:
            t = value_type(name)
            if not (pa.types.is_floating(t) and integral_field(name)):
                check_override(name, t)


def _text_field(cfg: InputConfig) -> tuple[str, str]:
    """(the column holding each row's text, the job-file field that names it)"""
    if cfg.messages_column:
        return cfg.messages_column, "input.messages_column"
    return cfg.prompt_column, "input.prompt_column"


def _bad_cell(cfg: InputConfig, column: str, why: str) -> str:
    """A row's error for a cell that could not be read, naming the field."""
    text, field = _text_field(cfg)
    if column == text:
        return f"{field}: {why}"
    if column == cfg.id_column:
        return f"input.id_column: {why}; the row's id is written with its bad bytes replaced"
    return f"sampling.{column} (a per-row input column): {why}"


def _rows(table: pa.Table, ids: pa.Array, cfg: InputConfig, files: tuple[str, ...],
          sampling_fields: tuple[str, ...], bad: BadCells) -> InputRows:
    text, field = _text_field(cfg)
    prompts = messages = None
    if cfg.messages_column:
        messages = _messages(table.column(text), text)
    else:
        prompts = _strings(table.column(text), field, text)
    overrides = {name: override(name, table.column(name))
                 for name in sampling_fields if name in table.column_names and name != text}
    errors = {row: _bad_cell(cfg, column, why) for row, (column, why) in bad.items()}
    return InputRows(ids=ids, prompts=prompts, messages=messages, overrides=overrides,
                     num_rows=table.num_rows, files=files, errors=errors)


def _read_file(file: str, cfg: InputConfig, sampling_fields: tuple[str, ...],
               row_groups: list[int] | None = None) -> tuple[pa.Table, BadCells]:
    text, field = _text_field(cfg)
    table, bad = _read(file, cfg, [cfg.id_column, text, *sampling_fields], row_groups)
    if text not in table.column_names:
        raise _missing(field, text, file, column_names(file, cfg.format))
    return table, bad


def _concat(tables: list[pa.Table]) -> pa.Table:
    try:
        return pa.concat_tables(tables, promote_options="permissive")
    except pa.ArrowException as e:
        raise ConfigError(f"input.path: the files' columns do not agree: {e}") from None


def read_input(cfg: InputConfig, sampling_fields: tuple[str, ...] = SAMPLING_FIELDS) -> InputRows:
    """Read every input row. Missing files or columns, unreadable files, duplicate or null ids
    and per-row sampling columns of the wrong type raise ConfigError naming the file or field.
    (An OpenAI Batch file's invalid lines are error rows instead: rows/openai_batch.py.)"""
    files = input_files(cfg.path, cfg.format)
    if cfg.format == "openai-batch":
        return _read_batch(files, sampling_fields)
    tables, bad, first = [], {}, 0
    for file in files:
        table, cells = _read_file(file, cfg, sampling_fields)
        bad.update((first + row, why) for row, why in cells.items())
        tables.append(table)
        first += table.num_rows
    table = _concat(tables)
    ids = _ids(table, cfg, files, tables, table.num_rows)
    return _rows(table, ids, cfg, tuple(files), sampling_fields, bad)


def _read_batch(files: list[str], sampling_fields: tuple[str, ...]) -> InputRows:
    """OpenAI Batch files, line by line: ids are the custom_ids."""
    b = parse_batch([(file, lines(file)) for file in files], sampling_fields)
    return InputRows(ids=pa.array(b.ids, pa.string()), prompts=b.prompts, messages=b.messages,
                     overrides=b.overrides, num_rows=len(b.ids), files=tuple(files),
                     errors=b.errors, prompts_as_is=True)
