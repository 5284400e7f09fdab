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
from batchllm.rows.table import RowTable, ints_for, row_starts
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


def _texts(cfg: InputConfig, rows: InputRows, positions: range,
           errors: dict[int, str]) -> tuple[dict, dict]:
    """Per row position of `positions`: plain prompt text, or a conversation to render; a row
    that cannot run gets its reason in `errors`."""
    convs: dict[int, list[dict]] = {}
    plain: dict[int, str] = {}
    for i in positions:
        if i in rows.errors:  # found invalid when read (an OpenAI Batch line, a bad cell)
            errors[i] = rows.errors[i]
            continue
        try:
            _text(cfg, rows, i, plain, convs, errors)
        except Exception as e:  # noqa: BLE001 - the guard of one row
            errors[i] = f"input: {type(e).__name__}: {e}"
    return plain, convs


def _text(cfg: InputConfig, rows: InputRows, i: int, plain: dict, convs: dict,
          errors: dict) -> None:
    if rows.messages is not None and (rows.prompts is None or rows.messages[i] is not None):
        msgs = rows.messages[i]
        if msgs and (null := _null_message_field(msgs)) is not None:  # Parquet's structs
            errors[i] = f"input.messages_column: {null} is null"
            return
        msgs = [m for m in msgs or () if m is not None]  # a null message is left out
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


def _null_message_field(msgs: list[dict | None]) -> str | None:
    """The first messages[j].role or messages[j].content that is null (j counting the null
    messages, which are left out)."""
    for j, m in enumerate(msgs):
        for name in ("role", "content"):
            if m is not None and m.get(name) is None:
                return f"messages[{j}].{name}"
    return None


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
                first_index: int = 0, keep_prompt: bool = True,
                release_input: bool = False) -> RowTable:
    """The input rows as a RowTable, in order; rows[i] gets index first_index + i (a block of a
    larger input starts past 0). keep_prompt: keep the rendered text (output.include_prompt).
    Rendered and tokenized _BATCH rows at a time: what a block makes (texts, one array per row)
    is packed before the next, so that only the packed ids grow with the job. The ids are
    uint16 when every id is below 65,536 (SmolLM2's and Llama 2's vocabularies: 2 bytes a
    token, not 4), else int32. release_input: each block's input prompt texts are let go
    (rows.prompts[i] = None) once tokenized, so that the texts and the ids never all coexist
    (the caller reads them no more: the job)."""
    n = rows.num_rows
    errors: dict[int, str] = {}
    lengths = np.full(n, -1, np.int32)
    blocks: list[np.ndarray] = []  # each block's ids, packed
    kept: list[str | None] | None = [None] * n if keep_prompt else None
    for lo in range(0, n, _BATCH):
        positions = range(lo, min(n, lo + _BATCH))
        ids, texts = _tokenized(tokenizer, cfg, rows, positions, errors)
        for i, toks in ids.items():
            lengths[i] = len(toks)
        blocks.append(_narrow(np.concatenate([ids[i] for i in sorted(ids)]
                                             or [np.zeros(0, np.int32)])))
        if kept is not None:
            for i, text in texts.items():
                kept[i] = text
        if release_input and rows.prompts is not None:
            rows.prompts[lo : positions.stop] = [None] * len(positions)
    dtype = np.uint16 if all(b.dtype == np.uint16 for b in blocks) else np.int32
    tokens = np.empty(int(np.maximum(lengths, 0).sum()), dtype)
    at = 0
    while blocks:  # copied in and let go one at a time: one block beyond the result
        block = blocks.pop(0)
        tokens[at : at + len(block)] = block
        at += len(block)
    setting, settings = _settings(sampling, rows, errors)
    index = np.arange(first_index, first_index + n, dtype=ints_for(first_index + n))
    return RowTable(tokens, row_starts(lengths), lengths, index,
                    np.zeros(n, np.int32), setting, settings, rows.ids, errors, kept)


def _narrow(ids: np.ndarray) -> np.ndarray:
    """[L] int32 token ids as uint16 when they all fit (ids are >= 0), else as they are."""
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) > np.iinfo(np.uint16).max):
        return ids
    return ids.astype(np.uint16)


def _tokenized(tokenizer, cfg: InputConfig, rows: InputRows, positions: range,
               errors: dict[int, str]) -> tuple[dict[int, np.ndarray], dict[int, str]]:
    """The token ids ({position: [L] int32}) and the prompt texts of the rows at `positions`
    that can run; the others get their reason in `errors`."""
    plain, convs = _texts(cfg, rows, positions, errors)
    rendered = _batched(lambda c: render_chats(tokenizer, c), convs, errors,
                        "input: the chat template failed on this row")
    # special tokens (BOS) are added to plain prompts; a chat template writes its own
    failed = "input: the tokenizer failed on this row"
    ids = {**_batched(lambda t: tokenize(tokenizer, t, True), plain, errors, failed),
           **_batched(lambda t: tokenize(tokenizer, t, False), rendered, errors, failed)}
    return ids, {**plain, **rendered}


def _settings(sampling: SamplingConfig, rows: InputRows,
              errors: dict[int, str]) -> tuple[np.ndarray, list[SamplingParams]]:
    """Each row's settings ([N] int32 into the list of distinct SamplingParams): rows with the
    same override cells share one object; a row whose cells are invalid gets its reason."""
    n = rows.num_rows
    settings: list[SamplingParams] = []
    setting = np.zeros(n, np.int32)
    distinct: dict[tuple, int] = {}
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
    return setting, settings
