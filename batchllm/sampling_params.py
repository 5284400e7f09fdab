"""Per-request sampling settings, as vLLM users know them, and the limits a row must keep.

A row outside a limit is an error row whose error names the field and the limit; the job goes on.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from typing import Any

from batchllm.config.limits import MAX_DEPTH, stop_problem, too_deep, value_too_deep

MAX_N = 128  # samples per row, OpenAI's limit: a typo must not multiply a job by millions
MAX_LOGPROBS = 20  # top alternatives per token, OpenAI's and the job file's limit
MAX_TOKENS = 2**31 - 1  # int32, as the plan holds it; a row is stopped at the model's length
# limit (max_model_len, finish_reason "length") whatever it asks, as vLLM does
MAX_TOP_K = 2**31 - 1
SEEDS = (-(2**63), 2**64 - 1)  # int64 or uint64, as OpenAI's and numpy's seeds are
# A temperature below this is greedy, as in vLLM (its _SAMPLING_EPS): logits over 1e-50 are
# infinite in float32 (and 1e-50 itself is 0 there), which makes the probabilities NaN.
GREEDY_BELOW = 1e-5
CONSTRAINTS = ("json_schema", "regex", "choice")  # structured output: one of them per row


def finite(x: object) -> bool:
    """A real number (not a bool) that is finite; False for an integer too large for a float."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:  # a 400-digit integer
        return False


def canonical_json(value: Any) -> str:
    """A JSON value as one text: the cache key of a compiled schema. Keys keep their order:
    a schema's property order is the order the fields are generated in."""
    return json.dumps(value, ensure_ascii=False)


def _maybe_json(value: Any) -> Any:
    """A JSON text parsed (a per-row column holds JSON strings); anything else, or a text too
    deep to parse, as it is."""
    if isinstance(value, str) and too_deep(value) is None:
        try:
            return json.loads(value)
        except (ValueError, RecursionError):
            return value
    return value


def _schema_text_problem(text: object) -> str | None:
    if isinstance(text, (dict, list)):  # kept as given: too deep to be written as JSON
        return f"json_schema is nested more than {MAX_DEPTH} levels deep"
    if not isinstance(text, str):
        return f"json_schema must be a JSON schema (an object), got {text!r:.80}"
    return _schema_json_problem(text)


@functools.lru_cache(maxsize=1024)  # a job's rows mostly share a few schemas
def _schema_json_problem(text: str) -> str | None:
    deep = too_deep(text)
    if deep:
        return f"json_schema is {deep}"
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError) as e:
        return f"json_schema is not valid JSON ({e}): {text!r:.80}"
    if not isinstance(schema, (dict, bool)):
        return f"json_schema must be a JSON object, got {text!r:.80}"
    return None


def _int_in(x: object, lo: int, hi: int) -> bool:
    return not isinstance(x, bool) and isinstance(x, int) and lo <= x <= hi


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
    seed: int | None = 0  # None: the default, 0 (vLLM's engine seed: runs repeat)
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    n: int = 1
    logprobs: int = 0
    json_schema: str | None = None  # canonical JSON text (a dict given is stored so)
    regex: str | None = None
    choice: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.seed is None:
            object.__setattr__(self, "seed", 0)
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        if isinstance(self.json_schema, (dict, bool)) and not value_too_deep(self.json_schema):
            # JSON text is kept as it is: parsing it for every row of a job would cost more
            # than a second compile of a respelled schema
            object.__setattr__(self, "json_schema", canonical_json(self.json_schema))
        if finite(self.temperature) and 0 < self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)
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

    @property
    def max_tokens_ok(self) -> bool:
        return _int_in(self.max_tokens, 1, MAX_TOKENS)

    def problem(self) -> str | None:
        """Why these settings cannot run, in words a user can act on; None when fine."""
        if not self.max_tokens_ok:
            return f"max_tokens must be an integer in 1..{MAX_TOKENS}, got {self.max_tokens!r:.80}"
        if not finite(self.temperature) or self.temperature < 0:
            return f"temperature must be a finite number >= 0, got {self.temperature!r:.80}"
        if not finite(self.top_p) or not 0 < self.top_p <= 1:
            return f"top_p must be in (0, 1], got {self.top_p!r:.80}"
        if not _int_in(self.top_k, 0, MAX_TOP_K):
            return f"top_k must be an integer in 0..{MAX_TOP_K}, got {self.top_k!r:.80}"
        if not _int_in(self.seed, *SEEDS):
            return f"seed must be an integer in {SEEDS[0]}..{SEEDS[1]}, got {self.seed!r:.80}"
        return self._stop_problem() or self._count_problem() or self._constraint_problem()

    def _stop_problem(self) -> str | None:
        if not all(isinstance(s, str) and s for s in self.stop):
            return f"stop must be a list of non-empty strings, got {list(self.stop)!r:.80}"
        why = stop_problem(self.stop)
        return f"stop: {why}" if why else None

    def _count_problem(self) -> str | None:
        if not _int_in(self.n, 1, MAX_N):
            return f"n must be an integer in 1..{MAX_N}, got {self.n!r:.80}"
        if not _int_in(self.logprobs, 0, MAX_LOGPROBS):
            return f"logprobs must be an integer in 0..{MAX_LOGPROBS}, got {self.logprobs!r:.80}"
        return None

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
