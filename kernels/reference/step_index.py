"""Which cache rows each sequence of a step reads: built once per step, used by every layer.

The pure-torch twin of paged attention gathers each sequence's keys and values out of the pages.
The rows to gather depend only on the page tables and lengths, the same in all layers, so the
engine indexes a step once (`index_step`) and hands the result to every layer's call.
Rows are heads-first: row (slot * Hkv + h) of `cache.view(-1, D)` is KV head h of the token in
`slot`, so one index_select yields [.., Hkv, Tk, D] ready for the products.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DECODE_BUCKET = 64  # one-query sequences padded together (sorted by length: little padding)


@dataclass(frozen=True)
class DecodeBucket:
    """One-query sequences attended as one padded batch."""

    rows: torch.Tensor  # [B] int64, the query row of each sequence
    kv_rows: torch.Tensor  # [B * Hkv * Tk] int64, heads-first cache rows (padding reads slot 0)
    bias: torch.Tensor  # [B, 1, 1, Tk] fp32, 0 where the key is visible, -inf elsewhere
    shape: tuple[int, int, int]  # (B, Hkv, Tk)
    key_pos: torch.Tensor  # [B, Tk] int64, position of each key (padding: past the query)
    query_pos: torch.Tensor  # [B] int64, position of each query (context_len - 1)


@dataclass(frozen=True)
class Chunk:
    """A sequence with several queries this step (a prefill chunk)."""

    rows: slice  # its query rows
    kv_rows: torch.Tensor  # [Hkv * Tk] int64, heads-first cache rows
    query_pos: torch.Tensor  # [N] int64, positions of the queries
    key_pos: torch.Tensor  # [Tk] int64, positions of the keys (kv_start .. context_len - 1)


@dataclass(frozen=True)
class StepIndex:
    decodes: list[DecodeBucket]  # empty when built with gather_decodes=False
    chunks: list[Chunk]  # empty when built with gather_chunks=False
    decode_seqs: torch.Tensor  # [n] int32, the one-query sequences (for the C decode kernel)
    decode_rows: torch.Tensor  # [n] int32, their query rows
    chunk_seqs: torch.Tensor  # [m] int32, the sequences with several queries (C prefill kernel)


def index_step(
    page_table: torch.Tensor,  # [B, max_pages] int32
    cu_q: torch.Tensor,  # [B+1] int32
    context_lens: torch.Tensor,  # [B] int32
    kv_start: torch.Tensor,  # [B] int32
    page_size: int,
    num_kv_heads: int,
    gather_decodes: bool = True,
    gather_chunks: bool = True,
) -> StepIndex:
    """Index the keys of every sequence of a step (see paged_attention_ref for the meaning).
    gather_decodes=False / gather_chunks=False: no gather index for the one-query sequences /
    the prefill chunks (a C kernel reads the pages itself)."""
    dev = page_table.device
    cu, ctx, start = cu_q.tolist(), context_lens.tolist(), kv_start.tolist()
    one_query = sorted((b for b in range(len(ctx)) if cu[b + 1] - cu[b] == 1),
                       key=lambda b: ctx[b] - start[b])
    decode_seqs = torch.tensor(one_query, dtype=torch.int32, device=dev)
    decode_rows = torch.tensor([cu[b] for b in one_query], dtype=torch.int32, device=dev)
    decodes = []
    for lo in range(0, len(one_query) if gather_decodes else 0, DECODE_BUCKET):
        seqs = one_query[lo : lo + DECODE_BUCKET]
        first = torch.tensor([start[b] for b in seqs], device=dev)  # [B]
        length = torch.tensor([ctx[b] - start[b] for b in seqs], device=dev)  # [B]
        tk = max(1, int(length.max()))
        offs = torch.arange(tk, device=dev)
        visible = offs[None, :] < length[:, None]  # [B, Tk]
        positions = torch.where(visible, first[:, None] + offs[None, :], 0)
        table = page_table[torch.tensor(seqs, device=dev)]
        rows = _heads_first_rows(table, positions, page_size, num_kv_heads)  # [B, Hkv, Tk]
        bias = torch.zeros(len(seqs), 1, 1, tk, device=dev)
        bias.masked_fill_(~visible[:, None, None, :], float("-inf"))
        query_rows = torch.tensor([cu[b] for b in seqs], device=dev)
        decodes.append(DecodeBucket(query_rows, rows.reshape(-1), bias,
                                    (len(seqs), num_kv_heads, tk), first[:, None] + offs[None, :],
                                    first + length - 1))
    several = [b for b in range(len(ctx)) if cu[b + 1] - cu[b] > 1]
    chunks = []
    for b in several if gather_chunks else []:
        n = cu[b + 1] - cu[b]
        keys = torch.arange(start[b], ctx[b], device=dev)  # [Tk]
        rows = _heads_first_rows(page_table[b : b + 1], keys[None], page_size, num_kv_heads)
        queries = torch.arange(ctx[b] - n, ctx[b], device=dev)
        chunks.append(Chunk(slice(cu[b], cu[b + 1]), rows.reshape(-1), queries, keys))
    chunk_seqs = torch.tensor(several, dtype=torch.int32, device=dev)
    return StepIndex(decodes, chunks, decode_seqs, decode_rows, chunk_seqs)


def _heads_first_rows(
    page_table: torch.Tensor,  # [B, max_pages]
    positions: torch.Tensor,  # [B, Tk] int64, valid positions
    page_size: int,
    num_kv_heads: int,
) -> torch.Tensor:  # [B, Hkv, Tk] int64
    pages = torch.gather(page_table.long(), 1, positions // page_size)
    slots = pages * page_size + positions % page_size  # [B, Tk]
    heads = torch.arange(num_kv_heads, device=positions.device)
    return slots[:, None, :] * num_kv_heads + heads[None, :, None]
