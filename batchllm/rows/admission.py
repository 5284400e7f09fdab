"""Which rows can run: the one admission rule of a job, used by the run, `batchllm plan` and both
sharding modes, so that what is predicted and what runs are the same rows."""

from __future__ import annotations

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
    """The rows that can run, in their order; every other row is failed with its reason."""
    admitted = []
    for row in rows:
        why = problem(row, max_model_len)
        if why is None:
            admitted.append(row)
        else:
            row.fail(why)
    return admitted
