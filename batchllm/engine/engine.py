"""The step loop: plan items in, finished rows out.

Each step: top up the waiting queue from the plan, schedule, run the model once over every
scheduled token, advance the counters, sample, stop, and hand finished rows back at once; with
engine.overlap the sampled ids are read, and rows stopped, one step later (`Engine.generate`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from batchllm.engine.future_tokens import FutureTokens
from batchllm.engine.grammar import Grammars
from batchllm.engine.metrics import EngineStats
from batchllm.engine.pages import PagePool
from batchllm.engine.request import Kind, Request
from batchllm.engine.row_slots import RowSlots
from batchllm.engine.runner import ModelRunner
from batchllm.engine.sampler import row_key
from batchllm.engine.scheduler import Scheduler
from batchllm.engine.step_tokens import Pending, StepTokens
from batchllm.engine.stopping import StopChecker
from batchllm.model.attention import FP8, PagedAttention
from batchllm.model.attention import kv_cache_dtype as kv_cache_dtype_of
from batchllm.model.decoder import DecoderModel
from batchllm.model.loader import LoadedModel
from batchllm.plan.planner import Plan
from batchllm.rows.record import Row

if TYPE_CHECKING:
    from batchllm.engine.device_runner import DeviceRunner


def make_runner(model: DecoderModel, attention: PagedAttention, page_size: int, cascade: bool,
                max_num_seqs: int, max_batched_tokens: int, max_model_len: int,
                cuda_graphs: bool) -> ModelRunner | DeviceRunner:
    """The runner of the model's path: ModelRunner, or the CUDA path's DeviceRunner
    (ModelOps.device_steps; imported only then)."""
    if not model.ops.device_steps:
        return ModelRunner(model, attention, page_size, cascade)
    from batchllm.engine.device_runner import DeviceRunner

    return DeviceRunner(model, attention, page_size, cascade, max_num_seqs, max_batched_tokens,
                        max_model_len, cuda_graphs)


class Engine:
    def __init__(
        self,
        loaded: LoadedModel,
        num_pages: int,
        page_size: int,
        max_num_seqs: int,
        max_batched_tokens: int,
        prefix_sharing: bool,
        max_model_len: int,
        cuda_graphs: bool = True,
        kv_cache_dtype: str = "auto",
        overlap: bool = False,
    ) -> None:
        """cuda_graphs: decode steps replayed as CUDA graphs on the CUDA path (on CUDA only;
        elsewhere that path's static decode buffers run eagerly). kv_cache_dtype: auto (the
        model's) or fp8 (model/attention.py). overlap: plan step N+1 before step N's sampled
        ids are read (`generate`); the same outputs either way."""
        shape = loaded.model.shape
        kv_dtype = kv_cache_dtype_of(kv_cache_dtype, loaded.model.dtype)
        scales = loaded.kv_scales
        kv_scales = (scales.k, scales.v) if scales is not None and kv_dtype == FP8 else None
        self.loaded = loaded
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.attention = PagedAttention(
            shape.num_layers, num_pages, page_size, shape.num_heads, shape.num_kv_heads,
            shape.head_dim, loaded.model.dtype, loaded.model.embed.device, loaded.model.ops,
            kv_dtype=kv_dtype, kv_scales=kv_scales,
        )
        self.runner = make_runner(loaded.model, self.attention, page_size, prefix_sharing,
                                  max_num_seqs, max_batched_tokens, max_model_len, cuda_graphs)
        self.stopper = StopChecker(loaded.tokenizer, loaded.eos_ids, max_model_len,
                                   batch_decode=loaded.model.embed.device.type != "cpu")
        self.grammars = Grammars(loaded.tokenizer, loaded.eos_ids, shape.vocab_size)
        self.num_pages = num_pages
        self.bytes_per_token = shape.kv_bytes_per_token(kv_dtype)
        self.max_model_len = max_model_len
        self._eos = np.array(sorted(loaded.eos_ids), dtype=np.int64)
        self.slots = RowSlots()  # made anew by each generate
        self.overlap = overlap
        # Where steps replay graphs, rows are admitted in bursts of an eighth of the slots
        # (Scheduler.burst): most steady-state steps decode-only; elsewhere at every step.
        graphs = getattr(self.runner, "graphs", None) is not None
        self.burst = max(1, max_num_seqs // 8) if graphs else 0

    def generate(
        self,
        rows: list[Row],
        plan: Plan,
        on_row: Callable[[Row], None],
        on_step: Callable[[EngineStats], None] | None = None,
    ) -> EngineStats:
        """Runs every item of the plan; `rows[k]` is the plan's row k. Each row gets its result
        and goes to on_row the moment it finishes.

        A step's sampled ids are issued on the device (future_tokens.py) and each row that sampled
        takes a placeholder for its next token (StepTokens.attach); they are read on the host, and
        the rows stopped, finished and freed, by StepTokens.resolve. Without overlap that follows at once;
        with it, once the next step's forward and sampling are launched: a row that stopped
        (end of sequence, a stop string, a grammar) rides along in that step, its token there
        discarded. A row that reaches a length limit is known without its token, and is not
        scheduled again. A step in which a constrained row samples holds the overlap: its mask
        needs the matcher to have seen the previous token, so that step's forward is launched,
        then the previous step resolved, then the mask filled and the step sampled."""
        pool = PagePool(self.num_pages)
        slots = self.slots = RowSlots(2 * self.max_num_seqs + 256)  # running and waiting
        self.runner.state = slots
        drawn = StepTokens(slots, self.grammars, self.stopper, self._eos, self.max_model_len)
        users = {int(n): int(c) for n, c in enumerate(plan.node_users)}
        sched = Scheduler(pool, self.page_size, self.max_num_seqs, self.max_batched_tokens, users,
                          slots, burst=self.burst)
        stats = EngineStats(kv_pages_total=self.num_pages, kv_bytes_per_token=self.bytes_per_token)
        future = FutureTokens(self.max_num_seqs, self.loaded.model.embed.device, self.overlap)
        node_logits: dict[int, torch.Tensor] = {}
        # prefixes whose last position's logits rows will sample their first token from
        terminal = set((plan.node_terminal > 0).nonzero()[0].tolist())
        kinds, ids = plan.item_kind, plan.item_id  # read as each item enters: no list of all
        cursor = 0
        window = self.max_num_seqs + 128
        pending: Pending | None = None  # the last step's ids, not yet read on the host
        while True:
            started = time.perf_counter()
            forward_seconds = drawn.kernel_seconds = 0.0  # the device's share of the step
            while cursor < len(kinds) and len(sched.waiting) < window:
                sched.add(self._request(int(kinds[cursor]), int(ids[cursor]), rows, plan,
                                        terminal))
                cursor += 1
            if not sched.has_work:
                break
            step = sched.schedule()
            # Partial pages of shared prefixes are copied even in a step that runs no token.
            self.attention.copy_pages([s for s, _ in step.copies], [d for _, d in step.copies])
            out = None
            logits, idx = None, np.zeros(0, dtype=np.int64)  # what samples: [S, V], slots [S]
            if len(step.slots):
                # its last position's logits are read: a row that ran to its end, or a prefix
                # rows sample from
                wants = slots.samples[step.slots] & (
                    slots.computed[step.slots] + step.counts == slots.total[step.slots])
                # every sampling row greedy and plain: the lm_head may hand back the argmax
                greedy = not step.from_prefix and bool(slots.greedy[step.slots[wants]].all())
                # without overlap every id is read before the next step: no placeholders
                out = self.runner.forward_step(step.slots, step.counts, wants, greedy,
                                               future if self.overlap else None)
                stats.prefill_tokens += out.prefill_tokens
                stats.steps_replayed += out.replayed
                forward_seconds = out.forward_seconds
                idx, logits = out.sampled, out.logits
                prefix = (~slots.is_row[idx]).nonzero()[0]
                if len(prefix):  # a prefix's logits are kept for the rows under it
                    for i in prefix.tolist():
                        node_logits[slots.owner[int(idx[i])].key] = logits[i]
                    keep = slots.is_row[idx].nonzero()[0]
                    idx, logits = idx[keep], logits[torch.from_numpy(keep)]
            sched.step_done(step)
            issued = None
            if out is not None and out.tokens is not None:
                issued = future.issue(out.tokens), None
            elif step.from_prefix:
                idx = np.concatenate([idx, [s.slot for s in step.from_prefix]]).astype(np.int64)
                logits = torch.stack([*(logits if logits is not None else []),
                                      *(node_logits[s.parent] for s in step.from_prefix)])
            if len(idx) and issued is None:
                if pending is not None and slots.constrained[idx].any():
                    drawn.resolve(pending, sched, rows, on_row, stats)  # hold the overlap
                    pending = None
                tokens, scored = drawn.sample(logits, idx)  # logits [S, V], idx [S]
                issued = future.issue(tokens), scored
            if pending is not None:
                stats.steps_overlapped += issued is not None  # launched before ids were read
                drawn.resolve(pending, sched, rows, on_row, stats)
                pending = None
            if issued is not None:
                pending = drawn.attach(idx, *issued, stats)
                if pending is not None and not self.overlap:
                    drawn.resolve(pending, sched, rows, on_row, stats)
                    pending = None
            for node in [n for n in node_logits if n not in sched.prefixes]:
                del node_logits[node]
            stats.steps += bool(len(step.slots) or step.from_prefix or step.copies)
            stats.preemptions = sched.preemptions
            stats.prefix_evictions = len(sched.prefixes.evicted)
            stats.kv_pages_in_use = pool.num_used
            stats.kv_pages_peak = pool.peak_used
            stats.kv_pages_shared = pool.num_shared
            stats.kv_pages_shared_peak = pool.peak_shared
            stats.waiting = len(sched.waiting) + len(kinds) - cursor
            stats.running = sched.num_running
            if on_step is not None:
                on_step(stats)
            elapsed = time.perf_counter() - started
            stats.step_host_seconds += elapsed - forward_seconds - drawn.kernel_seconds
        assert pending is None, "sampled ids left unread after the job"
        pool.check()
        assert pool.num_used == 0, "pages left in use after the job"
        return stats

    def _request(self, kind: int, key: int, rows: list[Row], plan: Plan,
                 terminal: set[int]) -> Request:
        if kind == 0:  # a shared prefix node
            src = rows[int(plan.node_source_row[key])].prompt_ids
            end = int(plan.node_end[key])
            return Request(Kind.PREFIX, key, src[:end], end, parent=int(plan.node_parent[key]),
                           wants_logits=key in terminal, state=self.slots)
        r = rows[key]
        sp = r.sampling
        matcher = self.grammars.matcher(sp)
        return Request(
            Kind.ROW, key, r.prompt_ids, len(r.prompt_ids), parent=int(plan.row_parent[key]),
            sampling=sp, rng_key=row_key(sp.seed, r.id, r.sample), matcher=matcher,
            state=self.slots,
            greedy=sp.temperature == 0 and matcher is None and not r.wants_logprobs,
        )
