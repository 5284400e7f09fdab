"""Log-probabilities as the sampling kernels leave them: one StepLogprobs per step (over the
step's scored rows), each row holding (step record, its index in it) per generated token.
A row's TokenLogprob records are made once, when it finishes (`records`), not per token per
step. The step's small tensors are not kept until its last row finishes: interleaved with each
step's large temporaries they fragmented glibc's heap (~400 MiB kept after a 64-row job, issue
27). On CUDA their copies to pinned host memory start with the step (`StepLogprobs.start`,
before the sampled ids' copy and its event); the step is turned into lists (`to_host`) when
its ids are read (StepTokens.resolve), after that event: no wait of its own.
"""

from __future__ import annotations

import torch

from batchllm.rows.record import TokenLogprob

_NINF = float("-inf")


def _to_pinned(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


class StepLogprobs:
    """One step's log-probabilities of its scored rows (row i of each tensor: the i-th)."""

    __slots__ = ("_lists", "_tensors")

    def __init__(self, tokens: torch.Tensor | list[int],  # [R] the chosen tokens
                 chosen: torch.Tensor,  # [R] fp32: the chosen token's logprob
                 top_lp: torch.Tensor,  # [R, kmax] fp32, best first
                 top_id: torch.Tensor,  # [R, kmax] int64
                 ) -> None:
        self._tensors: tuple | None = (tokens, chosen, top_lp, top_id)
        self._lists: tuple[list, list, list, list, bool] | None = None

    def start(self) -> StepLogprobs:
        """On CUDA, the tensors' non-blocking copies to pinned host memory started (to be read
        after an event recorded later on the stream); elsewhere nothing. Returns self."""
        tensors = self._tensors
        if tensors is not None and tensors[1].device.type == "cuda":
            self._tensors = tuple(_to_pinned(t) if isinstance(t, torch.Tensor) else t
                                  for t in tensors)
        return self

    def to_host(self) -> None:
        """The tensors turned into lists and let go (on CUDA: once their copies are done)."""
        if self._tensors is None:
            return
        tokens, chosen, top_lp, top_id = self._tensors
        self._tensors = None
        masked = bool(torch.isinf(top_lp).any())  # else no alternative is dropped
        self._lists = (tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens,
                       chosen.tolist(), top_id.tolist(), top_lp.tolist(), masked)

    def record(self, i: int, k: int) -> TokenLogprob:
        """Row i's record with its top k; alternatives the mask forbids (-inf) left out."""
        if self._lists is None:
            self.to_host()
        tokens, chosen, top_id, top_lp, masked = self._lists
        if masked:
            top = [(t, v) for t, v in zip(top_id[i][:k], top_lp[i][:k]) if v != _NINF]
        else:
            top = list(zip(top_id[i][:k], top_lp[i][:k]))
        return TokenLogprob(tokens[i], chosen[i], top)


def records(entries: list[tuple[StepLogprobs, int]] | None, k: int) -> list[TokenLogprob] | None:
    """A finished row's log-probabilities, one record per generated token."""
    if entries is None:
        return None
    return [step.record(i, k) for step, i in entries]
