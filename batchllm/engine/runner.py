"""Requests -> tensors -> logits: one step's flat inputs and attention metadata, the model run
once over them, the logits of the sequences that sample.

Two runners, one per path, both from the same host batch (step_batch.py):
  ModelRunner   the CPU path: tensors made from the batch's arrays each step, page tables from
                the sequences' page lists
  DeviceRunner  the CUDA path (ModelOps.device_steps, also on the CPU under
                BATCHLLM_BACKEND=triton): device_runner.py, which takes StepOutput from here
The engine picks one (engine.py `make_runner`).
"""

from __future__ import annotations

import time
from itertools import chain
from typing import NamedTuple

import numpy as np
import torch

from batchllm.engine.future_tokens import FutureTokens
from batchllm.engine.request import Request
from batchllm.engine.step_batch import StepBatch, build_batch
from batchllm.model.attention import PagedAttention, StepMetadata
from batchllm.model.decoder import DecoderModel


def page_table(seqs: list[Request]) -> np.ndarray:
    """[B, max pages] int32: row b holds seqs[b].pages, zeros after. One flat pass over the
    pages (itertools.chain), then a scatter: no numpy call per row."""
    lengths = np.array([len(s.pages) for s in seqs], dtype=np.int64)  # [B]
    table = np.zeros((len(seqs), int(lengths.max()) if len(seqs) else 0), dtype=np.int32)
    flat = np.fromiter(chain.from_iterable(s.pages for s in seqs), np.int32, int(lengths.sum()))
    starts = np.cumsum(lengths) - lengths  # [B]
    rows = np.repeat(np.arange(len(seqs)), lengths)
    table[rows, np.arange(len(flat)) - np.repeat(starts, lengths)] = flat
    return table


class StepOutput(NamedTuple):
    logits: torch.Tensor | None  # [S, V] fp32, one row per sequence in `sampled`
    sampled: list[Request]
    prefill_tokens: int  # prompt tokens fed through the forward pass in this step
    tokens: torch.Tensor | None = None  # [S] int64 instead of logits: their argmax, for a
    # greedy step (on the device: the engine reads them when it needs them)
    forward_seconds: float = 0.0  # host time spent in the model's forward (and lm_head)
    replayed: bool = False  # run from a captured CUDA graph


class ModelRunner:
    """The CPU path's runner."""

    def __init__(
        self, model: DecoderModel, attention: PagedAttention, page_size: int, cascade: bool
    ) -> None:
        self.model = model
        self.attention = attention
        self.page_size = page_size
        self.cascade = cascade
        self.device = model.embed.device

    def forward_step(
        self,
        seqs: list[Request],
        counts: list[int],
        wants_logits: list[bool],
        greedy: bool = False,
        future: FutureTokens | None = None,
    ) -> StepOutput:
        """greedy: every sequence that samples takes the argmax, which the lm_head may then
        return instead of the logits (StepOutput.tokens). future: where the placeholders among
        the sequences' ids (< 0: ids sampled last step, not yet read) are resolved."""
        batch = build_batch(seqs, counts, wants_logits, self.page_size, self.cascade)
        dev = self.device
        table = page_table(batch.seqs)  # [B, max_pages] int32
        meta = StepMetadata(
            slot_mapping=torch.from_numpy(batch.slots).to(dev),
            page_table=torch.from_numpy(table).to(dev),
            cu_q=torch.from_numpy(batch.cu_q).to(dev),
            context_lens=torch.from_numpy(batch.context_lens).to(dev),
            kv_start=torch.from_numpy(batch.kv_start).to(dev),
        )
        if batch.groups:
            self._add_cascade(meta, batch)
        self.attention.meta = meta
        ids = torch.from_numpy(batch.ids).to(dev)  # [T]
        if future is not None and batch.has_placeholders:
            ids = future.resolve(ids)
        t0 = time.perf_counter()
        h = self.model.hidden(
            ids,
            torch.from_numpy(batch.positions).to(dev),
            self.attention,
            torch.tensor(batch.sample_rows, dtype=torch.int64, device=dev),
        )  # [S, H]
        tokens = self.model.greedy(h) if greedy else None
        if tokens is not None:
            return StepOutput(None, batch.sampled, batch.prefill_tokens, tokens,
                              time.perf_counter() - t0)
        logits = self.model.logits(h)
        return StepOutput(logits, batch.sampled, batch.prefill_tokens, None,
                          time.perf_counter() - t0)

    def _add_cascade(self, meta: StepMetadata, batch: StepBatch) -> None:
        dev = self.device
        pages = np.zeros((len(batch.groups), max(g.pages for g in batch.groups)), dtype=np.int32)
        for g, group in enumerate(batch.groups):
            pages[g, : group.pages] = batch.seqs[group.lo].pages[: group.pages]
        meta.cascade_rows = batch.cascade_rows
        meta.prefix_pages = torch.from_numpy(pages).to(dev)
        meta.prefix_lens = torch.tensor([g.pages * self.page_size for g in batch.groups],
                                        dtype=torch.int32, device=dev)
        meta.cu_prefix_q = torch.from_numpy(batch.cu_q[[0, *(g.hi for g in batch.groups)]]).to(dev)

