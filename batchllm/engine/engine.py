"""The step loop: plan items in, finished rows out.

Each step: top up the waiting queue from the plan, schedule, run the model once over every
scheduled token, advance the counters, sample, stop, and hand finished rows back at once; with
engine.overlap the sampled ids are read, and rows stopped, one step later (`Engine.generate`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from batchllm.engine.future_tokens import FutureTokens, Issued
from batchllm.engine.grammar import Grammars
from batchllm.engine.metrics import EngineStats
from batchllm.engine.pages import PagePool
from batchllm.engine.request import Kind, Request
from batchllm.engine.row_slots import RowSlots
from batchllm.engine.runner import ModelRunner
from batchllm.engine.sampler import greedy_only, row_key, sample_ids, token_logprobs
from batchllm.engine.scheduler import Scheduler
from batchllm.engine.step_logprobs import StepLogprobs, records
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
        self.stopper = StopChecker(loaded.tokenizer, loaded.eos_ids, max_model_len)
        self.grammars = Grammars(loaded.tokenizer, loaded.eos_ids, shape.vocab_size)
        self.num_pages = num_pages
        self.bytes_per_token = shape.kv_bytes_per_token(kv_dtype)
        self.max_model_len = max_model_len
        self._eos = np.array(sorted(loaded.eos_ids), dtype=np.int64)
        self.slots = RowSlots()  # made anew by each generate
        self.overlap = overlap
        self._kernel_seconds = 0.0  # this step's forward and sampling kernels (and waits)

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
        takes a placeholder for its next token (`_attach`); they are read on the host, and the
        rows stopped, finished and freed, by `_resolve`. Without overlap that follows at once;
        with it, once the next step's forward and sampling are launched: a row that stopped
        (end of sequence, a stop string, a grammar) rides along in that step, its token there
        discarded. A row that reaches a length limit is known without its token, and is not
        scheduled again. A step in which a constrained row samples holds the overlap: its mask
        needs the matcher to have seen the previous token, so that step's forward is launched,
        then the previous step resolved, then the mask filled and the step sampled."""
        pool = PagePool(self.num_pages)
        self.slots = RowSlots(2 * self.max_num_seqs + 256)  # running and waiting rows
        users = {int(n): int(c) for n, c in enumerate(plan.node_users)}
        sched = Scheduler(pool, self.page_size, self.max_num_seqs, self.max_batched_tokens, users)
        stats = EngineStats(kv_pages_total=self.num_pages, kv_bytes_per_token=self.bytes_per_token)
        future = FutureTokens(self.max_num_seqs, self.loaded.model.embed.device)
        node_logits: dict[int, torch.Tensor] = {}
        # prefixes whose last position's logits rows will sample their first token from
        terminal = set(np.flatnonzero(plan.node_terminal > 0).tolist())
        kinds, ids = plan.item_kind, plan.item_id  # read as each item enters: no list of all
        cursor = 0
        window = self.max_num_seqs + 128
        pending: _Pending | None = None  # the last step's ids, not yet read on the host
        while True:
            started = time.perf_counter()
            self._kernel_seconds = 0.0  # the forward's and the sampling kernels' share
            while cursor < len(kinds) and len(sched.waiting) < window:
                sched.add(self._request(int(kinds[cursor]), int(ids[cursor]), rows, plan,
                                        terminal))
                cursor += 1
            if not sched.has_work:
                break
            step = sched.schedule()
            wants = [
                s.computed + n == len(s.token_ids) and (s.kind is Kind.ROW or s.wants_logits)
                for s, n in zip(step.seqs, step.num_tokens)
            ]
            # Partial pages of shared prefixes are copied even in a step that runs no token.
            self.attention.copy_pages([s for s, _ in step.copies], [d for _, d in step.copies])
            out = None
            if step.seqs:
                # every sampling row greedy and plain: the lm_head may hand back the argmax
                greedy = not step.from_prefix and bool(self.slots.greedy[
                    np.fromiter((s.slot for s, w in zip(step.seqs, wants) if w), np.int64)].all())
                out = self.runner.forward_step(step.seqs, step.num_tokens, wants, greedy, future)
                stats.prefill_tokens += out.prefill_tokens
                stats.steps_replayed += out.replayed
                self._kernel_seconds += out.forward_seconds
            sched.step_done(step)
            to_sample, sampling = [], []  # logits rows and the sequences they sample for
            issued = None
            if out is not None and out.tokens is not None:
                sampling = out.sampled
                issued = future.issue(out.tokens), None
            elif out is not None:
                for i, seq in enumerate(out.sampled):
                    if seq.kind is Kind.PREFIX:
                        node_logits[seq.key] = out.logits[i]
                    else:
                        to_sample.append(out.logits[i])
                        sampling.append(seq)
            for seq in step.from_prefix:
                to_sample.append(node_logits[seq.parent])
                sampling.append(seq)
            if to_sample:
                idx = np.fromiter((s.slot for s in sampling), np.int64, len(sampling))  # [S]
                if pending is not None and self.slots.constrained[idx].any():
                    self._resolve(pending, sched, rows, on_row, stats)  # hold the overlap
                    pending = None
                only_rows = not step.from_prefix and len(sampling) == out.logits.shape[0]
                logits = out.logits if only_rows else torch.stack(to_sample)  # [S, V]
                tokens, scored = self._sample(logits, sampling, idx)
                issued = future.issue(tokens), scored
            if pending is not None:
                stats.steps_overlapped += issued is not None  # launched before ids were read
                self._resolve(pending, sched, rows, on_row, stats)
                pending = None
            if issued is not None:
                pending = self._attach(sampling, *issued, stats)
                if pending is not None and not self.overlap:
                    self._resolve(pending, sched, rows, on_row, stats)
                    pending = None
            for node in [n for n in node_logits if n not in sched.prefixes]:
                del node_logits[node]
            stats.steps += bool(step.seqs or step.from_prefix or step.copies)
            stats.preemptions = sched.preemptions
            stats.prefix_evictions = len(sched.prefixes.evicted)
            stats.kv_pages_in_use = pool.num_used
            stats.kv_pages_peak = pool.peak_used
            stats.kv_pages_shared = pool.num_shared
            stats.kv_pages_shared_peak = pool.peak_shared
            stats.waiting = len(sched.waiting) + len(kinds) - cursor
            stats.running = len(sched.running)
            if on_step is not None:
                on_step(stats)
            stats.step_host_seconds += time.perf_counter() - started - self._kernel_seconds
        assert pending is None, "sampled ids left unread after the job"
        pool.check()
        assert pool.num_used == 0, "pages left in use after the job"
        return stats

    def _request(self, kind: int, key: int, rows: list[Row], plan: Plan,
                 terminal: set[int]) -> Request:
        if kind == 0:  # a shared prefix node
            src = rows[int(plan.node_source_row[key])].prompt_ids
            end = int(plan.node_end[key])
            return Request(
                Kind.PREFIX, key, src[:end].tolist(), end, parent=int(plan.node_parent[key]),
                wants_logits=key in terminal,
            )
        r = rows[key]
        seq = Request(
            Kind.ROW, key, r.prompt_ids.tolist(), len(r.prompt_ids),
            parent=int(plan.row_parent[key]), sampling=r.sampling,
            rng_key=row_key(r.sampling.seed, r.id, r.sample),
            matcher=self.grammars.matcher(r.sampling),
            logprobs=[] if r.wants_logprobs else None,
        )
        seq.slot = self.slots.take(seq.num_prompt_tokens, r.sampling, seq.rng_key,
                                   seq.matcher is not None, greedy_only(seq))
        return seq

    def _sample(self, logits, seqs: list[Request], idx: np.ndarray
                ) -> tuple[torch.Tensor, tuple[StepLogprobs, np.ndarray] | None]:
        """logits [S, V] fp32, one row per sequence of seqs (a fresh tensor or the step's own
        output: masked in place); idx [S]: their slots. Returns the sampled ids [S] (on the
        device, not read) and the log-probabilities of the rows that ask for them (with their
        indices into seqs). Adds the seconds of the sampling kernels to the step's."""
        slots = self.slots
        constrained = [i for i in np.flatnonzero(slots.constrained[idx]).tolist()
                       if not seqs[i].finished]
        if constrained:  # the masks are filled before the logits are first read: on CUDA the
            # fill overlaps the forward still in flight
            masks = self.grammars.bitmask([seqs[i].matcher for i in constrained])
            self.grammars.apply(logits, constrained, masks)
        temperature = slots.temperature[idx]
        started = time.perf_counter()
        tokens = sample_ids(logits, temperature, slots.top_k[idx], slots.top_p[idx],
                            slots.key[idx], slots.generated[idx])
        k = slots.logprobs[idx]
        scored = np.flatnonzero(k)
        got = None
        if len(scored):  # tensors; each row's records are made when it finishes
            every = len(scored) == len(seqs)
            sel = None if every else torch.from_numpy(scored).to(logits.device)
            got = token_logprobs(logits if every else logits[sel], temperature[scored],
                                 tokens if every else tokens[sel], k[scored]), scored
        self._kernel_seconds += time.perf_counter() - started
        return tokens, got

    def _attach(self, seqs: list[Request], issued: Issued,
                scored: tuple[StepLogprobs, np.ndarray] | None, stats) -> _Pending | None:
        """The sampling rows still live take their new token: counted (the draw counter
        advances), and, unless it is their last by a length limit, a placeholder in their ids
        for the next step to run. Rows found finished since the step was launched are left
        out: their token is discarded."""
        slots = self.slots
        live = [i for i, s in enumerate(seqs) if not s.finished]
        if not live:  # (None: nothing to read)
            return None
        if len(live) < len(seqs):
            seqs = [seqs[i] for i in live]
        idx = np.fromiter((s.slot for s in seqs), np.int64, len(seqs))  # [L]
        generated = slots.generated[idx] + 1
        slots.generated[idx] = generated
        last = (generated >= slots.max_tokens[idx]) | (
            slots.num_prompt[idx] + generated >= self.max_model_len)
        where = []  # each row's index of the new token in its ids; -1: appended when read
        for seq, j, end in zip(seqs, live, last.tolist()):
            if end:
                where.append(-1)
            else:
                where.append(len(seq.token_ids))
                seq.token_ids.append(-1 - issued.base - j)
        got = None
        if scored is not None:
            got, rows = scored
            entry = {int(i): n for n, i in enumerate(rows.tolist())}
            for seq, j in zip(seqs, live):
                n = entry.get(j)
                if n is not None:
                    seq.logprobs.append((got, n))
        stats.completion_tokens += len(seqs)
        return _Pending(seqs, idx, live, where, issued, got)

    def _resolve(self, pending: _Pending, sched, rows: list[Row], on_row, stats) -> None:
        """The step's ids read on the host and written into the rows; the finished ones go to
        on_row and their pages back to the pool. Only the rows a token may stop (end of
        sequence, a length limit, stop strings or a grammar) go through the stop checker, found
        from the slots' arrays."""
        values, waited = pending.issued.read()
        self._kernel_seconds += waited  # the device's time, not the host's
        if pending.logprobs is not None:  # its copies done with the ids' (the same event)
            pending.logprobs.to_host()
        seqs, idx, slots = pending.seqs, pending.idx, self.slots
        tokens = [values[j] for j in pending.index]
        for seq, at, tok in zip(seqs, pending.where, tokens):
            if at < 0:
                seq.token_ids.append(tok)
            else:
                seq.token_ids[at] = tok
        generated = slots.generated[idx]  # [S], this token counted
        maybe = slots.checked[idx] | (generated >= slots.max_tokens[idx])
        maybe |= slots.num_prompt[idx] + generated >= self.max_model_len
        eos = (np.asarray(tokens, dtype=np.int64)[:, None] == self._eos).any(axis=1)  # [S]
        maybe |= slots.eos_stops[idx] & eos  # (np.isin costs ~0.1 ms a call)
        maybe_seqs = [seqs[i] for i in np.flatnonzero(maybe).tolist()]
        broken = [seq.matcher is not None and not seq.matcher.consume_token(seq.token_ids[-1])
                  for seq in maybe_seqs]
        stopped = self.stopper.check_many([s for s, b in zip(maybe_seqs, broken) if not b])
        stopped.reverse()
        done = []
        for seq, bad in zip(maybe_seqs, broken):
            if not bad and not stopped.pop():
                continue
            done.append(seq)
            seq.finished = True
            stats.rows_done += 1
            row = rows[seq.key]
            if bad:  # cannot happen with the mask applied; an error row, not a crash
                row.fail(f"structured output: {seq.matcher.get_error()}")
            else:
                row.finish(seq.output_ids, self.stopper.final_text(seq), seq.finish_reason,
                           seq.cached_tokens, records(seq.logprobs, seq.sampling.logprobs))
            on_row(row)
        sched.finish_many(done)
        for seq in done:
            slots.give_back(seq.slot)


class _Pending(NamedTuple):
    """A step's sampled ids, attached to its live rows, not yet read on the host."""

    seqs: list[Request]  # the live sampling rows
    idx: np.ndarray  # [L] their slots
    index: list[int]  # each row's index in the step's ids
    where: list[int]  # each row's index of its new token in its ids; -1: appended when read
    issued: Issued
    logprobs: StepLogprobs | None  # the step's, lists made when the ids are read
