"""Sampling as small pure functions: greedy, temperature, top-k, top-p.

Random draws come from a counter-based generator: the uniform for a row's n-th generated token
is a hash of (row key, n), where the row key is a hash of the job seed and the row id. A row's
output so depends neither on what it was batched with nor on the order rows ran in, nor on
preemption.
"""

from __future__ import annotations

import hashlib

import torch

_MASK64 = (1 << 64) - 1


def row_key(seed: int, row_id: object) -> int:
    """The per-row generator key, stable across processes and machines."""
    digest = hashlib.blake2b(f"{seed}\x00{row_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def uniform(key: int, counter: int) -> float:
    """SplitMix64 of (key, counter) -> a float in [0, 1)."""
    z = (key + (counter + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


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
    """One token per row: argmax where temperature is 0, else an inverse-CDF draw."""
    out = logits.argmax(dim=-1).tolist()
    rand = [i for i, t in enumerate(temperature) if t > 0]
    if not rand:
        return out
    idx = torch.tensor(rand, device=logits.device)
    dev = logits.device
    probs, ids = filtered_probs(
        logits[idx],
        torch.tensor([temperature[i] for i in rand], device=dev),
        torch.tensor([top_k[i] for i in rand], device=dev),
        torch.tensor([top_p[i] for i in rand], device=dev),
    )
    cdf = torch.cumsum(probs.double(), dim=-1)  # [R, V]
    u = torch.tensor([uniform(keys[i], counters[i]) for i in rand], dtype=torch.float64,
                     device=dev)
    pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp_(
        max=probs.shape[1] - 1)  # [R, 1]
    chosen = ids.gather(1, pick)[:, 0].tolist()
    for i, tok in zip(rand, chosen):
        out[i] = tok
    return out
