"""Input rows -> Row records: the prompt rendered and tokenized, sampling with per-row overrides.

A row that cannot run (a null prompt, bad messages, a per-row value out of range) is kept with
the reason, so that it becomes an error row and the job goes on. Each row is guarded: whatever
its text, template, tokenizer or settings raise is that row's error, never the job's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from batchllm.config import InputConfig, SamplingConfig
from batchllm.rows.prompts import conversation, render_chats, tokenize
from batchllm.rows.reader import InputRows
from batchllm.rows.record import Row
from batchllm.rows.table import RowTable
from batchllm.sampling_params import CONSTRAINTS, SamplingParams

_BATCH = 1024  # conversations rendered, or texts tokenized, per call


def row_sampling(defaults: SamplingConfig, overrides: dict[str, list], i: int) -> SamplingParams:
    """The job's sampling settings, with row i's values from same-named input columns.

    A row's own structured output (a non-null json_schema, regex or choice cell) replaces the
    job's, whichever kind that is; two given in one row make it an error row."""
    values = dataclasses.asdict(defaults)
    if any(name in overrides and overrides[name][i] is not None for name in CONSTRAINTS):
        values.update(dict.fromkeys(CONSTRAINTS))
    for name, column in overrides.items():
        if column[i] is not None:
            values[name] = column[i]
    values["stop"] = tuple(values["stop"] or ())
    return SamplingParams(**values)


def _texts(cfg: InputConfig, rows: InputRows) -> tuple[dict, dict, dict]:
    """Per row position: plain prompt text, a conversation to render, or why it cannot run."""
    errors: dict[int, str] = {}
    convs: dict[int, list[dict]] = {}
    plain: dict[int, str] = {}
    for i in range(rows.num_rows):
        if i in rows.errors:  # found invalid when read (an OpenAI Batch line, a bad cell)
            errors[i] = rows.errors[i]
            continue
        try:
            _text(cfg, rows, i, plain, convs, errors)
        except Exception as e:  # noqa: BLE001 - the guard of one row
            errors[i] = f"input: {type(e).__name__}: {e}"
    return plain, convs, errors


def _text(cfg: InputConfig, rows: InputRows, i: int, plain: dict, convs: dict,
          errors: dict) -> None:
    if rows.messages is not None and (rows.prompts is None or rows.messages[i] is not None):
        msgs = rows.messages[i]
        if not msgs:
            errors[i] = f"input.{cfg.messages_column}: the messages are null or empty"
            return
        if cfg.system_prompt and msgs[0].get("role") != "system":
            msgs = [{"role": "system", "content": cfg.system_prompt}] + msgs
        convs[i] = msgs
        return
    prompt = rows.prompts[i]
    if prompt is None:
        errors[i] = f"input.{cfg.prompt_column}: the prompt is null"
    elif not prompt.strip():
        errors[i] = f"input.{cfg.prompt_column}: the prompt is empty"
    elif cfg.chat_template and not rows.prompts_as_is:
        convs[i] = conversation(prompt, cfg.system_prompt)
    else:
        plain[i] = prompt


def _batched(fn: Callable[[list], list], items: dict[int, object], errors: dict[int, str],
             what: str) -> dict[int, object]:
    """fn over the items, _BATCH at a time; a batch it fails on is done again row by row, and a
    row it fails on gets `what` and the exception's message as its error."""
    out: dict[int, object] = {}
    order = list(items)
    for lo in range(0, len(order), _BATCH):
        chunk = order[lo : lo + _BATCH]
        try:
            results = fn([items[i] for i in chunk])
        except Exception:  # noqa: BLE001 - one bad row: find it row by row
            results = []
            for i in chunk:
                try:
                    results += fn([items[i]])
                except Exception as e:  # noqa: BLE001 - templates and tokenizers raise anything
                    errors[i] = f"{what}: {e}"
                    results.append(None)
        out.update((i, r) for i, r in zip(chunk, results) if r is not None)
    return out


def build_rows(tokenizer, cfg: InputConfig, sampling: SamplingConfig, rows: InputRows,
               first_index: int = 0, keep_prompt: bool = True) -> list[Row]:
    """One Row per input row, in order (build_table's rows as Row objects)."""
    return list(build_table(tokenizer, cfg, sampling, rows, first_index, keep_prompt))


def build_table(tokenizer, cfg: InputConfig, sampling: SamplingConfig, rows: InputRows,
                first_index: int = 0, keep_prompt: bool = True) -> RowTable:
    """The input rows as a RowTable, in order; rows[i] gets index first_index + i (a block of a
    larger input starts past 0). keep_prompt: keep the rendered text (output.include_prompt)."""
    plain, convs, errors = _texts(cfg, rows)
    rendered = _batched(lambda c: render_chats(tokenizer, c), convs, errors,
                        "input: the chat template failed on this row")
    text = {**plain, **rendered}
    # special tokens (BOS) are added to plain prompts; a chat template writes its own
    failed = "input: the tokenizer failed on this row"
    ids = {**_batched(lambda t: tokenize(tokenizer, t, True), plain, errors, failed),
           **_batched(lambda t: tokenize(tokenizer, t, False), rendered, errors, failed)}
    n = rows.num_rows
    lengths = np.fromiter((len(ids[i]) if i in ids else -1 for i in range(n)), np.int32, n)
    tokens = np.concatenate([ids[i] for i in range(n) if i in ids] or [np.zeros(0, np.int32)])
    ids.clear()
    settings: list[SamplingParams] = []
    setting = np.zeros(n, np.int32)
    distinct: dict[tuple, int] = {}  # rows with the same settings share one object
    columns = list(rows.overrides.values())
    for i in range(n):
        try:
            # (type, value): 1, 1.0 and True stay apart
            cells: tuple | None = tuple((type(c[i]), c[i]) for c in columns)
            try:
                k = distinct.get(cells)
            except TypeError:  # an unhashable cell (a json_schema object): its own settings
                cells = k = None
            if k is None:
                k = len(settings)
                settings.append(row_sampling(sampling, rows.overrides, i))
                if cells is not None:
                    distinct[cells] = k
        except Exception as e:  # noqa: BLE001 - the guard of one row
            k = len(settings)
            settings.append(SamplingParams())
            errors.setdefault(i, f"sampling override: {e}")
        setting[i] = k
    starts = np.concatenate(([0], np.cumsum(np.maximum(lengths, 0))[:-1])).astype(np.int64)
    return RowTable(tokens, starts[:n], lengths, first_index + np.arange(n, dtype=np.int64),
                    np.zeros(n, np.int32), setting, settings, rows.ids, errors,
                    [text.get(i) for i in range(n)] if keep_prompt else None)
