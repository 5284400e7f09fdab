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
    def has_placeholders(self) -> bool:
        """Some id is a placeholder (< 0) for one sampled last step (future_tokens.py)."""
        return bool(len(self.ids)) and int(self.ids.min()) < 0

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
    """The step's flat inputs: `counts[i]` tokens of `seqs[i]` from its computed position on.
    Per row only what a list comprehension does (its computed count, its token, its slot);
    the rest over arrays."""
    ps = page_size
    order, found = cascade_order(seqs) if cascade else (None, [])
    if order is not None:
        seqs, counts, wants_logits = ([x[i] for i in order]
                                      for x in (seqs, counts, wants_logits))
    b = len(seqs)
    lo_list = [s.computed for s in seqs]
    lo = np.array(lo_list, dtype=np.int64)  # [B]
    n = np.array(counts, dtype=np.int64)  # [B]
    hi = lo + n
    cu_q = np.zeros(b + 1, dtype=np.int32)
    np.cumsum(n, out=cu_q[1:])
    if b and int(n.max()) == 1:  # a decode step (or chunks' last tokens): one token a row
        ids = np.array([s.token_ids[c] for s, c in zip(seqs, lo_list)], dtype=np.int64)
        positions = lo
        slots = np.array([s.pages[c // ps] for s, c in zip(seqs, lo_list)], dtype=np.int64)
        slots = slots * ps + lo % ps
    else:
        ids_l: list = []
        pos_l: list = []
        slots_l: list = []
        for seq, c, k in zip(seqs, lo_list, counts):
            if k == 1:
                ids_l.append(seq.token_ids[c])
                pos_l.append(c)
                slots_l.append(seq.pages[c // ps] * ps + c % ps)
            else:
                pp = np.arange(c, c + k)
                ids_l.extend(seq.token_ids[c:c + k])
                pos_l.extend(pp.tolist())
                slots_l.extend((np.asarray(seq.pages, dtype=np.int64)[pp // ps] * ps
                                + pp % ps).tolist())
        ids = np.asarray(ids_l, dtype=np.int64)
        positions = np.asarray(pos_l, dtype=np.int64)
        slots = np.asarray(slots_l, dtype=np.int64)
    kv_start = np.zeros(b, dtype=np.int32)
    groups, at = [], 0
    for members, shared in found:  # members come first, in this order
        groups.append(Group(at, at + len(members), shared))
        kv_start[at:at + len(members)] = shared * ps
        at += len(members)
    num_prompt = np.array([s.num_prompt_tokens for s in seqs], dtype=np.int64)
    prefill = int(np.maximum(0, np.minimum(hi, num_prompt) - lo).sum())
    want = np.array(wants_logits, dtype=bool)
    sampled = [s for s, w in zip(seqs, wants_logits) if w]
    return StepBatch(
        seqs=seqs, counts=counts, ids=ids, positions=positions, slots=slots, cu_q=cu_q,
        context_lens=hi.astype(np.int32), kv_start=kv_start,
        sample_rows=(cu_q[1:][want] - 1).astype(np.int64).tolist() if b else [],
        sampled=sampled, groups=groups, prefill_tokens=prefill,
    )
