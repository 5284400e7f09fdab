"""Sampling as small pure functions: greedy, temperature, top-k, top-p, log-probabilities.

Random draws come from a counter-based generator: the uniform for a row's n-th generated token
is a hash of (row key, n), where the row key is a hash of the job seed and the row id. A row's
output so depends neither on what it was batched with nor on the order rows ran in, nor on
preemption.
"""

from __future__ import annotations

import hashlib

import torch

from batchllm.engine.request import Kind, Request
from batchllm.rows.record import TokenLogprob

_MASK64 = (1 << 64) - 1


def row_key(seed: int, row_id: object, sample: int = 0) -> int:
    """The generator key of a row's sample, stable across processes and machines. Sample 0
    keeps the key of (seed, row id) alone, so that n = 1 draws what it always drew and the first
    of n samples is the n = 1 completion; sample s > 0 hashes (seed, row id, s)."""
    text = f"{seed}\x00{row_id}" if sample == 0 else f"{seed}\x00{row_id}\x00{sample}"
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def uniform(key: int, counter: int) -> float:
    """SplitMix64 of (key, counter) -> a float in [0, 1)."""
    z = (key + (counter + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


def greedy_only(seq: Request) -> bool:
    """Whether a sequence's next token is the plain argmax of its logits, nothing else read
    from them: a row at temperature 0, no grammar mask, no logprobs (then the lm_head need not
    write the logits; a shared prefix's logits are kept for the rows under it)."""
    return (seq.kind is Kind.ROW and seq.sampling.temperature == 0 and seq.matcher is None
            and seq.logprobs is None)


def filtered_probs(
    logits: torch.Tensor,  # [S, V] fp32
    temperature: torch.Tensor,  # [S]
    top_k: torch.Tensor,  # [S] int64, 0 = off
    top_p: torch.Tensor,  # [S], 1 = off
) -> tuple[torch.Tensor, torch.Tensor]:  # probs sorted descending [S, V], their token ids [S, V]
    """Temperature, then top-k and top-p on the sorted distribution (ties kept in id order)."""
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    probs, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    rank = torch.arange(probs.shape[1], device=probs.device)[None, :]
    k = torch.where(top_k > 0, top_k, probs.shape[1])
    drop = rank >= k[:, None]
    before = torch.cumsum(probs, dim=-1) - probs  # mass strictly above each token
    drop |= (before >= top_p[:, None]) & (rank > 0)
    return probs.masked_fill(drop, 0.0), ids


def sample(
    logits: torch.Tensor,  # [S, V] fp32
    temperature: list[float],
    top_k: list[int],
    top_p: list[float],
    keys: list[int],
    counters: list[int],
) -> list[int]:
    """One token per row: argmax where temperature is 0, else an inverse-CDF draw: over the
    distribution in token-id order when the row sets neither top-k nor top-p (no sort of the
    vocabulary: at 64 rows x 49,152 tokens the sort took ~0.16 s a step on 2 cores, two thirds
    of a sampled job's time), else over the filtered distribution sorted by probability."""
    out = logits.argmax(dim=-1).tolist()
    vocab = logits.shape[1]
    rand = [i for i, t in enumerate(temperature) if t > 0]
    plain = [i for i in rand if (top_k[i] <= 0 or top_k[i] >= vocab) and top_p[i] >= 1]
    unfiltered = set(plain)
    filtered = [i for i in rand if i not in unfiltered]
    dev = logits.device
    for group, sort in ((plain, False), (filtered, True)):
        if not group:
            continue
        idx = torch.tensor(group, device=dev)
        t = torch.tensor([temperature[i] for i in group], device=dev)
        if sort:
            probs, ids = filtered_probs(logits[idx], t,
                                        torch.tensor([top_k[i] for i in group], device=dev),
                                        torch.tensor([top_p[i] for i in group], device=dev))
        else:
            probs, ids = torch.softmax(logits[idx] / t[:, None], dim=-1), None  # [R, V]
        cdf = torch.cumsum(probs.double(), dim=-1)  # [R, V]
        u = torch.tensor([uniform(keys[i], counters[i]) for i in group], dtype=torch.float64,
                         device=dev)
        pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp_(
            max=vocab - 1)  # [R, 1]
        chosen = (pick if ids is None else ids.gather(1, pick))[:, 0].tolist()
        for i, tok in zip(group, chosen):
            out[i] = tok
    return out


def token_logprobs(
    logits: torch.Tensor,  # [R, V] fp32, after the structured-output mask
    temperature: list[float],
    tokens: list[int],
    k: list[int],
) -> list[TokenLogprob]:
    """Each row's chosen token and its top-k under log_softmax(logits / temperature), where
    greedy rows use temperature 1 (the model's own distribution). Before top-k/top-p: those
    truncate the draw, and would make every logprob 0 or -inf under top_k 1. Alternatives the
    mask forbids (-inf) are left out of `top`."""
    dev = logits.device
    t = torch.tensor([x if x > 0 else 1.0 for x in temperature], device=dev)
    lp = torch.log_softmax(logits / t[:, None], dim=-1)  # [R, V]
    chosen = lp.gather(1, torch.tensor(tokens, device=dev)[:, None])[:, 0].tolist()
    top_lp, top_id = (x.tolist() for x in lp.topk(max(k), dim=-1))  # [R, kmax] each
    ninf = float("-inf")
    return [
        TokenLogprob(tok, c, [(i, v) for i, v in zip(ids[:kr], vals[:kr]) if v != ninf])
        for tok, c, ids, vals, kr in zip(tokens, chosen, top_id, top_lp, k)
    ]
