"""Per-row sampling columns: input columns named like sampling fields (max_tokens, stop, ...),
their types checked (a wrong type is the job's error: ConfigError) and their values read as
Python values (a value out of range is left for the row's own check: an error row)."""

from __future__ import annotations

import pyarrow as pa

from batchllm.config import ConfigError
from batchllm.rows.cells import FIELD_KINDS, fits

_WORDS = {  # a kind of rows/cells.py -> the column's words in a message
    "integer": "integers", "number": "numbers", "boolean": "booleans",
    "schema": "strings (a JSON schema per row)", "string": "strings",
    "choice": "lists of strings, or strings holding a JSON list",
    "stop": "strings or lists of strings"}


def integral_field(name: str) -> bool:
    """Whether the sampling field holds integers (a float column of them is read by value)."""
    return FIELD_KINDS.get(name) == "integer"


def check_override(name: str, t: pa.DataType) -> None:
    kind = FIELD_KINDS.get(name)
    if kind is not None and not fits(kind, t):
        raise ConfigError(f"input column {name!r} (per-row sampling.{name}) has type "
                          f"{t}; expected {_WORDS[kind]}")


def _integral(v: float | None) -> int | float | None:
    """A float that holds an integer, as the int (pandas writes integers with nulls as
    float64); any other float as it is, for the row's check to refuse."""
    return int(v) if v is not None and v.is_integer() else v


def override(name: str, col: pa.ChunkedArray) -> list:
    """One per-row sampling column as Python values (None: the job default).

    Only the column's type is checked here; a value out of range (max_tokens 0, 2.5 or 1e300)
    is left for the row's check to make an error row, so one bad row does not stop the job."""
    if pa.types.is_dictionary(col.type):
        col = col.cast(col.type.value_type)
    if pa.types.is_floating(col.type) and integral_field(name):
        return [_integral(v) for v in col.to_pylist()]
    check_override(name, col.type)
    values = col.to_pylist()
    if name == "stop":
        values = [v if v is None else (v,) if isinstance(v, str) else tuple(v) for v in values]
    elif name == "choice":  # a list column; a string column holds JSON (SamplingParams parses)
        values = [tuple(v) if isinstance(v, list) else v for v in values]
    return values
