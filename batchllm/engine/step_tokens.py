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
from batchllm.engine.logprob_log import LogprobLog
from batchllm.engine.row_slots import RowSlots
from batchllm.engine.sampler import sample_ids, token_logprobs
from batchllm.engine.step_logprobs import StepLogprobs
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
        self.log = LogprobLog(slots)
        self.kernel_seconds = 0.0

    def sample(self, logits, idx: np.ndarray
               ) -> tuple[torch.Tensor, tuple[StepLogprobs, np.ndarray] | None]:
        """logits [S, V] fp32, one row per sequence sampling (a fresh tensor or the step's own
        output: masked in place, then overwritten by token_logprobs); idx [S]: their slots.
        Returns the sampled ids [S] (on the device, not read) and the log-probabilities of the
        rows that ask for them (with their indices into idx). Adds the sampling kernels'
        seconds to kernel_seconds."""
        slots = self.slots
        constrained = (slots.constrained[idx] & ~slots.finished[idx]).nonzero()[0].tolist()
        if constrained:  # the masks are filled before the logits are first read: on CUDA the
            # fill overlaps the forward still in flight
            owner = slots.owner
            masks = self.grammars.bitmask([owner[int(idx[i])].matcher for i in constrained])
            self.grammars.apply(logits, constrained, masks)
        temperature = slots.temperature[idx]
        started = time.perf_counter()
        tokens = sample_ids(logits, temperature, slots.top_k[idx], slots.top_p[idx],
                            slots.key[idx], slots.generated[idx])
        k = slots.logprobs[idx]
        scored = k.nonzero()[0]
        got = None
        if len(scored):  # tensors; each row's records are made when it finishes
            every = len(scored) == len(idx)
            sel = None if every else torch.from_numpy(scored).to(logits.device)
            got = token_logprobs(logits if every else logits[sel], temperature[scored],
                                 tokens if every else tokens[sel], k[scored]), scored
        self.kernel_seconds += time.perf_counter() - started
        return tokens, got

    def attach(self, idx: np.ndarray, issued: Issued,
               scored: tuple[StepLogprobs, np.ndarray] | None, stats) -> Pending | None:
        """The sampling rows (slots idx [S]) still live take their new token: counted (the draw
        counter advances), and, unless it is their last by a length limit, a placeholder
        among their ids for the next step to run. Rows found finished since the step was
        launched are left out: their token is discarded."""
        slots = self.slots
        live = (~slots.finished[idx]).nonzero()[0]  # [L] indices into the step's ids
        if not len(live):  # (None: nothing to read)
            return None
        sl = idx[live]  # [L]
        generated = slots.generated[sl] + 1
        slots.generated[sl] = generated
        last = (generated >= slots.max_tokens[sl]) | (
            slots.num_prompt[sl] + generated >= self.max_model_len)
        slots.widen_out(int(generated.max()))
        go = ~last  # the rest take their token when it is read
        if issued.kept:  # else read before any step could meet a placeholder
            slots.out[sl[go], generated[go] - 1] = -1 - issued.base - live[go]
        slots.total[sl[go]] += 1
        stats.completion_tokens += len(sl)
        return Pending(sl, live, generated, last, issued, scored)

    def resolve(self, pending: Pending, sched, rows: list[Row], on_row, stats) -> None:
        """The step's ids read on the host and written into the rows; the finished ones go to
        on_row and their pages back to the pool. Only the rows a token may stop (end of
        sequence, a length limit, stop strings or a grammar) go through the stop checker, found
        from the slots' arrays."""
        values, waited = pending.issued.read()
        self.kernel_seconds += waited  # the device's time, not the host's
        sl, slots = pending.slots, self.slots
        if pending.logprobs is not None:  # its copies done with the ids' (the same event)
            step, scored = pending.logprobs
            record = np.full(len(pending.issued.tokens), -1, dtype=np.int64)
            record[scored] = np.arange(len(scored))  # each id's record in the step, -1: none
            mine = record[pending.index]  # [L]
            keep = mine >= 0
            self.log.add(step, mine[keep], sl[keep], pending.generated[keep] - 1)
        tokens = values[pending.index]  # [L]
        slots.out[sl, pending.generated - 1] = tokens
        slots.total[sl[pending.last]] += 1  # appended now: no placeholder was
        eos = slots.eos_stops[sl]  # [L]: rows an end of sequence stops, then those it did
        if eos.any():  # one comparison per id (np.isin: ~0.1 ms; [L, E].any(axis=1): ~13 us)
            hit = np.zeros(len(tokens), dtype=bool)
            for e in self.eos.tolist():
                hit |= tokens == e
            eos &= hit
        maybe = slots.checked[sl] | pending.last | eos  # [L]
        # rows checked for their stop strings alone, whose token cannot end one: no check
        plain = (maybe & ~(slots.constrained[sl] | pending.last | eos)).nonzero()[0]
        if len(plain):
            maybe[plain[self.stopper.skip_many(slots, sl[plain], tokens[plain])]] = False
        at = maybe.nonzero()[0]
        if not len(at):
            return
        owner = slots.owner
        maybe_seqs = [owner[s] for s in sl[at].tolist()]
        broken = [seq.matcher is not None and not seq.matcher.consume_token(tok)
                  for seq, tok in zip(maybe_seqs, tokens[at].tolist())]
        stopped = self.stopper.check_many([s for s, b in zip(maybe_seqs, broken) if not b])
        stopped.reverse()
        done = [(seq, broke) for seq, broke in zip(maybe_seqs, broken)
                if broke or stopped.pop()]
        if not done:
            return
        texts = iter(self.stopper.final_texts([seq for seq, broke in done if not broke]))
        scored = np.array([seq.slot for seq, broke in done
                           if not broke and seq.sampling.logprobs], dtype=np.int64)  # [F]
        held = slots.total[scored] - slots.num_prompt[scored]  # [F] each one's num_generated
        records = iter(self.log.take(scored, held, slots.logprobs[scored]))
        for seq, broke in done:
            row = rows[seq.key]  # (a RowTable makes a Row each time it is indexed)
            if broke:  # cannot happen with the mask applied; an error row, not a crash
                row.fail(f"structured output: {seq.matcher.get_error()}")
            else:
                row.finish(seq.output_ids, next(texts), seq.finish_reason, seq.cached_tokens,
                           next(records) if seq.sampling.logprobs else None)
            slots.finished[seq.slot] = True
            stats.rows_done += 1
            on_row(row)
        sched.finish_many([seq for seq, _ in done])
        for seq, _ in done:
            slots.give_back(seq.slot)


class Pending(NamedTuple):
    """A step's sampled ids, attached to its live rows, not yet read on the host."""

    slots: np.ndarray  # [L] the live sampling rows' slots
    index: np.ndarray  # [L] each one's index in the step's ids
    generated: np.ndarray  # [L] its draw counter with this token: out[slot, generated - 1]
    last: np.ndarray  # [L] bool: its last token (a length limit), appended when read
    issued: Issued
    logprobs: tuple[StepLogprobs, np.ndarray] | None  # the step's, and the indices of its
    # scored rows among its ids; to the log when the ids are read
