"""Input rows -> engine rows: the prompt rendered and tokenized, sampling with per-row overrides.

A row that cannot run (a null prompt, bad messages, a per-row value out of range) is kept with
the reason, so that it becomes an error row and the job goes on.
"""

from __future__ import annotations

import dataclasses

from batchllm.config import InputConfig, SamplingConfig
from batchllm.llm import RowInput
from batchllm.rows.prompts import conversation, render_chats, tokenize
from batchllm.rows.reader import InputRows
from batchllm.sampling_params import SamplingParams


def row_sampling(defaults: SamplingConfig, overrides: dict[str, list], i: int) -> SamplingParams:
    """The job's sampling settings, with row i's values from same-named input columns."""
    values = dataclasses.asdict(defaults)
    for name, column in overrides.items():
        if column[i] is not None:
            values[name] = column[i]
    values["stop"] = tuple(values["stop"] or ())
    return SamplingParams(**values)


def _texts(cfg: InputConfig, rows: InputRows, keep: list[int]) -> tuple[dict, dict, dict]:
    """Per row index: plain prompt text, a conversation to render, or why it cannot run."""
    errors: dict[int, str] = {}
    convs: dict[int, list[dict]] = {}
    plain: dict[int, str] = {}
    for i in keep:
        if rows.messages is not None:
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
        elif cfg.chat_template:
            convs[i] = conversation(prompt, cfg.system_prompt)
        else:
            plain[i] = prompt
    return plain, convs, errors


def build_rows(
    tokenizer, cfg: InputConfig, sampling: SamplingConfig, rows: InputRows, keep: list[int]
) -> tuple[list[RowInput], list[str | None]]:
    """Engine rows for the input rows `keep` (in that order), and their rendered prompt text."""
    plain, convs, errors = _texts(cfg, rows, keep)
    text: dict[int, str] = dict(plain)
    order = list(convs)
    for lo in range(0, len(order), 1024):
        chunk = order[lo : lo + 1024]
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
    ids = dict(zip(text, tokenize(tokenizer, text.values(), not cfg.chat_template)))
    row_ids = rows.ids.to_pylist()
    out, prompts = [], []
    for i in keep:
        try:
            sp = row_sampling(sampling, rows.overrides, i)
        except (TypeError, ValueError) as e:
            sp, errors[i] = SamplingParams(), f"sampling override: {e}"
        out.append(RowInput(ids.get(i), sp, row_ids[i], errors.get(i)))
        prompts.append(text.get(i))
    return out, prompts
