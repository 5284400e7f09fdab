"""Sampled ids that the host has not read yet: the overlapped step loop's placeholders.

With engine.overlap the host plans step N+1 before it reads step N's sampled ids (SGLang's
"future token ids", vLLM's async scheduling output placeholders). Step N's ids are written to
one of two halves of a device buffer (by step parity) and copied to the host without blocking;
a row that sampled in step N takes the placeholder -(1 + i) for its next token, i its id's index
in the buffer, and the runners swap placeholders for the ids on the device (`resolve`) before
the forward reads them. Placeholders live one step: the engine reads step N's ids (`Issued.read`)
and writes them into the rows before it plans step N+2, which writes the other half; so two
halves suffice, whatever a step's batch or a preempted row's recompute reads.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np
import torch


class Issued(NamedTuple):
    """One step's sampled ids, in flight: the device tensor, its host copy, and where the
    placeholders point."""

    tokens: torch.Tensor  # [S] int64 on the device
    host: torch.Tensor  # [S] int64 on the host (pinned on CUDA, filled by a non-blocking copy)
    event: torch.cuda.Event | None  # recorded after the copy (CUDA only)
    base: int  # index of tokens[0] in FutureTokens.dev: row i's placeholder is -(1 + base + i)
    kept: bool  # in FutureTokens.dev for the next step (False: read before it, no placeholder
    # written)

    def read(self) -> tuple[np.ndarray, float]:
        """The ids [S] int64 on the host and the seconds waited for the device to produce
        them."""
        t0 = time.perf_counter()
        if self.event is not None:
            self.event.synchronize()
        waited = time.perf_counter() - t0
        return self.host.numpy(), waited


class FutureTokens:
    def __init__(self, capacity: int, device: torch.device, keep: bool) -> None:
        """capacity: most sequences a step samples (max_num_seqs: each is a running one).
        keep: the step loop overlaps (engine.overlap). False: each step's ids are read before
        the next step is planned, so they are not kept on the device and no placeholders stand
        for them (StepTokens.attach; ~40 us a step on the CPU, both)."""
        self.capacity = capacity
        self.device = device
        self.keep = keep
        self.dev = torch.zeros(2 * capacity, dtype=torch.int64, device=device)  # two halves
        self._half = 0

    def issue(self, tokens: torch.Tensor) -> Issued:
        """Keep a step's sampled ids [S] on the device for the next step (with `keep`) and
        start their copy to the host; nothing here waits for the device."""
        s = tokens.shape[0]
        if s > self.capacity:
            raise ValueError(f"FutureTokens: {s} sampled ids, room for {self.capacity}")
        base = self._half * self.capacity
        self._half ^= 1
        if self.keep:
            self.dev[base : base + s].copy_(tokens)
        if self.device.type != "cuda":
            return Issued(tokens, tokens, None, base, self.keep)
        host = torch.empty(s, dtype=torch.int64, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return Issued(tokens, host, event, base, self.keep)

    def resolve(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] int64 on the device, placeholders (< 0) swapped for the ids they stand for;
        no host sync."""
        return torch.where(ids < 0, self.dev[(-1 - ids).clamp_(min=0)], ids)
