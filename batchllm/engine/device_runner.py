"""The CUDA path's runner: a step's host batch (step_batch.py) -> the device -> logits, with as
little host work and as few transfers as the step allows.

- Page tables stay on the device (block_table.py): a step writes only the entries that changed
  (a decode step: a page every page_size tokens per sequence), and the kernels' [B, max_pages]
  table is gathered on the device from the sequences' rows.
- Every index array of a step goes over in one pinned, non-blocking copy per dtype into buffers
  at fixed device addresses (step_buffers.py); nothing here waits for the device. The only
  device-to-host transfer of a step is the sampled ids, in the engine.
- Decode-only steps are replayed as CUDA graphs per batch-size bucket (cuda_graphs.py; with
  engine.cuda_graphs, on CUDA); a greedy one ends in the argmax inside its graph and hands back
  only the ids. Prefill and mixed steps run eagerly, their decodes in the decode tile
  (ModelOps.tiles_decodes); the scheduler admits rows in bursts so that few steps are mixed.
- With engine.overlap the next step is planned before this one's sampled ids are read: they
  reach the next step's inputs as placeholders, resolved here on the device (future_tokens.py);
  without it, the engine reads the ids before it plans the next step.
On the CPU (BATCHLLM_BACKEND=triton) the same code runs with the Triton interpreter, the static
decode path eagerly.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from batchllm.engine.block_table import BlockTable
from batchllm.engine.cuda_graphs import DecodeGraphs
from batchllm.engine.future_tokens import FutureTokens
from batchllm.engine.row_slots import RowSlots
from batchllm.engine.runner import StepOutput
from batchllm.engine.step_batch import StepBatch, build_batch
from batchllm.engine.step_buffers import StepBuffers
from batchllm.model.attention import PagedAttention, StepMetadata
from batchllm.model.decoder import DecoderModel


class DeviceRunner:
    def __init__(self, model: DecoderModel, attention: PagedAttention, page_size: int,
                 cascade: bool, max_num_seqs: int, max_batched_tokens: int, max_model_len: int,
                 cuda_graphs: bool) -> None:
        self.model, self.attention = model, attention
        self.page_size, self.cascade = page_size, cascade
        dev = self.device = model.embed.device
        max_pages = -(-max_model_len // page_size) + 1
        # Rows for the running sequences and as many idle ones (taken back when needed).
        self.table = BlockTable(2 * max_num_seqs, max_pages, dev)
        i64, i32 = torch.int64, torch.int32
        tokens, seqs, groups = max(max_batched_tokens, max_num_seqs), max_num_seqs, \
            max_num_seqs // 2 + 1
        self.buffers = StepBuffers({
            "ids": (i64, tokens), "positions": (i64, tokens), "slots": (i64, tokens),
            "seq_rows": (i64, seqs), "prefix_rows": (i64, groups), "sample_rows": (i64, seqs),
            "cu_q": (i32, seqs + 1), "context_lens": (i32, seqs), "kv_start": (i32, seqs),
            "decode_seqs": (i32, seqs), "prefix_lens": (i32, groups),
            "cu_prefix_q": (i32, groups + 1),
            # Last: a step copies them only as far as it wrote them (all of a sequence's pages
            # at most, when it is first seen or was reset).
            "delta_index": (i64, seqs * max_pages), "delta_pages": (i32, seqs * max_pages),
        }, dev)
        self.state = RowSlots(1)  # the engine's, set by each generate
        self.graphs = None
        if cuda_graphs:
            self.graphs = DecodeGraphs(model, attention, self.buffers, self.table.table,
                                       page_size, max_num_seqs, max_model_len,
                                       capture=dev.type == "cuda")

    def forward_step(self, slots: np.ndarray, counts: np.ndarray, wants_logits: np.ndarray,
                     greedy: bool = False, future: FutureTokens | None = None) -> StepOutput:
        """As ModelRunner.forward_step. greedy: a decode-only step's graph takes the argmax and
        returns the ids (StepOutput.tokens, on the device); other steps return the logits.
        future: placeholders among the ids (< 0) are resolved from it in the staged buffer, on
        the device."""
        batch = build_batch(slots, counts, wants_logits, self.state, self.page_size,
                            self.cascade)
        rows, index, pages = self.table.update(batch.seq_slots, self.state)
        graph = self.graphs is not None and batch.decode_only
        values, key = (self.graphs.inputs(batch, rows, greedy) if graph else
                       (self._inputs(batch, rows), None))
        values.update(delta_index=index, delta_pages=pages)
        self.buffers.stage(values)
        dev = self.buffers.dev
        if future is not None and batch.has_placeholders:
            ids = dev["ids"][: len(values["ids"])]
            ids.copy_(future.resolve(ids))
        self.table.write(dev["delta_index"][: len(index)], dev["delta_pages"][: len(index)])
        t0 = time.perf_counter()
        replayed = False
        if graph:
            out = self.graphs.replay(key)  # [bucket, H], or greedy: [bucket] ids
            replayed = self.graphs.capture
            n = len(batch.seq_slots)
            out = out[:n] if len(batch.sample_rows) == n else out[
                torch.from_numpy(batch.sample_rows).to(self.device)]  # rare: a prefix's token
            if greedy:
                return StepOutput(None, batch.sampled, batch.prefill_tokens, out,
                                  time.perf_counter() - t0, replayed)
            hidden = out
        else:
            hidden = self._eager(batch)
        logits = self.model.logits(hidden)
        return StepOutput(logits, batch.sampled, batch.prefill_tokens, None,
                          time.perf_counter() - t0, replayed)

    def _inputs(self, batch: StepBatch, rows: np.ndarray) -> dict:
        values = {
            "ids": batch.ids, "positions": batch.positions, "slots": batch.slots,
            "seq_rows": rows, "sample_rows": batch.sample_rows, "cu_q": batch.cu_q,
            "context_lens": batch.context_lens, "kv_start": batch.kv_start,
            "decode_seqs": (batch.counts == 1).nonzero()[0],
        }
        if batch.groups:
            values["prefix_rows"] = [int(rows[g.lo]) for g in batch.groups]
            values["prefix_lens"] = [g.pages * self.page_size for g in batch.groups]
            values["cu_prefix_q"] = batch.cu_q[[0, *(g.hi for g in batch.groups)]]
        return values

    def _eager(self, batch: StepBatch) -> torch.Tensor:
        """The staged step, eagerly -> hidden states of the sampled rows [S, H]."""
        dev = self.buffers.dev
        t, b, s = batch.num_tokens, len(batch.seq_slots), len(batch.sample_rows)
        table = self.table.table
        meta = StepMetadata(
            slot_mapping=dev["slots"][:t],
            page_table=table[:, : batch.max_pages].index_select(0, dev["seq_rows"][:b]),
            cu_q=dev["cu_q"][: b + 1],
            context_lens=dev["context_lens"][:b],
            kv_start=dev["kv_start"][:b],
            decode_seqs=dev["decode_seqs"][: int((batch.counts == 1).sum())],
            max_context=int(batch.context_lens.max()),
        )
        if batch.groups:
            g = len(batch.groups)
            widest = max(group.pages for group in batch.groups)
            meta.cascade_rows = batch.cascade_rows
            meta.prefix_pages = table[:, :widest].index_select(0, dev["prefix_rows"][:g])
            meta.prefix_lens = dev["prefix_lens"][:g]
            meta.cu_prefix_q = dev["cu_prefix_q"][: g + 1]
        self.attention.meta = meta
        return self.model.hidden(dev["ids"][:t], dev["positions"][:t], self.attention,
                                 dev["sample_rows"][:s])
