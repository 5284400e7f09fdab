"""Requests -> tensors -> logits: builds one step's flat inputs and attention metadata, runs the
model, and returns the logits of the sequences that sample.

Cascade groups: sequences of the step that borrow the same leading pages of a shared prefix are
placed next to each other, and the prefix part of their attention runs once per group.
"""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

import numpy as np
import torch

from batchllm.engine.request import Sequence
from batchllm.model.attention import PagedAttention, StepMetadata
from batchllm.model.decoder import DecoderModel


class StepOutput(NamedTuple):
    logits: torch.Tensor  # [S, V] fp32, one row per sequence in `sampled`
    sampled: list[Sequence]
    prefill_tokens: int  # prompt tokens fed through the forward pass in this step


def _cascade_order(seqs: list[Sequence]) -> tuple[list[int], list[tuple[list[int], int]]]:
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


class ModelRunner:
    def __init__(
        self, model: DecoderModel, attention: PagedAttention, page_size: int, cascade: bool
    ) -> None:
        self.model = model
        self.attention = attention
        self.page_size = page_size
        self.cascade = cascade
        self.device = model.embed.device

    def run(
        self,
        seqs: list[Sequence],
        counts: list[int],
        wants_logits: list[bool],
    ) -> StepOutput:
        ps = self.page_size
        order, groups = _cascade_order(seqs) if self.cascade else (
            list(range(len(seqs))), [])
        ids, pos, slots = [], [], []
        cu_q, ctx, kv_start, sample_rows, sampled = [0], [], [], [], []
        shared_of = {i: shared for members, shared in groups for i in members}
        prefill = 0
        for i in order:
            seq, n = seqs[i], counts[i]
            lo, hi = seq.computed, seq.computed + n
            p = np.arange(lo, hi)
            pages = np.asarray(seq.pages, dtype=np.int64)
            ids.append(np.asarray(seq.token_ids[lo:hi], dtype=np.int64))
            pos.append(p)
            slots.append(pages[p // ps] * ps + p % ps)
            cu_q.append(cu_q[-1] + n)
            ctx.append(hi)
            kv_start.append(shared_of.get(i, 0) * ps)
            prefill += max(0, min(hi, seq.num_prompt_tokens) - lo)
            if wants_logits[i]:
                sample_rows.append(cu_q[-1] - 1)
                sampled.append(seq)
        max_pages = max(len(seqs[i].pages) for i in order)
        table = np.zeros((len(order), max_pages), dtype=np.int32)
        for row, i in enumerate(order):
            table[row, : len(seqs[i].pages)] = seqs[i].pages
        dev = self.device
        meta = StepMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev),
            page_table=torch.from_numpy(table).to(dev),
            cu_q=torch.tensor(cu_q, dtype=torch.int32, device=dev),
            context_lens=torch.tensor(ctx, dtype=torch.int32, device=dev),
            kv_start=torch.tensor(kv_start, dtype=torch.int32, device=dev),
        )
        if groups:
            self._add_cascade(meta, seqs, counts, groups)
        self.attention.meta = meta
        logits = self.model.forward(
            torch.from_numpy(np.concatenate(ids)).to(dev),
            torch.from_numpy(np.concatenate(pos)).to(dev),
            self.attention,
            torch.tensor(sample_rows, dtype=torch.int64, device=dev),
        )
        return StepOutput(logits, sampled, prefill)

    def _add_cascade(self, meta: StepMetadata, seqs, counts, groups) -> None:
        dev = self.device
        max_shared = max(shared for _, shared in groups)
        pages = np.zeros((len(groups), max_shared), dtype=np.int32)
        cu, lens = [0], []
        for g, (members, shared) in enumerate(groups):
            pages[g, :shared] = seqs[members[0]].pages[:shared]
            lens.append(shared * self.page_size)
            cu.append(cu[-1] + sum(counts[i] for i in members))
        meta.cascade_rows = cu[-1]
        meta.prefix_pages = torch.from_numpy(pages).to(dev)
        meta.prefix_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
        meta.cu_prefix_q = torch.tensor(cu, dtype=torch.int32, device=dev)
