"""Text cells that are not valid UTF-8, found in an input table and made harmless, so that their
rows become error rows and every other row of the file runs.

pyarrow does not check the strings of a Parquet file when it reads them (Spark exports can hold
any bytes), and converting such a cell to Python raises UnicodeDecodeError. `repair` checks each
text column's chunks (Arrow's own check, about 0.05 s per 450 MB), and only in a chunk that
fails walks its cells: a bad cell is kept with its bad bytes escaped (b"\\xff" -> "\\\\xff",
so that string ids stay distinct) and its row is reported with the cell's path, e.g.
`messages[1].content`. Polars (JSON Lines, CSV) refuses such a file outright, so tables.py
reads it with each run of bad bytes replaced by a marker character, and `repair` finds the
marked cells the same way.
"""

from __future__ import annotations

import re

import pyarrow as pa

_SURROGATES = re.compile("[\udc80-\udcff]+")  # bad bytes, as decoding with surrogateescape
# keeps them
_MARKERS = [chr(c) for c in range(0xFDD0, 0xFDF0)]  # Unicode noncharacters: never text


def mark_bad_bytes(data: bytes) -> tuple[str, str | None]:
    """(the text of `data` with each run of bytes that are not UTF-8 replaced by a marker
    character, the marker); the marker is None when `data` is valid UTF-8."""
    try:  # valid UTF-8 holds no surrogates: the strict decode is the whole check, in C
        return data.decode("utf-8"), None
    except UnicodeDecodeError:
        text = data.decode("utf-8", "surrogateescape")
    marker = next((m for m in _MARKERS if m not in text), "\ufffd")
    return _SURROGATES.sub(marker, text), marker


def _has_text(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        return _has_text(t.value_type)
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return True
    return any(_has_text(t.field(i).type) for i in range(t.num_fields))


def _as_binary(t: pa.DataType) -> pa.DataType:
    """The type with its strings as bytes (a cast to it reads the cells without decoding)."""
    if pa.types.is_string(t):
        return pa.binary()
    if pa.types.is_large_string(t):
        return pa.large_binary()
    if pa.types.is_list(t):
        return pa.list_(_as_binary(t.value_type))
    if pa.types.is_large_list(t):
        return pa.large_list(_as_binary(t.value_type))
    if pa.types.is_struct(t):
        return pa.struct([f.with_type(_as_binary(f.type)) for f in t])
    return t


def _fix(value, path: str, marker: str | None) -> tuple[object, str | None]:
    """(the cell with its text valid, why it was not, naming the path; None when it was)."""
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8"), None
        except UnicodeDecodeError as e:
            why = f"{path} is not valid UTF-8 (byte 0x{value[e.start]:02x} at position {e.start})"
            return value.decode("utf-8", "backslashreplace"), why
    if isinstance(value, str):
        if marker is not None and marker in value:
            return value.replace(marker, "\ufffd"), f"{path} is not valid UTF-8"
        return value, None
    first = None
    if isinstance(value, dict):
        out = {}
        for key, v in value.items():
            out[key], why = _fix(v, f"{path}.{key}", marker)
            first = first or why
        return out, first
    if isinstance(value, list):
        items = []
        for i, v in enumerate(value):
            v, why = _fix(v, f"{path}[{i}]", marker)
            items.append(v)
            first = first or why
        return items, first
    return value, None


def _repair_chunk(chunk: pa.Array, name: str, marker: str | None, offset: int,
                  bad: dict[int, tuple[str, str]]) -> pa.Array:
    if pa.types.is_dictionary(chunk.type):
        chunk = chunk.cast(chunk.type.value_type)
    if marker is None:
        try:
            chunk.validate(full=True)
            return chunk
        except pa.ArrowInvalid:
            values = chunk.cast(_as_binary(chunk.type)).to_pylist()
    else:
        values = chunk.to_pylist()
    fixed = []
    for i, v in enumerate(values):
        v, why = _fix(v, name, marker)
        fixed.append(v)
        if why is not None:
            bad.setdefault(offset + i, (name, why))
    return pa.array(fixed, chunk.type)


def repair(table: pa.Table, marker: str | None = None
           ) -> tuple[pa.Table, dict[int, tuple[str, str]]]:
    """(the table with every text cell valid UTF-8, {row: (column, why)} for the rows that had
    a bad cell: the first such column of the row). marker: the character that stands for bad
    bytes (mark_bad_bytes), when the table was read from marked text."""
    bad: dict[int, tuple[str, str]] = {}
    for name in table.column_names:
        col = table.column(name)
        if not _has_text(col.type):
            continue
        chunks, offset, changed = [], 0, False
        for chunk in col.chunks:
            out = _repair_chunk(chunk, name, marker, offset, bad)
            changed |= out is not chunk
            chunks.append(out)
            offset += len(chunk)
        if changed:
            kind = chunks[0].type if chunks else col.type
            table = table.set_column(table.schema.get_field_index(name), name,
                                     pa.chunked_array(chunks, kind))
    return table, bad
