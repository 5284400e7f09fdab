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
from typing import NamedTuple

import numpy as np
import torch

from batchllm.engine.future_tokens import FutureTokens
from batchllm.engine.row_slots import RowSlots
from batchllm.engine.step_batch import StepBatch, build_batch
from batchllm.model.attention import PagedAttention, StepMetadata
from batchllm.model.decoder import DecoderModel


class StepOutput(NamedTuple):
    logits: torch.Tensor | None  # [S, V] fp32, one row per sequence in `sampled`
    sampled: np.ndarray  # [S] int64: the slots of the sequences that sample
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
        self.state = RowSlots(1)  # the engine's, set by each generate

    def forward_step(
        self,
        slots: np.ndarray,
        counts: np.ndarray,
        wants_logits: np.ndarray,
        greedy: bool = False,
        future: FutureTokens | None = None,
    ) -> StepOutput:
        """slots [B], counts [B], wants_logits [B]: the step's sequences, the tokens each runs,
        whether its last position's logits are read. greedy: every sequence that samples takes
        the argmax, which the lm_head may then return instead of the logits
        (StepOutput.tokens). future: where the placeholders among the sequences' ids (< 0: ids
        sampled last step, not yet read) are resolved."""
        batch = build_batch(slots, counts, wants_logits, self.state, self.page_size,
                            self.cascade)
        dev = self.device
        table = self.state.table[batch.seq_slots, : batch.max_pages]  # [B, max_pages] int32,
        # 0 past each one's pages (RowSlots)
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
            torch.from_numpy(batch.sample_rows).to(dev),
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
            pages[g, : group.pages] = self.state.table[batch.seq_slots[group.lo], : group.pages]
        meta.cascade_rows = batch.cascade_rows
        meta.prefix_pages = torch.from_numpy(pages).to(dev)
        meta.prefix_lens = torch.tensor([g.pages * self.page_size for g in batch.groups],
                                        dtype=torch.int32, device=dev)
        meta.cu_prefix_q = torch.from_numpy(batch.cu_q[[0, *(g.hi for g in batch.groups)]]).to(dev)

