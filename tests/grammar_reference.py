"""Test helpers for structured output and log-probabilities, built on transformers and llguidance
directly (not on batchllm's engine): greedy decoding under a token mask one prompt at a time, and
the log-softmax of transformers' logits at given positions."""

from __future__ import annotations

import json
from pathlib import Path

import llguidance as llg
import llguidance.hf
import numpy as np
import torch
from hf_reference import _eos_ids, hf_model
from transformers import LogitsProcessor, LogitsProcessorList

from batchllm.constraints import JSON_OPTIONS  # the separators batchllm documents
from batchllm.model.tokenizer import load_tokenizer


def reference_grammar(kind: str, spec) -> str:
    if kind == "json_schema":
        text = spec if isinstance(spec, str) else json.dumps(spec)
        return llg.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(spec)
    return llg.grammar_from("choice", json.dumps(list(spec)))


def _allowed(matcher, vocab: int) -> torch.Tensor:  # [V] bool
    bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    return torch.from_numpy(np.unpackbits(bits, bitorder="little")[:vocab].astype(bool))


class _Mask(LogitsProcessor):
    """transformers' logits processor: feeds the last generated token to the matcher, masks the
    next step's logits to what it allows, and records the masked top-two gap."""

    def __init__(self, matcher, prompt_len: int, vocab: int) -> None:
        self.matcher, self.prompt_len, self.vocab, self.gaps = matcher, prompt_len, vocab, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] > self.prompt_len:
            assert self.matcher.consume_token(int(input_ids[0, -1]))
        allowed = _allowed(self.matcher, self.vocab)
        scores = scores.float().masked_fill(~allowed[: scores.shape[1]], float("-inf"))
        top = scores[0].topk(2).values
        self.gaps.append(float(top[0] - top[1]))
        return scores


@torch.no_grad()
def hf_constrained_greedy(folder: Path, prompt: list[int], kind: str, spec,
                          max_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens of transformers `generate` on one prompt, each step's logits masked by a
    fresh llguidance matcher of the constraint; stops at an end-of-sequence token, when the
    grammar is complete, or at max_tokens. Returns (tokens, top-two gap of the masked logits per
    step)."""
    model = hf_model(Path(folder))
    vocab = model.config.vocab_size
    eos = list(_eos_ids(Path(folder)))
    tokenizer = llguidance.hf.from_tokenizer(load_tokenizer(folder), n_vocab=vocab,
                                             eos_token=eos)
    grammar = reference_grammar(kind, spec)
    matcher = llg.LLMatcher(tokenizer, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    mask = _Mask(matcher, len(prompt), vocab)
    ids = torch.tensor([prompt])
    # one step more than max_tokens: a grammar complete at the last token is followed by EOS
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=max_tokens + 1, eos_token_id=eos, pad_token_id=eos[0],
                         logits_processor=LogitsProcessorList([mask]))
    replay = llg.LLMatcher(tokenizer, grammar, log_level=0)  # where did the grammar end?
    tokens = []
    for tok in out[0, len(prompt):].tolist()[:max_tokens]:
        tokens.append(tok)
        if tok in eos:
            break
        assert replay.consume_token(tok)
        if replay.is_stopped():
            break
    return tokens, mask.gaps[: len(tokens)]


@torch.no_grad()
def hf_logprobs(folder: Path, prompt: list[int], tokens: list[int],
                temperature: float = 1.0) -> torch.Tensor:
    """[len(tokens), V] log_softmax(logits / temperature) of transformers' model at each
    generated position, the given tokens fed back (teacher forcing), float32."""
    model = hf_model(Path(folder))
    ids = torch.tensor([prompt + tokens[:-1]])
    logits = model(ids).logits[0, len(prompt) - 1 :].float()  # [T, V]
    return torch.log_softmax(logits / temperature, dim=-1)
