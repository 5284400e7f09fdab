"""Sampling as small pure functions: greedy, temperature, top-k, top-p, log-probabilities.

Random draws come from a counter-based generator: the uniform for a row's n-th generated token
is a hash of (row key, n), where the row key is a hash of the job seed and the row id. A row's
output so depends neither on what it was batched with nor on the order rows ran in, nor on
preemption.

On the CPU the rows are sampled and scored in chunks whose float64 copy of the vocabulary stays
under _CPU_CHUNK_BYTES: every step over [rows, vocab] then works in cache and in heap memory
glibc reuses, where the whole batch's temporaries (50-100 MB each at 256 rows x 49,152 tokens,
above engine/cpu_allocator.py's 32-MiB mmap threshold) were mapped and faulted in afresh by every
operation: sampling 256 rows took 166 ms a step whole and 30 ms in chunks of 10 on 2 cores. Each
row's operations see only its own row, so its values, bit for bit, do not depend on the chunks
(tests/test_sampling.py: batch invariance). On CUDA: one chunk.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import torch

from batchllm.engine.step_logprobs import StepLogprobs

_MASK64 = (1 << 64) - 1
_CPU_CHUNK_BYTES = 4 << 20  # a chunk's [rows, vocab] float64 at most (one row at least)
_GOLDEN, _MIX1, _MIX2 = (np.uint64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9,
                                                 0x94D049BB133111EB))


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


def row_chunks(rows: int, vocab: int, device: torch.device) -> list[slice]:
    """Slices of range(rows), none when rows is 0: on the CPU each of at most _CPU_CHUNK_BYTES
    of [rows, vocab] float64 (at least one row); elsewhere one."""
    if device.type != "cpu":
        return [slice(0, rows)] if rows else []
    step = max(1, _CPU_CHUNK_BYTES // (8 * vocab))
    return [slice(i, min(i + step, rows)) for i in range(0, rows, step)]


def uniforms(keys: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """`uniform` of each (key, counter), vectorised: keys [R] uint64, counters [R] int ->
    [R] float64, bit for bit the same values (uint64 arithmetic wraps mod 2^64 as the masks
    do; z >> 11 < 2^53 converts to float64 exactly)."""
    z = keys.astype(np.uint64) + (counters.astype(np.uint64) + np.uint64(1)) * _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    z ^= z >> np.uint64(31)
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def sample_ids(
    logits: torch.Tensor,  # [S, V] fp32
    temperature: Sequence[float] | np.ndarray,  # [S]
    top_k: Sequence[int] | np.ndarray,  # [S]
    top_p: Sequence[float] | np.ndarray,  # [S]
    keys: Sequence[int] | np.ndarray,  # [S] uint64
    counters: Sequence[int] | np.ndarray,  # [S]: tokens the row generated so far
) -> torch.Tensor:  # [S] int64, on the logits' device (not read back here)
    """One token per row: argmax where temperature is 0, else an inverse-CDF draw: over the
    distribution in token-id order when the row sets neither top-k nor top-p (no sort of the
    vocabulary: at 64 rows x 49,152 tokens the sort took ~0.16 s a step on 2 cores, two thirds
    of a sampled job's time), else over the filtered distribution sorted by probability.
    The settings come as arrays (engine/row_slots.py); lists work too."""
    temperature = np.asarray(temperature, dtype=np.float64)
    top_k = np.asarray(top_k, dtype=np.int64)
    top_p = np.asarray(top_p, dtype=np.float64)
    vocab = logits.shape[1]
    rand = temperature > 0
    if rand.all():
        out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)  # [S]
    else:
        out = logits.argmax(dim=-1)  # [S] int64
        if not rand.any():
            return out
    plain = rand & ((top_k <= 0) | (top_k >= vocab)) & (top_p >= 1)
    dev = logits.device
    keys = np.asarray(keys, dtype=np.uint64)
    counters = np.asarray(counters, dtype=np.int64)
    for mask, sort in ((plain, False), (rand & ~plain, True)):
        group = mask.nonzero()[0]
        for part in row_chunks(len(group), vocab, dev):
            rows = group[part]
            idx = torch.from_numpy(rows).to(dev)
            t = torch.from_numpy(temperature[rows].astype(np.float32)).to(dev)
            if sort:
                probs, ids = filtered_probs(
                    logits[idx], t, torch.from_numpy(top_k[rows]).to(dev),
                    torch.from_numpy(top_p[rows].astype(np.float32)).to(dev))
            else:  # in the rows' own copy: no [R, V] temporaries
                probs, ids = logits[idx].div_(t[:, None]), None  # [R, V]
                torch.softmax(probs, dim=-1, out=probs)
            cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)  # [R, V]
            u = torch.from_numpy(uniforms(keys[rows], counters[rows])).to(dev)  # [R] fp64
            pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp_(
                max=vocab - 1)  # [R, 1]
            out[idx] = (pick if ids is None else ids.gather(1, pick))[:, 0]
    return out


def token_logprobs(
    logits: torch.Tensor,  # [R, V] fp32, after the structured-output mask
    temperature: Sequence[float] | np.ndarray,  # [R]
    tokens: torch.Tensor | list[int],  # [R] int64 the chosen tokens
    k: Sequence[int] | np.ndarray,  # [R] top alternatives each row asks for
) -> StepLogprobs:
    """Each row's chosen token and its top-k under log_softmax(logits / temperature), where
    greedy rows use temperature 1 (the model's own distribution). Before top-k/top-p: those
    truncate the draw, and would make every logprob 0 or -inf under top_k 1. Left as tensors
    (step_logprobs.py), their copies to the host started on CUDA; alternatives the mask forbids
    (-inf) are left out of a record's `top`. In row chunks on the CPU (row_chunks). The logits
    are overwritten with the log-probabilities (the sampler has read them): two [R, V] float32
    temporaries fewer, on CUDA memory the KV pool keeps, on the CPU bytes streamed."""
    dev = logits.device
    temperature = np.asarray(temperature, dtype=np.float64)
    t = torch.from_numpy(np.where(temperature > 0, temperature, 1.0).astype(np.float32)).to(dev)
    tokens = torch.as_tensor(tokens, dtype=torch.int64, device=dev)  # [R]
    kmax = int(np.max(k))
    parts = []
    with torch.inference_mode():  # the forward's logits are inference tensors
        for c in row_chunks(logits.shape[0], logits.shape[1], dev):
            lp = logits[c]  # [r, V] a view: overwritten, no [r, V] temporaries
            torch.log_softmax(lp.div_(t[c, None]), dim=-1, out=lp)
            parts.append((lp.gather(1, tokens[c, None])[:, 0], *lp.topk(kmax, dim=-1)))
    chosen, top_lp, top_id = (p[0] if len(parts) == 1 else torch.cat(p) for p in zip(*parts))
    return StepLogprobs(tokens, chosen, top_lp, top_id).start()  # [R], [R, kmax], [R, kmax]
