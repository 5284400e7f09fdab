"""The step loop: plan items in, finished rows out.

Each step: top up the waiting queue from the plan, schedule, run the model once over every
scheduled token, advance the counters, sample, stop, and hand finished rows back at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from batchllm.engine.pages import PagePool
from batchllm.engine.request import Kind, Sequence
from batchllm.engine.runner import ModelRunner
from batchllm.engine.sampler import sample
from batchllm.engine.scheduler import Scheduler
from batchllm.engine.stopping import StopChecker
from batchllm.model.attention import PagedAttention
from batchllm.model.loader import LoadedModel
from batchllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from batchllm.plan.planner import Plan


@dataclass(frozen=True)
class EngineRequest:
    row: int  # index of the row in the job
    prompt_ids: np.ndarray  # [P] int32
    sampling: SamplingParams
    rng_key: int  # from the job seed and the row id (sampler.row_key)


class RowResult(NamedTuple):
    row: int
    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int


@dataclass
class EngineStats:
    """Live and final counters, for the progress line and the metrics file."""

    kv_pages_total: int = 0
    kv_bytes_per_token: int = 0
    prefill_tokens: int = 0
    completion_tokens: int = 0
    rows_done: int = 0
    steps: int = 0
    preemptions: int = 0
    kv_pages_in_use: int = 0
    kv_pages_peak: int = 0
    kv_pages_shared: int = 0
    kv_pages_shared_peak: int = 0
    waiting: int = 0
    running: int = 0


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
    ) -> None:
        shape = loaded.model.shape
        self.loaded = loaded
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.attention = PagedAttention(
            shape.num_layers, num_pages, page_size, shape.num_heads, shape.num_kv_heads,
            shape.head_dim, loaded.model.dtype, loaded.model.embed.device,
        )
        self.runner = ModelRunner(loaded.model, self.attention, page_size, prefix_sharing)
        self.stopper = StopChecker(loaded.tokenizer, loaded.eos_ids, max_model_len)
        self.num_pages = num_pages
        self.bytes_per_token = shape.kv_bytes_per_token(loaded.model.dtype)

    def run(
        self,
        requests: list[EngineRequest],
        plan: Plan,
        on_result: Callable[[RowResult], None],
        on_step: Callable[[EngineStats], None] | None = None,
    ) -> EngineStats:
        """Runs every item of the plan; `requests[i]` is the plan's row i."""
        pool = PagePool(self.num_pages)
        users = {int(n): int(c) for n, c in enumerate(plan.node_users)}
        sched = Scheduler(pool, self.page_size, self.max_num_seqs, self.max_batched_tokens, users)
        stats = EngineStats(kv_pages_total=self.num_pages, kv_bytes_per_token=self.bytes_per_token)
        node_logits: dict[int, torch.Tensor] = {}
        # prefixes whose last position's logits rows will sample their first token from
        terminal = set(np.flatnonzero(plan.node_terminal > 0).tolist())
        kinds, ids = plan.item_kind.tolist(), plan.item_id.tolist()
        cursor = 0
        window = self.max_num_seqs + 128
        while True:
            while cursor < len(kinds) and len(sched.waiting) < window:
                sched.add(self._sequence(kinds[cursor], ids[cursor], requests, plan, terminal))
                cursor += 1
            if not sched.has_work:
                break
            step = sched.schedule()
            wants = [
                s.computed + n == s.total and (s.kind is Kind.ROW or s.wants_logits)
                for s, n in zip(step.seqs, step.num_tokens)
            ]
            # Partial pages of shared prefixes are copied even in a step that runs no token.
            self.attention.copy_pages([s for s, _ in step.copies], [d for _, d in step.copies])
            out = None
            if step.seqs:
                out = self.runner.run(step.seqs, step.num_tokens, wants)
                stats.prefill_tokens += out.prefill_tokens
            sched.step_done(step)
            to_sample, rows = [], []
            if out is not None:
                for i, seq in enumerate(out.sampled):
                    if seq.kind is Kind.PREFIX:
                        node_logits[seq.key] = out.logits[i]
                    else:
                        to_sample.append(out.logits[i])
                        rows.append(seq)
            for seq in step.from_prefix:
                to_sample.append(node_logits[seq.parent])
                rows.append(seq)
            if rows:
                only_rows = not step.from_prefix and len(rows) == out.logits.shape[0]
                logits = out.logits if only_rows else torch.stack(to_sample)  # [S, V]
                self._sample(logits, rows, sched, on_result, stats)
            for node in [n for n in node_logits if n not in sched.prefixes]:
                del node_logits[node]
            stats.steps += 1
            stats.preemptions = sched.preemptions
            stats.kv_pages_in_use = pool.num_used
            stats.kv_pages_peak = pool.peak_used
            stats.kv_pages_shared = pool.num_shared
            stats.kv_pages_shared_peak = pool.peak_shared
            stats.waiting = len(sched.waiting) + len(kinds) - cursor
            stats.running = len(sched.running)
            if on_step is not None:
                on_step(stats)
        pool.check()
        assert pool.num_used == 0, "pages left in use after the job"
        return stats

    def _sequence(self, kind: int, key: int, requests, plan: Plan, terminal: set[int]) -> Sequence:
        if kind == 0:  # a shared prefix node
            src = requests[int(plan.node_source_row[key])].prompt_ids
            end = int(plan.node_end[key])
            return Sequence(
                Kind.PREFIX, key, src[:end].tolist(), end, parent=int(plan.node_parent[key]),
                wants_logits=key in terminal,
            )
        r = requests[key]
        return Sequence(
            Kind.ROW, key, r.prompt_ids.tolist(), len(r.prompt_ids),
            parent=int(plan.row_parent[key]), sampling=r.sampling, rng_key=r.rng_key,
        )

    def _sample(self, logits, rows: list[Sequence], sched, on_result, stats) -> None:
        sp = [s.sampling for s in rows]
        tokens = sample(
            logits,
            [p.temperature for p in sp],
            [p.top_k for p in sp],
            [p.top_p for p in sp],
            [s.rng_key for s in rows],
            [len(s.output_ids) for s in rows],
        )
        for seq, tok in zip(rows, tokens):
            seq.token_ids.append(tok)
            stats.completion_tokens += 1
            if self.stopper.check(seq):
                sched.finish(seq)
                stats.rows_done += 1
                on_result(RowResult(
                    seq.key, seq.output_ids, self.stopper.final_text(seq), seq.finish_reason,
                    seq.num_prompt_tokens, seq.cached_tokens,
                ))
