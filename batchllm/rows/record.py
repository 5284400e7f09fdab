"""One record per row, from reading to writing: what the row asks, then what it got.

A Row is made when the input is read and tokenized (rows/build.py), checked by `admit`
(rows/admission.py), planned (plan/rows_plan.py), run by the engine, which fills in its result,
and written as one line of a checkpoint part (rows/writer.py). A row that cannot run carries its
reason in `error` and is written like any other: errors are data, never exceptions.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from batchllm.sampling_params import MAX_N, SamplingParams

ERROR = "error"  # the finish_reason of a row that failed


class TokenLogprob(NamedTuple):
    """One generated token's log-probability and the top-k alternatives (best first), under the
    distribution it was drawn from: the logits over the temperature (1 when greedy), after the
    structured-output mask, before top-k/top-p (engine/sampler.py `token_logprobs`)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # [(token_id, logprob)] * k


class TokenLogprobs:
    """A row's log-probabilities as the engine keeps them: arrays, one entry per generated
    token, read as a sequence of TokenLogprob (made on access) and written to Arrow from the
    arrays (rows/writer.py `logprobs_column`). Alternatives at -inf (forbidden by a grammar's
    mask) are no alternatives: left out of `top`."""

    __slots__ = ("logprob", "token_id", "top_id", "top_lp")

    def __init__(self, token_id: np.ndarray, logprob: np.ndarray, top_id: np.ndarray,
                 top_lp: np.ndarray) -> None:
        self.token_id = token_id  # [G] int
        self.logprob = logprob  # [G] float32
        self.top_id = top_id  # [G, k] int, best first
        self.top_lp = top_lp  # [G, k] float32

    def __len__(self) -> int:
        return len(self.token_id)

    def __getitem__(self, i: int) -> TokenLogprob:
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        keep = self.top_lp[i] != -np.inf
        top = list(zip(self.top_id[i][keep].tolist(), self.top_lp[i][keep].tolist()))
        return TokenLogprob(int(self.token_id[i]), float(self.logprob[i]), top)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (TokenLogprobs, list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __repr__(self) -> str:
        return f"TokenLogprobs({list(self)!r})"


def num_samples(sampling: SamplingParams) -> int:
    """A row's records: sampling.n when it is valid, else 1 (the row is then an error row: one
    record)."""
    n = sampling.n
    return n if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_N else 1


@dataclass(eq=False, slots=True)
class Row:
    """An input row and, once it finished, its completion.

    index: the row's position over all input files (its identity in checkpoints and the order
    of the final file); id: the value of the input id column (the row index when there is none),
    which also keys the row's random generator.

    sample: which of the input row's sampling.n completions this record is (0..n-1); the run
    makes one record per sample (`samples`), and (index, sample) identifies it in checkpoints.
    """

    index: int
    id: object
    prompt_ids: np.ndarray | None  # [P] int32 or uint16; None: failed before tokenization
    sampling: SamplingParams
    prompt: str | None = None  # the rendered prompt text (written when output.include_prompt)
    error: str | None = None  # why the row cannot run or failed, in words a user can act on
    sample: int = 0
    # The result, filled in by the engine when the row finishes.
    token_ids: list[int] = field(default_factory=list)
    completion: str | None = None
    finish_reason: str | None = None
    cached_tokens: int = 0  # prompt tokens taken from a shared prefix instead of computed
    logprobs: TokenLogprobs | list[TokenLogprob] | None = None  # one per token id, when
    # sampling.logprobs > 0

    def __post_init__(self) -> None:
        if self.error is not None:
            self.finish_reason = ERROR

    @property
    def prompt_tokens(self) -> int:
        return 0 if self.prompt_ids is None else len(self.prompt_ids)

    @property
    def key(self) -> tuple[int, int]:
        """(index, sample): the record's identity in checkpoints and the final file's order."""
        return self.index, self.sample

    def listed_in(self, keys: Collection[int | tuple[int, int]]) -> bool:
        """Whether `keys` (rows done by an earlier run) name this record: its index (every sample
        of the row is done) or its (index, sample)."""
        return self.index in keys or (self.index, self.sample) in keys

    @property
    def num_samples(self) -> int:
        return num_samples(self.sampling)

    @property
    def wants_logprobs(self) -> bool:
        k = self.sampling.logprobs
        return isinstance(k, int) and not isinstance(k, bool) and k > 0

    def samples(self) -> list[Row]:
        """This record as sample 0 and one fresh copy per further sample (n - 1 of them)."""
        return [self] + [
            Row(self.index, self.id, self.prompt_ids, self.sampling, self.prompt, self.error, s)
            for s in range(1, self.num_samples)
        ]

    @property
    def ok(self) -> bool:
        """No error so far (the row can run, or ran fine)."""
        return self.error is None

    def fail(self, why: str) -> None:
        """The row cannot run: it is finished, with no completion and `why` as its error."""
        self.error = why
        self.finish_reason = ERROR
        self.completion = None
        self.token_ids = []
        self.cached_tokens = 0
        self.logprobs = [] if self.wants_logprobs else None

    def release(self) -> None:
        """The row is written (its part holds it): its token ids, text, log-probabilities and
        prompt text go, so that a finished row holds no more memory than a waiting one (what
        the run's metrics count, its prompt and cached tokens, stays)."""
        self.token_ids = []
        self.completion = None
        self.logprobs = None
        self.prompt = None

    def finish(self, token_ids: list[int], text: str, reason: str, cached_tokens: int,
               logprobs: TokenLogprobs | list[TokenLogprob] | None = None) -> None:
        """The engine's result: the generated ids, their text, stop or length, and the tokens'
        log-probabilities when asked for."""
        self.token_ids = token_ids
        self.completion = text
        self.finish_reason = reason
        self.cached_tokens = cached_tokens
        self.logprobs = logprobs
