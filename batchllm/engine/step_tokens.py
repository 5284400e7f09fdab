"""A step's sampled tokens, from the logits to the finished rows: drawn (grammar masks, the
sampler, log-probabilities), attached to their rows as placeholders while still on the device,
then read on the host, stopped and finished (`Engine.generate` calls the three in turn, the
reading one step later with engine.overlap)."""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np
import torch

from batchllm.engine.future_tokens import Issued
from batchllm.engine.grammar import Grammars
from batchllm.engine.request import Request
from batchllm.engine.row_slots import RowSlots
from batchllm.engine.sampler import sample_ids, token_logprobs
from batchllm.engine.step_logprobs import StepLogprobs, records
from batchllm.engine.stopping import StopChecker
from batchllm.rows.record import Row


class StepTokens:
    """One generate's sampling rows' tokens. kernel_seconds: the sampling kernels' seconds and
    the waits for the ids in this step (the engine resets it each step; not host time)."""

    def __init__(self, slots: RowSlots, grammars: Grammars, stopper: StopChecker,
                 eos: np.ndarray, max_model_len: int) -> None:
        self.slots = slots
        self.grammars = grammars
        self.stopper = stopper
        self.eos = eos  # [E] int64 end-of-sequence ids
        self.max_model_len = max_model_len
        self.kernel_seconds = 0.0

    def sample(self, logits, seqs: list[Request], idx: np.ndarray
                ) -> tuple[torch.Tensor, tuple[StepLogprobs, np.ndarray] | None]:
        """logits [S, V] fp32, one row per sequence of seqs (a fresh tensor or the step's own
        output: masked in place); idx [S]: their slots. Returns the sampled ids [S] (on the
        device, not read) and the log-probabilities of the rows that ask for them (with their
        indices into seqs). Adds the sampling kernels' seconds to kernel_seconds."""
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
        self.kernel_seconds += time.perf_counter() - started
        return tokens, got

    def attach(self, seqs: list[Request], issued: Issued,
                scored: tuple[StepLogprobs, np.ndarray] | None, stats) -> Pending | None:
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
        return Pending(seqs, idx, live, where, issued, got)

    def resolve(self, pending: Pending, sched, rows: list[Row], on_row, stats) -> None:
        """The step's ids read on the host and written into the rows; the finished ones go to
        on_row and their pages back to the pool. Only the rows a token may stop (end of
        sequence, a length limit, stop strings or a grammar) go through the stop checker, found
        from the slots' arrays."""
        values, waited = pending.issued.read()
        self.kernel_seconds += waited  # the device's time, not the host's
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
        eos = (np.asarray(tokens, dtype=np.int64)[:, None] == self.eos).any(axis=1)  # [S]
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


class Pending(NamedTuple):
    """A step's sampled ids, attached to its live rows, not yet read on the host."""

    seqs: list[Request]  # the live sampling rows
    idx: np.ndarray  # [L] their slots
    index: list[int]  # each row's index in the step's ids
    where: list[int]  # each row's index of its new token in its ids; -1: appended when read
    issued: Issued
    logprobs: StepLogprobs | None  # the step's, lists made when the ids are read
