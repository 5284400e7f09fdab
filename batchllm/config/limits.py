"""Limits that the job file and every row keep alike: how deep JSON may nest, and the caps on
stop strings. Torch-free and recursion-free.

MAX_DEPTH is the deepest nesting batchllm accepts: 64 objects or arrays inside one another,
counting the outermost. It is found by scanning the text, without parsing it, so that a value
nested thousands of levels deep (a per-row json_schema cell, an OpenAI Batch line) is a clear
error instead of Python's RecursionError (json.loads gives up near 1,000 levels, polars near
100). An OpenAI Batch chat line with a JSON schema needs five levels for the line itself and
about two per level of the schema; OpenAI allows 10 levels in a schema.

Stop strings: OpenAI allows 4; a row may have up to MAX_STOP of up to MAX_STOP_CHARS characters
each. Each step searches only the newly decoded text and the MAX_STOP_CHARS - 1 characters
before it (engine/stopping.py), so these bound the cost of a step.
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_DEPTH = 64
MAX_STOP = 16
MAX_STOP_CHARS = 256

# A JSON string (escapes included), or one of the characters that open, close or separate.
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}:,]', re.DOTALL)


def _path(frames: list[list]) -> str:
    """frames: [is_object, key or index] per open container, outermost first."""
    out = ""
    for is_object, at in frames:
        if is_object:
            out += f".{at}" if out else str(at)
        else:
            out += f"[{at}]"
    return out


def too_deep_spans(text: str, limit: int = MAX_DEPTH) -> list[tuple[str, int, int]]:
    """(path, start, end) of each outermost value of a JSON text that opens deeper than
    `limit` containers, e.g. ("body.metadata[0]", 812, 9040); [] when there is none. The path
    names object keys and array indices from the top (the top itself is ""). Never recursive;
    a text that is not JSON gives what its brackets say (parsing it reports the rest)."""
    if text.count("[") + text.count("{") <= limit:  # the fast answer for almost every text
        return []
    frames: list[list] = []  # [is_object, key or index] per open container
    spans: list[tuple[str, int, int]] = []
    last_string = None
    skip_from = skip_depth = -1  # inside a too-deep value: where it opened, its depth
    for m in _TOKEN.finditer(text):
        tok = m.group()
        if skip_from >= 0:
            if tok in "[{":
                skip_depth += 1
            elif tok in "]}":
                skip_depth -= 1
                if skip_depth == 0:
                    spans.append((_path(frames), skip_from, m.end()))
                    skip_from = -1
            continue
        if tok in "[{":
            if len(frames) == limit:
                skip_from, skip_depth = m.start(), 1
                continue
            frames.append([tok == "{", 0])
        elif tok in "]}":
            if frames:
                frames.pop()
        elif tok == ",":
            if frames and not frames[-1][0]:
                frames[-1][1] += 1
        elif tok == ":":
            if frames and frames[-1][0] and last_string is not None:
                frames[-1][1] = _key(last_string)
        else:
            last_string = tok
    if skip_from >= 0:  # never closed: not JSON, but too deep all the same
        spans.append((_path(frames), skip_from, len(text)))
    return spans


def _key(token: str) -> str:
    try:
        key = json.loads(token)
    except ValueError:
        key = token.strip('"')
    return key if len(key) <= 40 else key[:37] + "..."


def too_deep(text: str, limit: int = MAX_DEPTH) -> str | None:
    """Why a JSON text nests too deep ("nested more than 64 levels deep at body.x[0]"), or
    None."""
    spans = too_deep_spans(text, limit)
    if not spans:
        return None
    path = spans[0][0] if len(spans[0][0]) <= 60 else spans[0][0][:57] + "..."
    where = f" at {path}" if path else ""
    return f"nested more than {limit} levels deep{where}"


def value_too_deep(value: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether a parsed value (dicts and lists, as from YAML) nests more than `limit` deep."""
    todo = [(value, 1)]
    while todo:
        v, depth = todo.pop()
        if isinstance(v, (dict, list, tuple)):
            if depth > limit:
                return True
            todo.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))
    return False


def stop_problem(stop: tuple[str, ...] | list[str]) -> str | None:
    """Why a list of stop strings is over the caps (MAX_STOP, MAX_STOP_CHARS); None if not."""
    longest = max(map(len, stop), default=0)
    if len(stop) <= MAX_STOP and longest <= MAX_STOP_CHARS:
        return None
    return (f"at most {MAX_STOP} stop strings of at most {MAX_STOP_CHARS} characters each, "
            f"got {len(stop)} strings, the longest {longest} characters")
