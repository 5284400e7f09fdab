"""Prompts to token ids: the model's chat template, then the fast tokenizer, in batches."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

BATCH_ROWS = 1024


def conversation(prompt: str, system_prompt: str | None) -> list[dict]:
    """A plain prompt as one user message, after an optional system message."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return messages + [{"role": "user", "content": prompt}]


def render_chats(tokenizer, conversations: Sequence[list[dict]]) -> list[str]:
    """Each conversation through the model's chat template, ready for the assistant's turn."""
    if not conversations:
        return []
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "input.chat_template: the model has no chat template; set chat_template: false"
        )
    return tokenizer.apply_chat_template(
        list(conversations), tokenize=False, add_generation_prompt=True
    )


def tokenize(
    tokenizer, texts: Iterable[str], add_special_tokens: bool
) -> list[np.ndarray]:
    """Token ids of each text as int32 arrays, encoded BATCH_ROWS texts at a time."""
    texts = list(texts)
    out: list[np.ndarray] = []
    for lo in range(0, len(texts), BATCH_ROWS):
        enc = tokenizer(texts[lo : lo + BATCH_ROWS], add_special_tokens=add_special_tokens)
        out += [np.asarray(ids, dtype=np.int32) for ids in enc["input_ids"]]
    return out
