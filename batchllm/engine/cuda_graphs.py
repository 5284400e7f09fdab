"""Decode-only steps replayed as CUDA graphs, one per batch-size bucket (and per whether the step
has shared-prefix groups, and whether it is greedy), captured the first time a bucket is used,
over the step buffers' fixed device addresses (step_buffers.py) and the device page table
(block_table.py), as nano-vllm's capture_cudagraph does. Prefill and mixed steps run eagerly
(device_runner.py); the scheduler admits rows in bursts where graphs replay, so that most steps
are decode-only (Scheduler.burst).

A greedy step (every row that samples takes the plain argmax) has the lm_head and the argmax in
its graph: the graph's output is the ids [bucket] int64, the only thing the host reads back; no
[rows, vocab] logits leave it.

A step of n decodes runs as its bucket's b >= n rows: the n - b padding rows read no keys
(context length 0), store nothing (slot -1) and are dropped after the forward. Groups are padded
the same way: the real groups first, then one group of prefix length 0 holding the ungrouped
and padding rows (its merge leaves their own part as it is), then empty groups. The graphs'
shapes are the bucket's only: split counts come from the bucket and max_model_len, never from
this step's lengths (the kernels split each sequence's own key range).

Where there is nothing to capture (no CUDA: BATCHLLM_BACKEND=triton on the CPU) the same static
path runs eagerly, so everything but the capture itself is what the tests run.
"""

from __future__ import annotations

import numpy as np
import torch

from batchllm.engine.step_batch import StepBatch
from batchllm.engine.step_buffers import StepBuffers
from batchllm.model.attention import PagedAttention, StepMetadata
from batchllm.model.decoder import DecoderModel


def buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes graphs are captured for: 1, 2, 4, 8, then every 16 (nano-vllm's)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return [*sizes, max_num_seqs]


class DecodeGraphs:
    def __init__(self, model: DecoderModel, attention: PagedAttention, buffers: StepBuffers,
                 table: torch.Tensor, page_size: int, max_num_seqs: int, max_model_len: int,
                 capture: bool) -> None:
        """table: the device page table [rows, max_pages] int32 (BlockTable.table). capture:
        record and replay graphs (CUDA); else run the static path eagerly."""
        self.model, self.attention, self.buffers = model, attention, buffers
        self.table, self.page_size, self.max_model_len = table, page_size, max_model_len
        self.sizes = buckets(max_num_seqs)
        self.capture = capture
        dev = buffers.device
        n = max_num_seqs
        self._arange32 = torch.arange(n + 1, dtype=torch.int32, device=dev)  # cu_q, decode_seqs
        self._arange64 = torch.arange(n, dtype=torch.int64, device=dev)  # sample rows
        # (bucket, cascade, greedy) -> the graph and its output
        self._graphs: dict[tuple[int, bool, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self.captured: list[tuple[int, bool, bool]] = []  # in capture order

    def bucket(self, n: int) -> int:
        return next(b for b in self.sizes if b >= n)

    def inputs(self, batch: StepBatch, rows: np.ndarray, greedy: bool
               ) -> tuple[dict, tuple[int, bool, bool]]:
        """A decode-only step's values for the step buffers, padded to its bucket, and the key
        of its graph (bucket, has groups, greedy). rows [B]: the sequences' device table rows;
        greedy: the graph ends in the argmax."""
        n = len(batch.seq_slots)
        b = self.bucket(n)
        pad = (0, b - n)
        values = {
            "ids": np.pad(batch.ids, pad),
            "positions": np.pad(batch.positions, pad),
            "slots": np.pad(batch.slots, pad, constant_values=-1),
            "seq_rows": np.pad(rows, pad),
            "context_lens": np.pad(batch.context_lens, pad),
            "kv_start": np.pad(batch.kv_start, pad),
        }
        if batch.groups:
            groups, real = b // 2 + 1, len(batch.groups)
            values["prefix_rows"] = [*(int(rows[g.lo]) for g in batch.groups),
                                     *[0] * (groups - real)]
            values["prefix_lens"] = [*(g.pages * self.page_size for g in batch.groups),
                                     *[0] * (groups - real)]
            values["cu_prefix_q"] = [0, *(g.hi for g in batch.groups), *[b] * (groups - real)]
        return values, (b, bool(batch.groups), greedy)

    def replay(self, key: tuple[int, bool, bool]) -> torch.Tensor:
        """The staged step through its bucket's graph (captured on first use) or, with nothing
        to capture, the same static path eagerly -> hidden states [bucket, H], or with greedy
        the argmax ids [bucket] int64; the step's rows first, in step order."""
        if not self.capture:
            return self._forward(*key)
        if key not in self._graphs:
            self._capture(key)
        graph, hidden = self._graphs[key]
        graph.replay()
        return hidden

    def _forward(self, b: int, cascade: bool, greedy: bool) -> torch.Tensor:
        """The model over the static buffers' first b rows -> hidden states [b, H], or with
        greedy their argmax ids [b] int64."""
        dev = self.buffers.dev
        meta = StepMetadata(
            slot_mapping=dev["slots"][:b],
            page_table=torch.index_select(self.table, 0, dev["seq_rows"][:b]),
            cu_q=self._arange32[: b + 1],
            context_lens=dev["context_lens"][:b],
            kv_start=dev["kv_start"][:b],
            decode_seqs=self._arange32[:b],
            max_context=self.max_model_len,
        )
        if cascade:
            groups = b // 2 + 1
            meta.cascade_rows = b
            meta.prefix_pages = torch.index_select(self.table, 0, dev["prefix_rows"][:groups])
            meta.prefix_lens = dev["prefix_lens"][:groups]
            meta.cu_prefix_q = dev["cu_prefix_q"][: groups + 1]
        self.attention.meta = meta
        hidden = self.model.hidden(dev["ids"][:b], dev["positions"][:b], self.attention,
                                   self._arange64[:b])  # [b, H]
        if not greedy:
            return hidden
        ids = self.model.greedy(hidden)  # [b] (a fused lm_head argmax), or None: no such kernel
        return ids if ids is not None else self.model.logits(hidden).argmax(-1)

    def _capture(self, key: tuple[int, bool, bool]) -> None:
        # The step's own inputs are already staged: the warm-up (which compiles every kernel
        # outside the capture) computes what the replay recomputes; the capture runs nothing.
        self._forward(*key)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            hidden = self._forward(*key)
        if self._pool is None:
            self._pool = graph.pool()
        self._graphs[key] = (graph, hidden)
        self.captured.append(key)
