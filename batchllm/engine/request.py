"""A unit of work in the engine: a row's request or a shared prefix computed once.

A sequence is two counters: `computed` tokens (KV in the cache) and `total` tokens (known ids).
Prefill, chunked prefill, a prefix hit and decoding are all "run total - computed tokens".
The counters, the generated ids and the page ids live in the engine's RowSlots at the request's
slot (row_slots.py), so that a step reads them for all its sequences at once; a Request made
alone (tests) takes a slot of its own.
"""

from __future__ import annotations

from enum import Enum

from batchllm.engine.row_slots import RowSlots
from batchllm.sampling_params import SamplingParams


class Kind(Enum):
    ROW = "row"  # an input row: prefill its own part, then decode
    PREFIX = "prefix"  # a shared prefix node: prefill only, its pages outlive it


class Request:
    """Compared by identity. Its page ids are its slot's `table` row (`pages`: a list copy),
    written by `set_pages` / `add_pages`."""

    __slots__ = ("cached_tokens", "finish_reason", "key", "kind", "matcher",
                 "num_prompt_tokens", "parent", "prompt", "rng_key", "sampling", "scan",
                 "slot", "state", "text", "wants_logits")

    def __init__(self, kind: Kind, key: int, prompt: list[int], num_prompt_tokens: int,
                 parent: int = -1, sampling: SamplingParams | None = None, rng_key: int = 0,
                 matcher: object | None = None, wants_logits: bool = False, greedy: bool = False,
                 state: RowSlots | None = None) -> None:
        """prompt: the prompt's ids (a prefix: its tokens); greedy: RowSlots.greedy."""
        self.kind = kind
        self.key = key  # row index for rows, node id for prefixes
        self.prompt = prompt
        self.num_prompt_tokens = num_prompt_tokens
        self.parent = parent  # prefix node whose pages this sequence borrows; -1: none
        self.sampling = sampling
        self.rng_key = rng_key  # per-sample generator key, from the job seed, row id, sample
        self.matcher = matcher  # structured output: the row's llguidance matcher
        self.wants_logits = wants_logits  # a prefix whose last logits rows will sample from
        self.cached_tokens = 0  # prompt tokens taken from a shared prefix instead of computed
        self.finish_reason: str | None = None
        self.text: str | None = None
        self.scan: object | None = None  # the stop checker's incremental decode (stop strings)
        self.state = state if state is not None else RowSlots(1)
        row = kind is Kind.ROW
        self.slot = self.state.take(
            num_prompt_tokens, (sampling or SamplingParams()) if row else None, rng_key,
            matcher is not None, greedy, row or wants_logits, self)

    @property
    def computed(self) -> int:
        return int(self.state.computed[self.slot])

    @computed.setter
    def computed(self, value: int) -> None:
        self.state.computed[self.slot] = value

    @property
    def num_borrowed_pages(self) -> int:
        """Leading pages shared from the parent (not written by this sequence)."""
        return int(self.state.borrowed[self.slot])

    @num_borrowed_pages.setter
    def num_borrowed_pages(self, value: int) -> None:
        self.state.borrowed[self.slot] = value

    @property
    def total(self) -> int:
        return int(self.state.total[self.slot])

    @property
    def num_generated(self) -> int:
        """Generated ids held (the last one may be a placeholder not read yet)."""
        return self.total - self.num_prompt_tokens

    def output(self, lo: int = 0, hi: int | None = None) -> list[int]:
        """Generated ids lo..hi-1 (hi: all held)."""
        hi = self.num_generated if hi is None else hi
        return self.state.out[self.slot, lo:hi].tolist()

    @property
    def output_ids(self) -> list[int]:
        return self.output()

    @property
    def last_token(self) -> int:
        g = self.num_generated
        return int(self.state.out[self.slot, g - 1]) if g else int(self.prompt[-1])

    def append(self, token: int) -> None:
        """One more generated id (< 0: a placeholder until read)."""
        st, s = self.state, self.slot
        g = self.num_generated
        st.widen_out(g + 1)
        st.out[s, g] = token
        st.total[s] += 1

    @property
    def pages(self) -> list[int]:
        """Its page ids (a copy)."""
        st = self.state
        return st.table[self.slot, : st.num_pages[self.slot]].tolist()

    @property
    def num_pages(self) -> int:
        return int(self.state.num_pages[self.slot])

    def set_pages(self, pages: list[int]) -> None:
        """Its pages replaced (a reset, or a borrowed prefix's pages)."""
        st = self.state
        st.renewed[self.slot] = True
        st.widen("table", len(pages))
        st.table[self.slot, : len(pages)] = pages
        st.table[self.slot, len(pages) :] = 0
        st.num_pages[self.slot] = len(pages)

    def add_pages(self, pages: list[int]) -> None:
        st, s = self.state, self.slot
        n = int(st.num_pages[s])
        st.widen("table", n + len(pages))
        st.table[s, n : n + len(pages)] = pages
        st.num_pages[s] = n + len(pages)
