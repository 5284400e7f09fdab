"""Input rows -> Row records: the prompt rendered and tokenized, sampling with per-row overrides.

A row that cannot run (a null prompt, bad messages, a per-row value out of range) is kept with
the reason, so that it becomes an error row and the job goes on.
"""

from __future__ import annotations

import dataclasses

from batchllm.config import InputConfig, SamplingConfig
from batchllm.rows.prompts import conversation, render_chats, tokenize
from batchllm.rows.reader import InputRows
from batchllm.rows.record import Row
from batchllm.sampling_params import CONSTRAINTS, SamplingParams

_RENDER_BATCH = 1024  # conversations rendered per call of the chat template


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
        if i in rows.errors:  # found invalid when read (an OpenAI Batch line)
            errors[i] = rows.errors[i]
            continue
        if rows.messages is not None and (rows.prompts is None or rows.messages[i] is not None):
            msgs = rows.messages[i]
            if not msgs:
                errors[i] = f"input.{cfg.messages_column}: the messages are null or empty"
                continue
            if cfg.system_prompt and msgs[0].get("role") != "system":
                msgs = [{"role": "system", "content": cfg.system_prompt}] + msgs
            convs[i] = msgs
            continue
        prompt = rows.prompts[i]
        if prompt is None:
            errors[i] = f"input.{cfg.prompt_column}: the prompt is null"
        elif not prompt.strip():
            errors[i] = f"input.{cfg.prompt_column}: the prompt is empty"
        elif cfg.chat_template and not rows.prompts_as_is:
            convs[i] = conversation(prompt, cfg.system_prompt)
        else:
            plain[i] = prompt
    return plain, convs, errors


def _render(tokenizer, convs: dict[int, list[dict]], errors: dict[int, str]) -> dict[int, str]:
    """Each conversation through the chat template; a row the template fails on gets an error."""
    text: dict[int, str] = {}
    order = list(convs)
    for lo in range(0, len(order), _RENDER_BATCH):
        chunk = order[lo : lo + _RENDER_BATCH]
        try:
            rendered = render_chats(tokenizer, [convs[i] for i in chunk])
        except Exception:  # noqa: BLE001 - one bad conversation: find it row by row
            rendered = []
            for i in chunk:
                try:
                    rendered += render_chats(tokenizer, [convs[i]])
                except Exception as e:  # noqa: BLE001 - templates raise anything
                    errors[i] = f"input: the chat template failed on this row: {e}"
                    rendered.append(None)
        text.update((i, t) for i, t in zip(chunk, rendered) if t is not None)
    return text


def build_rows(tokenizer, cfg: InputConfig, sampling: SamplingConfig, rows: InputRows,
               first_index: int = 0, keep_prompt: bool = True) -> list[Row]:
    """One Row per input row, in order; rows[i] gets index first_index + i (a block of a larger
    input starts past 0). keep_prompt: keep the rendered text (output.include_prompt)."""
    plain, convs, errors = _texts(cfg, rows)
    rendered = _render(tokenizer, convs, errors)
    text = {**plain, **rendered}
    # special tokens (BOS) are added to plain prompts; a chat template writes its own
    ids = {**dict(zip(plain, tokenize(tokenizer, plain.values(), True))),
           **dict(zip(rendered, tokenize(tokenizer, rendered.values(), False)))}
    row_ids = rows.ids.to_pylist()
    out = []
    for i in range(rows.num_rows):
        try:
            sp = row_sampling(sampling, rows.overrides, i)
        except (TypeError, ValueError) as e:
            sp, errors[i] = SamplingParams(), f"sampling override: {e}"
        out.append(Row(first_index + i, row_ids[i], ids.get(i), sp,
                       text.get(i) if keep_prompt else None, errors.get(i)))
    return out
