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

from batchllm.engine.grammar import JSON_OPTIONS  # the separators batchllm documents
from batchllm.model.weights import load_tokenizer


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


@torch.no_grad()
def hf_constrained_greedy(folder: Path, prompt: list[int], kind: str, spec,
                          max_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens of transformers' model on one prompt, each step's logits masked by a fresh
    llguidance matcher of the constraint; stops at an end-of-sequence token, when the grammar
    is complete, or at max_tokens. Returns (tokens, top-two gap of the masked logits per step)."""
    model = hf_model(Path(folder))
    vocab = model.config.vocab_size
    eos = list(_eos_ids(Path(folder)))
    tokenizer = llguidance.hf.from_tokenizer(load_tokenizer(folder), n_vocab=vocab,
                                             eos_token=eos)
    matcher = llg.LLMatcher(tokenizer, reference_grammar(kind, spec), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ids = torch.tensor([prompt])
    past, tokens, gaps = None, [], []
    while len(tokens) < max_tokens:
        out = model(ids, past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = out.logits[0, -1].float().masked_fill(~_allowed(matcher, vocab), float("-inf"))
        top = logits.topk(2).values
        gaps.append(float(top[0] - top[1]))
        tok = int(logits.argmax())
        tokens.append(tok)
        assert matcher.consume_token(tok)
        if tok in eos or matcher.is_stopped():
            break
        ids = torch.tensor([[tok]])
    return tokens, gaps


@torch.no_grad()
def hf_logprobs(folder: Path, prompt: list[int], tokens: list[int],
                temperature: float = 1.0) -> torch.Tensor:
    """[len(tokens), V] log_softmax(logits / temperature) of transformers' model at each
    generated position, the given tokens fed back (teacher forcing), float32."""
    model = hf_model(Path(folder))
    ids = torch.tensor([prompt + tokens[:-1]])
    logits = model(ids).logits[0, len(prompt) - 1 :].float()  # [T, V]
    return torch.log_softmax(logits / temperature, dim=-1)
