"""Field checks of the job file: value -> normalized value, or raise Bad("expected ..., got ...").
The caller (config/sections.py) adds the field path to the message."""

from __future__ import annotations

import difflib
import math
import os
import re
from typing import Any

from batchllm.config.limits import MAX_DEPTH, stop_problem, too_deep, value_too_deep


class Bad(Exception):
    """Raised by a field check; the caller adds the field path."""


def show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def did_you_mean(word: Any, choices: list[str]) -> str:
    close = difflib.get_close_matches(str(word), choices, n=1, cutoff=0.6)
    return f"did you mean {close[0]}?" if close else "expected one of: " + ", ".join(choices)


# ---- field checks: value -> normalized value, or raise Bad("expected ..., got ...") ----------

def positive_int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise Bad(f"expected a positive integer, got {show(v)}")
    return v


def non_negative_int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise Bad(f"expected an integer >= 0, got {show(v)}")
    return v


def optional(check):
    return lambda v: None if v is None else check(v)


def boolean(v: Any) -> bool:
    if not isinstance(v, bool):
        raise Bad(f"expected true or false, got {show(v)}")
    return v


def auto_or_boolean(v: Any) -> str | bool:
    if v == "auto" or isinstance(v, bool):
        return v
    raise Bad(f"expected auto, true or false, got {show(v)}")


def string(v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise Bad(f"expected a non-empty string, got {show(v)}")
    return v


def file_path(v: Any) -> str:
    if isinstance(v, os.PathLike):
        v = os.fspath(v)
    return os.path.expanduser(string(v))


def prom_file(v: Any) -> str:
    """A local file for node_exporter's textfile collector, which reads only *.prom files."""
    v = file_path(v)
    if "://" in v or not v.endswith(".prom"):
        raise Bad(f"expected a local file path ending in .prom (node_exporter's textfile "
                  f"collector reads *.prom files), got {show(v)}")
    return v


def number(v: Any, what: str, ok) -> float:
    try:
        good = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
    except OverflowError:
        good = False
    if not good or not ok(v):
        raise Bad(f"expected {what}, got {show(v)}")
    return float(v)


def one_of(*choices: str, hints: dict[str, str] | None = None):
    """A check for an enum; hints map common wrong words to the right one (gpu -> cuda)."""
    def check(v: Any) -> str:
        if v in choices:
            return v
        hint = did_you_mean(v, list(choices)) if isinstance(v, str) else ""
        if isinstance(v, str) and hints and v.lower() in hints:
            hint = f"did you mean {hints[v.lower()]}?"
        raise Bad(f"expected one of {', '.join(choices)}, got {show(v)}"
                   + (f"; {hint}" if hint.startswith("did") else ""))
    return check


def stop(v: Any) -> tuple[str, ...]:
    v = [v] if isinstance(v, str) else () if v is None else v
    if not isinstance(v, (list, tuple)) or not all(
            isinstance(s, str) and s for s in v):
        raise Bad(f"expected a list of non-empty strings, got {show(v)}")
    why = stop_problem(v)
    if why:
        raise Bad(f"expected {why}")
    return tuple(v)


_UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "ki": 2**10, "mi": 2**20,
          "gi": 2**30, "ti": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_size(text: str) -> int:
    """Bytes in a size such as "4GiB", "512MiB", "1.5GB" or "1024"; ValueError if not one.

    KiB/MiB/GiB/TiB (and K/M/G/T, Ki/Mi/Gi/Ti) are powers of 1024; KB/MB/GB/TB powers of 1000.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m and _UNITS.get(m.group(2).lower())
    size = float(m.group(1)) * unit if unit else 0.0
    if not math.isfinite(size) or size < 1:
        raise ValueError(f"not a size such as '4GiB' or '512MiB': {text!r}")
    return int(size)


def kv_memory(v: Any) -> float | int:
    """A fraction of free memory (a float in (0, 1]) or a size (text such as '4GiB'), as a float
    fraction or an int number of bytes."""
    if isinstance(v, str):
        try:
            return parse_size(v)
        except ValueError:
            raise Bad(f"expected a fraction in (0, 1] or a size such as '4GiB', got {show(v)}")
    return number(v, "a fraction in (0, 1] or a size such as '4GiB'", lambda x: 0 < x <= 1)


def int_in(lo: int, hi: int):
    """A check for an integer in lo..hi."""
    def check(v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise Bad(f"expected an integer in {lo}..{hi}, got {show(v)}")
        return v
    return check


def json_schema(v: Any) -> str | None:
    """A JSON schema given inline (a YAML mapping or JSON text) or as the path of a JSON file,
    as canonical JSON text (the file is read once, here: its contents are the job's)."""
    import json

    if v is None:
        return None
    if isinstance(v, os.PathLike):
        v = os.fspath(v)
    if isinstance(v, str) and not v.lstrip().startswith(("{", "[")):
        path = os.path.expanduser(v)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise Bad(f"expected a JSON schema or the path of a JSON file; cannot read "
                      f"{show(v)}: {e.strerror or e}") from None
        v = text
        where = f"the file {path}"
    else:
        where = "the value"
    if isinstance(v, str):
        deep = too_deep(v)
        if deep:
            raise Bad(f"{where} is {deep}")
        try:
            v = json.loads(v)
        except ValueError as e:
            raise Bad(f"{where} is not valid JSON: {e}") from None
    elif value_too_deep(v):
        raise Bad(f"the value is nested more than {MAX_DEPTH} levels deep")
    if not isinstance(v, (dict, bool)):
        raise Bad(f"expected a JSON schema (an object), got {show(v)}")
    return json.dumps(v, ensure_ascii=False)  # key order kept: it is the generation order


def choices(v: Any) -> tuple[str, ...] | None:
    """A non-empty list of non-empty strings (structured output: one of them), or None."""
    if v is None:
        return None
    if not isinstance(v, (list, tuple)) or not v or not all(isinstance(s, str) and s for s in v):
        raise Bad(f"expected a non-empty list of non-empty strings, got {show(v)}")
    return tuple(v)
