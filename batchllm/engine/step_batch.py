"""One step's inputs on the host, in step order: what both runners turn into tensors.

Cascade groups: sequences of the step that borrow the same leading pages of a shared prefix are
placed next to each other, first, and the prefix part of their attention runs once per group.
A one-token sequence (a decode) takes a plain-Python path: a decode step of 256 sequences is
built in a fraction of a millisecond, not in 256 rounds of numpy calls.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from batchllm.engine.request import Request


@dataclass(frozen=True)
class Group:
    """Sequences lo..hi-1 (in step order) share their first `pages` pages."""

    lo: int
    hi: int
    pages: int


@dataclass
class StepBatch:
    seqs: list[Request]  # in step order: cascade groups first, members adjacent
    counts: list[int]  # query rows of each
    ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slots: np.ndarray  # [T] int64, cache slot of each new token
    cu_q: np.ndarray  # [B+1] int32
    context_lens: np.ndarray  # [B] int32, tokens in the cache after the step
    kv_start: np.ndarray  # [B] int32, first position of the own part (after a group's prefix)
    sample_rows: list[int]  # rows whose logits are sampled
    sampled: list[Request]  # their sequences
    groups: list[Group]
    prefill_tokens: int  # prompt tokens fed through the forward pass

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    @property
    def decode_only(self) -> bool:
        return len(self.ids) == len(self.seqs)

    @property
    def cascade_rows(self) -> int:
        """Query rows that belong to groups: rows 0 .. cascade_rows-1."""
        return int(self.cu_q[self.groups[-1].hi]) if self.groups else 0

    @property
    def max_pages(self) -> int:
        return max(len(s.pages) for s in self.seqs)


def cascade_order(seqs: list[Request]) -> tuple[list[int], list[tuple[list[int], int]]]:
    """Order the step's sequences so that cascade groups come first, members adjacent.

    A group is >= 2 sequences that borrow the same pages, i.e. sit under the same shared prefix
    (the deepest one: the questions of one document, not every row under the system prompt).
    Returns the order (indices into seqs) and the groups as (member indices, shared pages).
    """
    by_prefix: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for i, seq in enumerate(seqs):
        if seq.num_borrowed_pages:
            by_prefix[tuple(seq.pages[: seq.num_borrowed_pages])].append(i)
    groups = [(members, len(key)) for key, members in by_prefix.items() if len(members) > 1]
    grouped = {i for members, _ in groups for i in members}
    order = [i for members, _ in groups for i in members]
    order += [i for i in range(len(seqs)) if i not in grouped]
    return order, groups


def build_batch(seqs: list[Request], counts: list[int], wants_logits: list[bool],
                page_size: int, cascade: bool) -> StepBatch:
    """The step's flat inputs: `counts[i]` tokens of `seqs[i]` from its computed position on."""
    ps = page_size
    order, found = cascade_order(seqs) if cascade else (list(range(len(seqs))), [])
    shared_of = {i: shared for members, shared in found for i in members}
    ids: list = []
    pos: list = []
    slots: list = []
    cu_q, ctx, kv_start, sample_rows, sampled = [0], [], [], [], []
    prefill = 0
    for i in order:
        seq, n = seqs[i], counts[i]
        lo, hi = seq.computed, seq.computed + n
        if n == 1:  # a decode, or a chunk's last token: no numpy round trip
            ids.append(seq.token_ids[lo])
            pos.append(lo)
            slots.append(seq.pages[lo // ps] * ps + lo % ps)
        else:
            p = np.arange(lo, hi)
            ids.extend(seq.token_ids[lo:hi])
            pos.extend(p.tolist())
            slots.extend((np.asarray(seq.pages, dtype=np.int64)[p // ps] * ps + p % ps).tolist())
        cu_q.append(cu_q[-1] + n)
        ctx.append(hi)
        kv_start.append(shared_of.get(i, 0) * ps)
        prefill += max(0, min(hi, seq.num_prompt_tokens) - lo)
        if wants_logits[i]:
            sample_rows.append(cu_q[-1] - 1)
            sampled.append(seq)
    groups, lo = [], 0
    for members, shared in found:
        groups.append(Group(lo, lo + len(members), shared))
        lo += len(members)
    return StepBatch(
        seqs=[seqs[i] for i in order], counts=[counts[i] for i in order],
        ids=np.asarray(ids, dtype=np.int64), positions=np.asarray(pos, dtype=np.int64),
        slots=np.asarray(slots, dtype=np.int64), cu_q=np.asarray(cu_q, dtype=np.int32),
        context_lens=np.asarray(ctx, dtype=np.int32),
        kv_start=np.asarray(kv_start, dtype=np.int32), sample_rows=sample_rows,
        sampled=sampled, groups=groups, prefill_tokens=prefill,
    )
