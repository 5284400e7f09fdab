"""DESIGN.md's near-tie rule (hf_reference.assert_tokens_match), which every equivalence test
applies, checked on a real reference: the tiny Llama's greedy tokens and top-two logit gaps."""

from __future__ import annotations

import functools
import math

import pytest
from hf_reference import assert_tokens_match, hf_greedy_reference, tiny_model_folder

from batchllm.model.tokenizer import load_tokenizer

STEPS = 24


@functools.cache
def reference() -> tuple[list[int], list[float]]:
    """transformers' greedy tokens of one prompt and the top-two gap at each of them."""
    folder = tiny_model_folder("llama")
    prompt = load_tokenizer(folder)("The parties agree that the Provider shall")["input_ids"]
    ((tokens, gaps),) = hf_greedy_reference(folder, [prompt], STEPS, ignore_eos=True)
    assert len(tokens) == len(gaps) == STEPS
    return tokens, gaps


def other(token: int) -> int:
    return token + 1 if token < 49151 else token - 1


def test_the_reference_matches_itself() -> None:
    tokens, gaps = reference()
    assert assert_tokens_match(list(tokens), tokens, gaps) is False


def test_a_different_token_where_the_reference_is_sure_fails() -> None:
    tokens, gaps = reference()
    pos = max(range(STEPS), key=gaps.__getitem__)
    assert gaps[pos] > 1e-3  # not a near tie under the default tolerance
    ours = [*tokens[:pos], other(tokens[pos]), *tokens[pos + 1 :]]
    with pytest.raises(AssertionError, match=f"row 7: tokens differ at position {pos}: "):
        assert_tokens_match(ours, tokens, gaps, row=7)


def test_a_divergence_at_a_near_tie_ends_the_comparison() -> None:
    """Diverging where the reference's top two are within tol: accepted, and what follows (other
    tokens, another length) is not compared; a tol just below that gap rejects the same row."""
    tokens, gaps = reference()
    pos = min(range(STEPS), key=gaps.__getitem__)
    tie = gaps[pos]
    ours = [*tokens[:pos], other(tokens[pos]), *(other(t) for t in tokens[pos + 1 : -3])]
    assert assert_tokens_match(ours, tokens, gaps, tol=tie) is True
    with pytest.raises(AssertionError, match=f"tokens differ at position {pos}: "):
        assert_tokens_match(ours, tokens, gaps, tol=math.nextafter(tie, -math.inf))


def test_same_tokens_but_fewer_fails() -> None:
    tokens, gaps = reference()
    with pytest.raises(AssertionError, match=f"ours has {STEPS - 1} tokens and the reference "
                                             f"{STEPS}"):
        assert_tokens_match(tokens[:-1], tokens, gaps)
