"""Cells of the text formats checked one by one, where a column as a whole does not hold what it
must: a JSON Lines column whose values mix types (a temperature of "hot" among numbers, a prompt
that is a number or a list), a CSV column of numbers with a word in it, an integer past 64 bits.
A cell that does not fit is read as null and reported as its row's error, naming the field (the
row becomes an error row, the others run); the rest are read as the column's own type.

Kinds, by column: `text` (a prompt), `messages` (a list of {role, content}), and those of the
per-row sampling fields (FIELD_KINDS, as rows/overrides.py checks their Arrow types).
"""

from __future__ import annotations

import json

import pyarrow as pa

FIELD_KINDS = {  # sampling field -> the kind of its cells
    "max_tokens": "integer", "n": "integer", "logprobs": "integer", "top_k": "integer",
    "seed": "integer", "temperature": "number", "top_p": "number", "ignore_eos": "boolean",
    "json_schema": "schema", "regex": "string", "choice": "choice", "stop": "stop",
}
_WORDS = {"text": "text", "messages": "a list of {role, content} messages",
          "integer": "an integer", "number": "a number", "boolean": "true or false",
          "schema": "a JSON schema (an object or its text)", "string": "a string",
          "choice": "a list of strings (or its JSON text)",
          "stop": "a string or a list of strings"}
_ARROW = {"text": pa.string(), "integer": pa.int64(), "number": pa.float64(),
          "boolean": pa.bool_(), "schema": pa.string(), "string": pa.string(),
          "choice": pa.string(), "stop": pa.list_(pa.string()),
          "messages": pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))}
_INT64 = (-(2**63), 2**63 - 1)
_UINT64_MAX = 2**64 - 1


def _shown(value: object) -> str:
    text = json.dumps(value) if not isinstance(value, float) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def json_cell(kind: str, value: object) -> tuple[object, str | None]:
    """A JSON value as a cell of `kind`: (the cell, None), or (None, why it does not fit)."""
    if value is None:
        return None, None
    got = _json_cell(kind, value)
    if got is _MISFIT:
        return None, f"expected {_WORDS[kind]}, got {_shown(value)}"
    return got, None


_MISFIT = object()


def _json_cell(kind: str, v: object) -> object:
    if kind in ("text", "string"):
        return v if isinstance(v, str) else _MISFIT
    if kind == "integer":
        if isinstance(v, float) and v.is_integer():
            return int(v)
        return v if isinstance(v, int) and not isinstance(v, bool) else _MISFIT
    if kind == "number":
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            return _MISFIT
        try:
            return float(v)
        except OverflowError:  # an integer past a float's range: infinite, for the row's check
            return float("inf") if v > 0 else float("-inf")
    if kind == "boolean":
        return v if isinstance(v, bool) else _MISFIT
    if kind == "schema":
        return v if isinstance(v, str) else json.dumps(v) if isinstance(v, (dict, bool)) \
            else _MISFIT
    strings = isinstance(v, list) and all(isinstance(s, str) for s in v)
    if kind == "stop":  # a string: a list of one
        return [v] if isinstance(v, str) else v if strings else _MISFIT
    if kind == "choice":  # as a string column holds it: JSON text (SamplingParams reads it)
        return v if isinstance(v, str) else json.dumps(v) if strings else _MISFIT
    if kind == "messages":
        ok = isinstance(v, list) and all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in v)
        return [{"role": m["role"], "content": m["content"]} for m in v] if ok else _MISFIT
    raise ValueError(f"no kind {kind!r}")


def text_cell(kind: str, text: str | None) -> tuple[object, str | None]:
    """A CSV cell's text as a cell of `kind` (integer, number or boolean; any other kind is
    text already): (the cell, None), or (None, why it does not fit)."""
    if text is None:
        return None, None
    s = text.strip()
    try:
        if kind == "integer":
            if s.lstrip("+-").isdigit():
                return int(s), None
            f = float(s)
            if f.is_integer():
                return int(f), None
        elif kind == "number":
            return float(s), None
        elif kind == "boolean" and s.lower() in ("true", "false"):
            return s.lower() == "true", None
    except ValueError:
        pass
    return None, f"expected {_WORDS[kind]}, got {_shown(text)}"


def column(kind: str, values: list, bad: dict[int, str]) -> pa.Array:
    """The cells (None: null) as an Arrow array of the kind's type. Integers: int64, or uint64
    where some are past int64 and none is negative; an integer that fits neither is null and
    in `bad` (row -> why), as a cell that does not fit."""
    if kind != "integer":
        return pa.array(values, _ARROW[kind])
    for i, v in enumerate(values):
        if v is not None and not _INT64[0] <= v <= _UINT64_MAX:
            bad.setdefault(i, f"{v} is out of range (64-bit integers)")
    kept = [None if i in bad else v for i, v in enumerate(values)]
    if any(v is not None and v > _INT64[1] for v in kept):
        if all(v is None or v >= 0 for v in kept):
            return pa.array(kept, pa.uint64())
        for i, v in enumerate(kept):  # with negative ones: int64
            if v is not None and v > _INT64[1]:
                bad.setdefault(i, f"{v} is out of range (64-bit integers)")
                kept[i] = None
    return pa.array(kept, pa.int64())


def fits(kind: str, t: pa.DataType) -> bool:
    """Whether an Arrow column of type t holds cells of `kind` as they are (null: none)."""
    if pa.types.is_dictionary(t):
        t = t.value_type
    if pa.types.is_null(t):
        return True
    text = pa.types.is_string(t) or pa.types.is_large_string(t)
    if kind in ("text", "string", "schema"):
        return text
    if kind == "integer":
        return pa.types.is_integer(t)
    if kind == "number":
        return pa.types.is_integer(t) or pa.types.is_floating(t)
    if kind == "boolean":
        return pa.types.is_boolean(t)
    listed = pa.types.is_list(t) or pa.types.is_large_list(t)
    if kind in ("stop", "choice"):
        return text or (listed and fits("text", t.value_type))
    if kind == "messages":
        item = t.value_type if listed else None
        return item is not None and pa.types.is_struct(item) and all(
            item.get_field_index(name) >= 0 and fits("text", item.field(name).type)
            for name in ("role", "content"))
    raise ValueError(f"no kind {kind!r}")
