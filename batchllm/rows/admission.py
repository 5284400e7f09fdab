"""Which rows can run: the one admission rule of a job, used by the run, `batchllm plan` and both
sharding modes, so that what is predicted and what runs are the same rows.

A row's max_tokens is capped at what the model leaves after its prompt (max_model_len minus the
prompt's tokens), as vLLM does: the row would stop there anyway, with finish_reason `length`,
and the plan then counts the tokens the row can really generate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np

from batchllm.rows.record import Row
from batchllm.rows.table import RowTable
from batchllm.sampling_params import SamplingParams


def problem(row: Row, max_model_len: int) -> str | None:
    """Why a row cannot run, in words a user can act on; None when it can."""
    return problem_of(row.error, row.sampling, row.prompt_tokens, max_model_len)


def problem_of(error: str | None, sampling: SamplingParams, prompt_tokens: int,
               max_model_len: int, sampling_problem: str | None = None) -> str | None:
    """`problem` from a row's parts (sampling_problem: sampling.problem(), when known)."""
    if error is not None:
        return error
    why = sampling_problem if sampling_problem is not None else sampling.problem()
    if why:
        return why
    n = prompt_tokens
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


def _sampling_problem(sampling: SamplingParams) -> str:
    """sampling.problem(), "" for none, the exception's message if it raises (the guard)."""
    try:
        return sampling.problem() or ""
    except Exception as e:  # noqa: BLE001 - the guard of the rows with these settings
        return f"{type(e).__name__}: {e}"


def admit_table(table: RowTable, max_model_len: int) -> tuple[RowTable, list[Row]]:
    """`admit` over a RowTable: (the rows that can run, as a table, their max_tokens capped;
    the others as failed Rows, in order). The same rule, each distinct setting checked once;
    only the rows the rule may touch (an error, a setting's problem, an empty or too long
    prompt, a max_tokens past the model's room) go through it one by one, the others are kept
    as they are, with no Python object made for them. The table itself when every row is
    kept (no copy of its arrays)."""
    checked = [_sampling_problem(s) for s in table.settings]
    lengths = table.prompt_tokens()  # [N] int64
    odd, limit = np.zeros(len(checked), bool), np.zeros(len(checked), np.int64)
    for k, (s, why) in enumerate(zip(table.settings, checked)):
        mt = s.max_tokens
        odd[k] = bool(why) or not isinstance(mt, int) or not 0 <= mt < 1 << 62
        limit[k] = 0 if odd[k] else mt
    touch = (odd[table.setting] | (lengths == 0) | (lengths >= max_model_len)
             | (limit[table.setting] > max_model_len - lengths))
    if table.errors:
        touch[list(table.errors)] = True
    capped: dict[tuple[int, int], int] = {}  # (setting, room) -> the capped setting's position
    drop, failed = [], []
    for k in np.flatnonzero(touch).tolist():
        s, n = int(table.setting[k]), int(lengths[k])
        sampling = table.settings[s]
        try:
            why = problem_of(table.errors.get(k), sampling, n, max_model_len, checked[s])
            room = max_model_len - n
            if why is None and sampling.max_tokens > room:
                if (s, room) not in capped:
                    capped[s, room] = len(table.settings)
                    table.settings.append(dataclasses.replace(sampling, max_tokens=room))
                table.setting[k] = capped[s, room]
        except Exception as e:  # noqa: BLE001 - the guard of one row
            why = f"{type(e).__name__}: {e}"
        if why is not None:
            row = table[k]
            row.fail(why)
            failed.append(row)
            drop.append(k)
    if not drop:
        return table, failed
    keep = np.ones(len(table), bool)
    keep[drop] = False
    return table.taken(np.flatnonzero(keep)), failed
