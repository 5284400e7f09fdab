"""JSON lines read safely: a file's lines read a block at a time (never the whole file in
memory), and one line decoded and parsed so that whatever is wrong with it is a sentence naming
the field, never an exception: bytes that are not UTF-8, nesting deeper than
config.limits.MAX_DEPTH (found before parsing: never a RecursionError), text that is not JSON.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from batchllm.config import ConfigError
from batchllm.config.limits import too_deep
from batchllm.rows import storage

READ_BYTES = 1 << 22  # a file is read this many bytes at a time
# A surrogate in a decoded string: a byte that is not UTF-8 (decoded with surrogateescape), or a
# lone \udXXX escape (a pair of them is one character, and json.loads joins it).
SURROGATE = re.compile("[\ud800-\udfff]")
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def lines(file: str) -> Iterator[bytes]:
    """The lines of a file as bytes (as bytes.splitlines splits them), read READ_BYTES at a
    time: a large OpenAI Batch file is never in memory whole. ConfigError if it cannot be
    read."""
    try:
        with storage.open_bytes(file) as f:
            rest = b""
            while block := f.read(READ_BYTES):
                got = (rest + block).splitlines(keepends=True)
                # the last line may go on in the next block (a "\r" may be half of "\r\n")
                rest = got.pop() if got and not got[-1].endswith(b"\n") else b""
                yield from (line.rstrip(b"\r\n") for line in got)
            if rest:
                yield from rest.splitlines()
    except OSError as e:
        raise ConfigError(f"input.path: cannot read {file}: {e}") from None


def _bad_text(obj: Any) -> str | None:
    """The path of the first string (key or value) in a parsed line that is not valid text
    (it holds a surrogate: a byte that is not UTF-8, or a lone escape), e.g.
    body.messages[0].content; None if there is none. Not recursive."""
    todo: list[tuple[Any, str]] = [(obj, "")]
    while todo:
        v, path = todo.pop()
        if isinstance(v, str):
            if SURROGATE.search(v):
                return path or "line"
        elif isinstance(v, dict):
            for key, x in reversed(v.items()):
                if SURROGATE.search(key):
                    return f"{path}.{key!r}" if path else repr(key)
                todo.append((x, f"{path}.{key}" if path else key))
        elif isinstance(v, list):
            todo.extend((x, f"{path}[{i}]") for i, x in reversed(list(enumerate(v))))
    return None


def load(line: bytes | str) -> tuple[Any, str | None]:
    """(a line's JSON value, why it cannot be used as a whole; None when it can)."""
    if isinstance(line, bytes):
        try:
            text, bad = line.decode("utf-8"), False
        except UnicodeDecodeError:
            text, bad = line.decode("utf-8", "surrogateescape"), True
    else:
        text, bad = line, SURROGATE.search(line) is not None
    deep = too_deep(text)
    if deep:
        return None, deep
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as e:
        return None, f"not valid JSON ({e})"
    if bad or ("\\u" in text and SURROGATE_ESCAPE.search(text)):
        path = _bad_text(obj)
        if path is not None:
            return obj, f"{path}: not valid UTF-8 text"
    return obj, None
