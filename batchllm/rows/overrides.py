"""Per-row sampling columns: input columns named like sampling fields (max_tokens, stop, ...),
their types checked (a wrong type is the job's error: ConfigError) and their values read as
Python values (a value out of range is left for the row's own check: an error row)."""

from __future__ import annotations

import pyarrow as pa

from batchllm.config import ConfigError


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _is_text_or_texts(t: pa.DataType) -> bool:
    return _is_text(t) or (
        (pa.types.is_list(t) or pa.types.is_large_list(t)) and _is_text(t.value_type))


COLUMN_KINDS = {  # sampling field -> (arrow type test, words for the message)
    "max_tokens": (pa.types.is_integer, "integers"),
    "n": (pa.types.is_integer, "integers"),
    "logprobs": (pa.types.is_integer, "integers"),
    "json_schema": (_is_text, "strings (a JSON schema per row)"),
    "regex": (_is_text, "strings"),
    "choice": (_is_text_or_texts, "lists of strings, or strings holding a JSON list"),
    "top_k": (pa.types.is_integer, "integers"),
    "seed": (pa.types.is_integer, "integers"),
    "temperature": (lambda t: pa.types.is_integer(t) or pa.types.is_floating(t), "numbers"),
    "top_p": (lambda t: pa.types.is_integer(t) or pa.types.is_floating(t), "numbers"),
    "ignore_eos": (pa.types.is_boolean, "booleans"),
    "stop": (_is_text_or_texts, "strings or lists of strings"),
}


def check_override(name: str, t: pa.DataType) -> None:
    ok, words = COLUMN_KINDS.get(name, (lambda t: True, ""))
    if not (ok(t) or pa.types.is_null(t)):
        raise ConfigError(f"input column {name!r} (per-row sampling.{name}) has type "
                          f"{t}; expected {words}")


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
    if pa.types.is_floating(col.type) and COLUMN_KINDS.get(name, (0, ""))[1] == "integers":
        return [_integral(v) for v in col.to_pylist()]
    check_override(name, col.type)
    values = col.to_pylist()
    if name == "stop":
        values = [v if v is None else (v,) if isinstance(v, str) else tuple(v) for v in values]
    elif name == "choice":  # a list column; a string column holds JSON (SamplingParams parses)
        values = [tuple(v) if isinstance(v, list) else v for v in values]
    return values
