"""Log-probabilities as the sampling kernels leave them: one StepLogprobs per step (tensors over
the step's scored rows), each row holding (step record, its index in it) per generated token.
A row's TokenLogprob records are made once, when it finishes (`records`), not per token per
step; a step's tensors are turned into lists once, the first time a finished row reads them.
"""

from __future__ import annotations

import torch

from batchllm.rows.record import TokenLogprob

_NINF = float("-inf")


class StepLogprobs:
    """One step's log-probabilities of its scored rows (row i of each tensor: the i-th)."""

    __slots__ = ("_lists", "chosen", "tokens", "top_id", "top_lp")

    def __init__(self, tokens: torch.Tensor | list[int],  # [R] the chosen tokens
                 chosen: torch.Tensor,  # [R] fp32: the chosen token's logprob
                 top_lp: torch.Tensor,  # [R, kmax] fp32, best first
                 top_id: torch.Tensor,  # [R, kmax] int64
                 ) -> None:
        self.tokens = tokens
        self.chosen, self.top_lp, self.top_id = chosen, top_lp, top_id
        self._lists: tuple[list, list, list, list, bool] | None = None

    def record(self, i: int, k: int) -> TokenLogprob:
        """Row i's record with its top k; alternatives the mask forbids (-inf) left out."""
        if self._lists is None:
            masked = bool(torch.isinf(self.top_lp).any())  # else no alternative is dropped
            tokens = self.tokens
            self._lists = (tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens,
                           self.chosen.tolist(), self.top_id.tolist(), self.top_lp.tolist(),
                           masked)
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
