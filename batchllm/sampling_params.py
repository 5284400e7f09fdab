"""Per-request sampling settings, as vLLM users know them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. temperature 0 is greedy; top_k 0 and top_p 1 disable them."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop or ()))

    def problem(self) -> str | None:
        """Why these settings cannot run, in words a user can act on; None when fine."""
        def bad_number(x: object) -> bool:
            return isinstance(x, bool) or not isinstance(x, (int, float)) or math.isnan(x)

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            return f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"
        if self.max_tokens < 1:
            return f"max_tokens must be >= 1, got {self.max_tokens}"
        if bad_number(self.temperature) or self.temperature < 0:
            return f"temperature must be a number >= 0, got {self.temperature!r}"
        if bad_number(self.top_p) or not 0 < self.top_p <= 1:
            return f"top_p must be in (0, 1], got {self.top_p!r}"
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            return f"top_k must be an integer >= 0, got {self.top_k!r}"
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            return f"seed must be an integer, got {self.seed!r}"
        if not all(isinstance(s, str) and s for s in self.stop):
            return f"stop must be a list of non-empty strings, got {list(self.stop)!r}"
        return None
