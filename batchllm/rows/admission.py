"""Which rows can run: the one admission rule of a job, used by the run, `batchllm plan` and both
sharding modes, so that what is predicted and what runs are the same rows.

A row's max_tokens is capped at what the model leaves after its prompt (max_model_len minus the
prompt's tokens), as vLLM does: the row would stop there anyway, with finish_reason `length`,
and the plan then counts the tokens the row can really generate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from batchllm.rows.record import Row


def problem(row: Row, max_model_len: int) -> str | None:
    """Why a row cannot run, in words a user can act on; None when it can."""
    if row.error is not None:
        return row.error
    sampling = row.sampling.problem()
    if sampling:
        return sampling
    n = row.prompt_tokens
    if n == 0:
        return "the prompt is empty (0 tokens)"
    if n >= max_model_len:
        return (f"the prompt has {n} tokens; the model allows {max_model_len} in all "
                f"(prompt and completion): shorten it or raise model.max_model_len")
    return None


def admit(rows: Iterable[Row], max_model_len: int) -> list[Row]:
    """The rows that can run, in their order, their max_tokens capped at the model's room;
    every other row is failed with its reason. The row's guard: whatever a check raises is
    that row's error (with the exception's message), never the job's."""
    admitted = []
    for row in rows:
        try:
            why = problem(row, max_model_len)
            room = max_model_len - row.prompt_tokens
            if why is None and row.sampling.max_tokens > room:
                row.sampling = dataclasses.replace(row.sampling, max_tokens=room)
        except Exception as e:  # noqa: BLE001 - the guard of one row
            why = f"{type(e).__name__}: {e}"
        if why is None:
            admitted.append(row)
        else:
            row.fail(why)
    return admitted
