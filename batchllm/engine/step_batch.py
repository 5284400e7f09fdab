"""One step's inputs on the host, in step order: what both runners turn into tensors.

Built over the slots' arrays (row_slots.py): positions, cache slots, context lengths and a
decode's id are fancy indexing with the step's slots, whatever the batch size; Python runs only
for the ids of sequences that run more than one token (a prompt's chunk: work in proportion to
its tokens) or one prompt token.

Cascade groups: sequences of the step that borrow the same leading pages of a shared prefix are
placed next to each other, first, and the prefix part of their attention runs once per group.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchllm.engine.row_slots import RowSlots


@dataclass(frozen=True)
class Group:
    """Sequences lo..hi-1 (in step order) share their first `pages` pages."""

    lo: int
    hi: int
    pages: int


@dataclass
class StepBatch:
    seq_slots: np.ndarray  # [B] int64, the sequences' slots in step order: groups first
    counts: np.ndarray  # [B] int64, query rows of each
    ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slots: np.ndarray  # [T] int64, cache slot of each new token
    cu_q: np.ndarray  # [B+1] int32
    context_lens: np.ndarray  # [B] int32, tokens in the cache after the step
    kv_start: np.ndarray  # [B] int32, first position of the own part (after a group's prefix)
    num_pages: np.ndarray  # [B] int64, pages each holds
    sample_rows: np.ndarray  # [S] int64, rows whose logits are sampled
    sampled: np.ndarray  # [S] int64, their slots
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
        return len(self.ids) == len(self.seq_slots)

    @property
    def cascade_rows(self) -> int:
        """Query rows that belong to groups: rows 0 .. cascade_rows-1."""
        return int(self.cu_q[self.groups[-1].hi]) if self.groups else 0

    @property
    def max_pages(self) -> int:
        return int(self.num_pages.max())


def cascade_order(slots: np.ndarray, state: RowSlots
                  ) -> tuple[np.ndarray | None, list[tuple[int, int]]]:
    """Order the step's sequences (slots [B]) so that cascade groups come first, members
    adjacent, in order of their first member; the rest after, in step order.

    A group is >= 2 sequences that borrow the same pages, i.e. sit under the same shared prefix
    (the deepest one: the questions of one document, not every row under the system prompt).
    Two sequences borrow the same pages when they borrow as many and the last is the same page:
    a page is only ever shared by borrowing, so its holders borrowed one prefix's leading pages.
    Returns the order (indices into slots; None: no group) and the groups as (members,
    shared pages)."""
    nb = state.borrowed[slots]  # [B]
    have = nb.nonzero()[0]
    if len(have) < 2:
        return None, []
    key = nb[have] * (1 << 32) + state.table[slots[have], nb[have] - 1]
    _, first, inverse, count = np.unique(key, return_index=True, return_inverse=True,
                                         return_counts=True)
    grouped = count[inverse] > 1
    if not grouped.any():
        return None, []
    members = have[grouped]
    by_group = np.lexsort((members, first[inverse[grouped]]))  # first member, then step order
    members = members[by_group]
    starts = first[inverse[grouped]][by_group]
    cut = np.diff(starts).nonzero()[0] + 1
    sizes = np.diff(np.concatenate([[0], cut, [len(members)]]))
    rest = np.ones(len(slots), dtype=bool)
    rest[members] = False
    order = np.concatenate([members, rest.nonzero()[0]])
    shared = nb[members[np.concatenate([[0], cut])]].tolist()
    return order, list(zip(sizes.tolist(), shared))


def build_batch(slots: np.ndarray, counts: np.ndarray, wants_logits: np.ndarray,
                state: RowSlots, page_size: int, cascade: bool) -> StepBatch:
    """The step's flat inputs: `counts[i]` tokens [B] of the sequence in slots[i] [B] from its
    computed position on; wants_logits [B] bool: its last position's logits are read."""
    ps = page_size
    order, found = cascade_order(slots, state) if cascade else (None, [])
    if order is not None:
        slots, counts, wants_logits = slots[order], counts[order], wants_logits[order]
    b = len(slots)
    lo = state.computed[slots]  # [B]
    hi = lo + counts
    cu_q = np.empty(b + 1, dtype=np.int32)
    cu_q[0] = 0
    cu_q[1:] = counts.cumsum()  # (np.cumsum into an int32 `out`: twice the time)
    num_prompt = state.num_prompt[slots]  # [B]
    t = int(cu_q[-1])
    if b and t == b:  # one token a row: positions are the computed counts
        positions = lo
        row_of = slots
    else:
        starts = np.repeat(cu_q[:-1].astype(np.int64) - lo, counts)  # [T]
        positions = np.arange(t, dtype=np.int64) - starts
        row_of = np.repeat(slots, counts)  # [T]
    cache = state.table[row_of, positions // ps].astype(np.int64) * ps + positions % ps
    gen = positions - np.repeat(num_prompt, counts) if t != b else lo - num_prompt
    ids = state.out[row_of, np.maximum(gen, 0)]  # [T]: generated ids; prompt ids below
    in_prompt = (gen < 0).nonzero()[0]
    if len(in_prompt):
        owner = state.owner
        seq_of = np.searchsorted(cu_q, in_prompt, side="right") - 1
        for i in np.unique(seq_of).tolist():  # the prompt tokens of each, one slice
            lo_i, n_i = int(lo[i]), int(min(hi[i], num_prompt[i]) - lo[i])
            start = int(cu_q[i])
            ids[start : start + n_i] = owner[int(slots[i])].prompt[lo_i : lo_i + n_i]
    kv_start = np.zeros(b, dtype=np.int32)
    groups, at = [], 0
    for size, shared in found:  # members come first, in this order
        groups.append(Group(at, at + size, shared))
        kv_start[at : at + size] = shared * ps
        at += size
    prefill = len(in_prompt)  # the prompt's tokens: those before the generated ones
    return StepBatch(
        seq_slots=slots, counts=counts, ids=ids, positions=positions, slots=cache, cu_q=cu_q,
        context_lens=hi.astype(np.int32), kv_start=kv_start,
        num_pages=state.num_pages[slots], sample_rows=(cu_q[1:][wants_logits] - 1).astype(
            np.int64), sampled=slots[wants_logits], groups=groups, prefill_tokens=prefill,
    )
