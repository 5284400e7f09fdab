"""Log-probabilities as the sampling kernels leave them: one StepLogprobs per step, over the
step's scored rows. On CUDA their copies to pinned host memory start with the step
(`StepLogprobs.start`, before the sampled ids' copy and its event); when the step's ids are read
(StepTokens.resolve, after that event: no wait of its own) the step becomes host arrays
(`to_host`) and its records go to the LogprobLog (logprob_log.py). The step's small tensors are
not kept longer: interleaved with each step's large temporaries they fragmented glibc's heap
(~400 MiB kept after a 64-row job, issue 27).
"""

from __future__ import annotations

import numpy as np
import torch


def _to_pinned(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


class StepLogprobs:
    """One step's log-probabilities of its scored rows (row i of each tensor: the i-th)."""

    __slots__ = ("_arrays", "_tensors")

    def __init__(self, tokens: torch.Tensor | list[int],  # [R] the chosen tokens
                 chosen: torch.Tensor,  # [R] fp32: the chosen token's logprob
                 top_lp: torch.Tensor,  # [R, kmax] fp32, best first
                 top_id: torch.Tensor,  # [R, kmax] int64
                 ) -> None:
        self._tensors: tuple | None = (tokens, chosen, top_lp, top_id)
        self._arrays: tuple | None = None

    def start(self) -> StepLogprobs:
        """On CUDA, the tensors' non-blocking copies to pinned host memory started (to be read
        after an event recorded later on the stream); elsewhere nothing. Returns self."""
        tensors = self._tensors
        if tensors is not None and tensors[1].device.type == "cuda":
            self._tensors = tuple(_to_pinned(t) if isinstance(t, torch.Tensor) else t
                                  for t in tensors)
        return self

    def to_host(self) -> None:
        """The tensors turned into host arrays and let go (on CUDA: once their copies are
        done)."""
        if self._tensors is None:
            return
        self._arrays = tuple(t.numpy(force=True) if isinstance(t, torch.Tensor)
                             else np.asarray(t, dtype=np.int64) for t in self._tensors)
        self._tensors = None

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(tokens [R], chosen [R], top_lp [R, kmax], top_id [R, kmax]) on the host."""
        self.to_host()
        return self._arrays
