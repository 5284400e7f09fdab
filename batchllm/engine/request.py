"""A unit of work in the engine: a row's request or a shared prefix computed once.

A sequence is two counters: `computed` tokens (KV in the cache) and `total` tokens (known ids).
Prefill, chunked prefill, a prefix hit and decoding are all "run total - computed tokens".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from batchllm.sampling_params import SamplingParams


class Kind(Enum):
    ROW = "row"  # an input row: prefill its own part, then decode
    PREFIX = "prefix"  # a shared prefix node: prefill only, its pages outlive it


@dataclass(eq=False)  # compared by identity: `running.remove` must not compare fields
class Request:
    kind: Kind
    key: int  # row index for rows, node id for prefixes
    token_ids: list[int]  # prompt (for a prefix: its tokens), then generated tokens
    num_prompt_tokens: int
    parent: int = -1  # prefix node whose pages this sequence borrows; -1: none
    sampling: SamplingParams | None = None
    rng_key: int = 0  # per-sample generator key, from the job seed, the row id and the sample
    matcher: object | None = None  # structured output: the row's llguidance matcher
    logprobs: list | None = None  # per generated token (StepLogprobs, index), when asked for
    slot: int = 0  # its settings and counters in the engine's RowSlots (0: a shared prefix)
    computed: int = 0
    pages: list[int] = field(default_factory=list)
    num_borrowed_pages: int = 0  # leading pages shared from the parent (not written by us)
    cached_tokens: int = 0  # prompt tokens taken from a shared prefix instead of computed
    wants_logits: bool = False  # a prefix whose last position's logits rows will sample from
    finish_reason: str | None = None
    finished: bool = False  # its result is out: a token sampled for it since is discarded
    text: str | None = None
    scan: object | None = None  # the stop checker's incremental decode of its output (rows with stop strings)

    @property
    def total(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]
