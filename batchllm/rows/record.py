"""One record per row, from reading to writing: what the row asks, then what it got.

A Row is made when the input is read and tokenized (rows/build.py), checked by `admit`
(rows/admission.py), planned (plan/rows_plan.py), run by the engine, which fills in its result,
and written as one line of a checkpoint part (rows/writer.py). A row that cannot run carries its
reason in `error` and is written like any other: errors are data, never exceptions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from batchllm.sampling_params import SamplingParams

ERROR = "error"  # the finish_reason of a row that failed


@dataclass(eq=False, slots=True)
class Row:
    """An input row and, once it finished, its completion.

    index: the row's position over all input files (its identity in checkpoints and the order
    of the final file); id: the value of the input id column (the row index when there is none),
    which also keys the row's random generator.
    """

    index: int
    id: object
    prompt_ids: np.ndarray | None  # [P] int32; None when the row failed before tokenization
    sampling: SamplingParams
    prompt: str | None = None  # the rendered prompt text (written when output.include_prompt)
    error: str | None = None  # why the row cannot run or failed, in words a user can act on
    # The result, filled in by the engine when the row finishes.
    token_ids: list[int] = field(default_factory=list)
    completion: str | None = None
    finish_reason: str | None = None
    cached_tokens: int = 0  # prompt tokens taken from a shared prefix instead of computed

    def __post_init__(self) -> None:
        if self.error is not None:
            self.finish_reason = ERROR

    @property
    def prompt_tokens(self) -> int:
        return 0 if self.prompt_ids is None else len(self.prompt_ids)

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

    def finish(self, token_ids: list[int], text: str, reason: str, cached_tokens: int) -> None:
        """The engine's result: the generated ids, their text, stop or length."""
        self.token_ids = token_ids
        self.completion = text
        self.finish_reason = reason
        self.cached_tokens = cached_tokens
