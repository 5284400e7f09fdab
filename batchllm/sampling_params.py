"""Per-request sampling settings, as vLLM users know them."""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from typing import Any

MAX_N = 128  # samples per row, OpenAI's limit: a typo must not multiply a job by millions
MAX_LOGPROBS = 20  # top alternatives per token, OpenAI's and the job file's limit
CONSTRAINTS = ("json_schema", "regex", "choice")  # structured output: one of them per row


def canonical_json(value: Any) -> str:
    """A JSON value as one text: the cache key of a compiled schema. Keys keep their order:
    a schema's property order is the order the fields are generated in."""
    return json.dumps(value, ensure_ascii=False)


def _maybe_json(value: Any) -> Any:
    """A JSON text parsed (a per-row column holds JSON strings); anything else as it is."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _schema_text_problem(text: object) -> str | None:
    if not isinstance(text, str):
        return f"json_schema must be a JSON schema (an object), got {text!r:.80}"
    return _schema_json_problem(text)


@functools.lru_cache(maxsize=1024)  # a job's rows mostly share a few schemas
def _schema_json_problem(text: str) -> str | None:
    try:
        schema = json.loads(text)
    except ValueError as e:
        return f"json_schema is not valid JSON ({e}): {text!r:.80}"
    if not isinstance(schema, (dict, bool)):
        return f"json_schema must be a JSON object, got {text!r:.80}"
    return None


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. temperature 0 is greedy; top_k 0 and top_p 1 disable them.

    n: completions per prompt, each with its own generator (seed, prompt id, sample index);
    logprobs: k > 0 returns each generated token's log-probability and its top-k alternatives.
    Structured output, at most one of: json_schema (a dict, or its JSON text), regex, choice (a
    list of strings); the completion then matches it when it finishes with `stop`.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    n: int = 1
    logprobs: int = 0
    json_schema: str | None = None  # canonical JSON text (a dict given is stored so)
    regex: str | None = None
    choice: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        if isinstance(self.json_schema, (dict, bool)):  # JSON text is kept as it is: parsing it
            # for every row of a job would cost more than a second compile of a respelled schema
            object.__setattr__(self, "json_schema", canonical_json(self.json_schema))
        choice = _maybe_json(self.choice)
        if isinstance(choice, list):
            object.__setattr__(self, "choice", tuple(choice))

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(kind, spec) of the structured output, hashable (the compile cache's key); None if
        unconstrained. kind is one of CONSTRAINTS; a choice's spec is its JSON list."""
        if self.json_schema is not None:
            return "json_schema", self.json_schema
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", canonical_json(list(self.choice))
        return None

    def problem(self) -> str | None:
        """Why these settings cannot run, in words a user can act on; None when fine."""
        def bad_number(x: object) -> bool:
            return isinstance(x, bool) or not isinstance(x, (int, float)) or math.isnan(x)

        def bad_int(x: object) -> bool:
            return isinstance(x, bool) or not isinstance(x, int)

        if bad_int(self.max_tokens):
            return f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"
        if self.max_tokens < 1:
            return f"max_tokens must be >= 1, got {self.max_tokens}"
        if bad_number(self.temperature) or self.temperature < 0:
            return f"temperature must be a number >= 0, got {self.temperature!r}"
        if bad_number(self.top_p) or not 0 < self.top_p <= 1:
            return f"top_p must be in (0, 1], got {self.top_p!r}"
        if bad_int(self.top_k) or self.top_k < 0:
            return f"top_k must be an integer >= 0, got {self.top_k!r}"
        if bad_int(self.seed):
            return f"seed must be an integer, got {self.seed!r}"
        if not all(isinstance(s, str) and s for s in self.stop):
            return f"stop must be a list of non-empty strings, got {list(self.stop)!r}"
        if bad_int(self.n) or not 1 <= self.n <= MAX_N:
            return f"n must be an integer in 1..{MAX_N}, got {self.n!r}"
        if bad_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS:
            return f"logprobs must be an integer in 0..{MAX_LOGPROBS}, got {self.logprobs!r}"
        return self._constraint_problem()

    def _constraint_problem(self) -> str | None:
        given = [name for name in CONSTRAINTS if getattr(self, name) is not None]
        if len(given) > 1:
            return (f"{' and '.join(given)} are both set: a row takes at most one of "
                    f"json_schema, regex and choice")
        if self.json_schema is not None:
            why = _schema_text_problem(self.json_schema)
            if why:
                return why
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            return f"regex must be a non-empty string, got {self.regex!r:.80}"
        if self.choice is not None:
            c = self.choice
            if not isinstance(c, tuple) or not c or not all(isinstance(s, str) and s for s in c):
                return f"choice must be a non-empty list of non-empty strings, got {c!r:.80}"
        return None
