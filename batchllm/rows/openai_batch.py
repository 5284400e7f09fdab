"""OpenAI Batch input files (input.format: openai-batch): one request per JSON line ->
the rows of a job.

A line is `{"custom_id", "method": "POST", "url", "body"}` with url /v1/chat/completions (body:
messages, rendered with the model's chat template) or /v1/completions (body: prompt, sent as it
is). The body's sampling fields become the row's sampling: max_completion_tokens or max_tokens,
temperature, top_p, stop, seed, n, logprobs / top_logprobs, response_format (json_schema or
json_object). A field a line leaves out takes the job's default (sampling.*), not OpenAI's: the
job's temperature is 0 unless the job sets it.

A line that is not valid becomes an error row whose error names the line and the field
("line 7: body.temperature: expected a number in 0..2, got 'hot'"); the job goes on. That covers
text that is not valid UTF-8 (or a lone surrogate escape such as "\\ud800"), nesting deeper than
config.limits.MAX_DEPTH (found before parsing: never a RecursionError), and numbers out of range
(temperature in 0..2 as OpenAI's API, max_tokens up to 2**31 - 1, at most MAX_STOP stop strings).
A line with no usable custom_id (missing, not valid text, or one an earlier line took) gets the
id "line-N". Lines are parsed as they are read: a file is never in memory whole.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from batchllm.config.limits import stop_problem
from batchllm.rows.json_lines import SURROGATE, load
from batchllm.sampling_params import MAX_N, MAX_TOKENS, SEEDS

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
# Body fields that do not change what is generated (or only at their neutral value).
_IGNORED = {"model": None, "user": None, "metadata": None, "store": None, "service_tier": None,
            "stream": False, "stream_options": None, "frequency_penalty": 0,
            "presence_penalty": 0, "parallel_tool_calls": None, "echo": False, "best_of": 1,
            "suffix": None}
_ROLES = {"system", "user", "assistant", "developer"}
@dataclass
class BatchRequests:
    """The requests of a batch file, one entry per non-blank line, in file order. A row is chat
    (messages set), completion (prompt set) or invalid (in errors, neither set)."""

    ids: list[str] = field(default_factory=list)
    prompts: list[str | None] = field(default_factory=list)
    messages: list[list[dict] | None] = field(default_factory=list)
    overrides: dict[str, list] = field(default_factory=dict)  # sampling field -> per-row values
    errors: dict[int, str] = field(default_factory=dict)


class _Bad(Exception):
    def __init__(self, where: str, what: str) -> None:
        super().__init__(f"{where}: {what}")


def _show(v: Any) -> str:
    text = json.dumps(v) if not isinstance(v, str) else repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _int(body: dict, key: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        span = f"an integer >= {lo}" if hi is None else f"an integer in {lo}..{hi}"
        raise _Bad(f"body.{key}", f"expected {span}, got {_show(v)}")
    return v


def _number(body: dict, key: str, what: str, ok) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not ok(v):
        raise _Bad(f"body.{key}", f"expected {what}, got {_show(v)}")
    return float(v)


def _content(m: dict, j: int) -> str:
    c = m.get("content")
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        texts = []
        for k, part in enumerate(c):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                    part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else part
                raise _Bad(f"body.messages[{j}].content[{k}]",
                           f"only text parts are supported, got {_show(kind)}")
            texts.append(part["text"])
        return "\n".join(texts)
    raise _Bad(f"body.messages[{j}].content", f"expected a string or text parts, got {_show(c)}")


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _Bad("body.messages", f"expected a non-empty list of messages, got {_show(msgs)}")
    out = []
    for j, m in enumerate(msgs):
        role = m.get("role") if isinstance(m, dict) else m
        if not isinstance(role, str) or role not in _ROLES:
            raise _Bad(f"body.messages[{j}].role",
                       f"expected one of {', '.join(sorted(_ROLES))}, got {_show(role)}")
        role = "system" if m["role"] == "developer" else m["role"]  # the same, for templates
        out.append({"role": role, "content": _content(m, j)})
    return out


def _prompt(body: dict) -> str:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1:
        p = p[0]
    if not isinstance(p, str):
        raise _Bad("body.prompt", f"expected a string, got {_show(p)}")
    return p


def _stop(body: dict) -> tuple[str, ...] | None:
    v = body.get("stop")
    if v is None:
        return None
    v = [v] if isinstance(v, str) else v
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
        raise _Bad("body.stop", f"expected a string or a list of strings, got {_show(v)}")
    why = stop_problem(v)
    if why:
        raise _Bad("body.stop", f"expected {why}")
    return tuple(v)


def _json_schema(body: dict) -> str | None:
    rf = body.get("response_format")
    if rf is None or (isinstance(rf, dict) and rf.get("type") == "text"):
        return None
    if isinstance(rf, dict) and rf.get("type") == "json_object":
        return json.dumps({"type": "object"})
    spec = rf.get("json_schema") if isinstance(rf, dict) else None
    if not (isinstance(rf, dict) and rf.get("type") == "json_schema" and isinstance(spec, dict)
            and isinstance(spec.get("schema"), dict)):
        raise _Bad("body.response_format", "expected {type: text | json_object | json_schema, "
                   f"json_schema: {{schema: ...}}}}, got {_show(rf)}")
    return json.dumps(spec["schema"])  # key order kept: it is the order fields are generated in


def _logprobs(body: dict, chat: bool) -> int | None:
    """OpenAI's logprobs request as batchllm's k (top alternatives per token; 0: none)."""
    if chat:
        if body.get("logprobs") not in (None, True, False):
            raise _Bad("body.logprobs", f"expected true or false, got {_show(body['logprobs'])}")
        top = _int(body, "top_logprobs", 0, 20)
        # batchllm's k = 0 means no log-probabilities: the chosen token's come with k >= 1
        return max(top or 0, 1) if body.get("logprobs") else None
    k = _int(body, "logprobs", 0, 5)
    return None if k is None else max(k, 1)


def _sampling(body: dict, chat: bool) -> dict[str, Any]:
    """The body's sampling fields under batchllm's names (absent: None)."""
    max_tokens = _int(body, "max_completion_tokens", 1, MAX_TOKENS) if chat else None
    return {
        "max_tokens": (max_tokens if max_tokens is not None
                       else _int(body, "max_tokens", 1, MAX_TOKENS)),
        # OpenAI's range (NaN, infinities and a 400-digit integer are out of it)
        "temperature": _number(body, "temperature", "a number in 0..2", lambda x: 0 <= x <= 2),
        "top_p": _number(body, "top_p", "a number in (0, 1]", lambda x: 0 < x <= 1),
        "stop": _stop(body),
        "seed": _int(body, "seed", *SEEDS),
        "n": _int(body, "n", 1, MAX_N),
        "logprobs": _logprobs(body, chat),
        "json_schema": _json_schema(body),
    }


_HANDLED = {"messages", "prompt", "max_completion_tokens", "max_tokens", "temperature", "top_p",
            "stop", "seed", "n", "logprobs", "top_logprobs", "response_format"}
# What a line may ask that this batchllm's sampling has no field for yet (their neutral value).
_NEUTRAL = {"n": 1, "logprobs": None, "json_schema": None}


def _request(obj: Any, fields: tuple[str, ...]) -> tuple[str, Any, dict[str, Any]]:
    """(kind, prompt or messages, sampling values) of one line; _Bad when it is not valid."""
    if not isinstance(obj, dict):
        raise _Bad("line", f"expected a JSON object, got {_show(obj)}")
    if obj.get("method") != "POST":
        raise _Bad("method", f"expected POST, got {_show(obj.get('method'))}")
    url = obj.get("url")
    if url not in (CHAT, COMPLETIONS):
        raise _Bad("url", f"expected {CHAT} or {COMPLETIONS}, got {_show(url)}")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise _Bad("body", f"expected a JSON object, got {_show(body)}")
    for key, neutral in _IGNORED.items():
        if key in body and neutral is not None and body[key] not in (neutral, None):
            raise _Bad(f"body.{key}", f"only {_show(neutral)} is supported, got {_show(body[key])}")
    unknown = sorted(set(body) - _HANDLED - set(_IGNORED))
    if unknown:
        raise _Bad(f"body.{unknown[0]}", "not supported by batchllm")
    chat = url == CHAT
    text = _messages(body) if chat else _prompt(body)
    values = _sampling(body, chat)
    for name, neutral in _NEUTRAL.items():  # hooks: used once the sampling field exists
        if name not in fields and values[name] not in (None, neutral):
            where = {"n": "body.n", "logprobs": "body.logprobs",
                     "json_schema": "body.response_format"}[name]
            raise _Bad(where, f"sampling.{name} is not supported by this batchllm yet")
    return ("chat" if chat else "completion"), text, values


def _unique_id(wanted: Any, taken: set[str], line: int) -> tuple[str, str | None]:
    """(the row's id, or why the line's custom_id cannot be it)."""
    if isinstance(wanted, str) and SURROGATE.search(wanted):
        wanted = None  # not text: the line's error says so
    if isinstance(wanted, str) and wanted and wanted not in taken:
        return wanted, None
    why = ("custom_id: expected a non-empty string" if not isinstance(wanted, str) or not wanted
           else f"custom_id: {wanted!r} is used by an earlier line")
    name, k = f"line-{line}", 1
    while name in taken:
        name, k = f"line-{line}-{k}", k + 1
    return name, why


def parse_batch(files: list[tuple[str, Iterable[bytes | str]]],
                fields: tuple[str, ...]) -> BatchRequests:
    """The requests of batch files, given as (name, lines) in order: blank lines are skipped
    but counted for the line numbers (which errors name, with the file's name when there are
    several files). fields: the sampling fields this batchllm has (SAMPLING_FIELDS)."""
    out = BatchRequests()
    values: list[dict[str, Any]] = []
    taken: set[str] = set()
    for name, lines in files:
        where = f"{name} line" if len(files) > 1 else "line"
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            kind, text, sampling = None, None, {}
            obj, why = load(line)
            wanted = obj.get("custom_id") if isinstance(obj, dict) else None
            row_id, id_problem = _unique_id(wanted, taken, number)
            taken.add(row_id)
            if why is None:
                try:
                    kind, text, sampling = _request(obj, fields)
                except _Bad as e:
                    why = str(e)
                except Exception as e:  # noqa: BLE001 - the line's guard: whatever the checks
                    # above miss is this row's error, never the job's
                    why = f"{type(e).__name__}: {e}"
            why = why or id_problem
            if why is not None:
                out.errors[len(out.ids)] = f"{where} {number}: {why}"
            out.ids.append(row_id)
            out.prompts.append(text if why is None and kind == "completion" else None)
            out.messages.append(text if why is None and kind == "chat" else None)
            values.append(sampling if why is None else {})
    for name in fields:
        column = [v.get(name) for v in values]
        if any(c is not None for c in column):
            out.overrides[name] = column
    return out
