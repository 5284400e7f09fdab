"""The per-row settings and counters the step loop reads every step, held in arrays indexed by
a slot: written once when a Request is made, read by fancy indexing with a step's slots, the
slot given back when the request leaves the engine. What a step costs per row is then one
pass to collect the slots, not a list per setting rebuilt over every running row.

Every shared prefix has slot 0 (PREFIX_SLOT; never greedy: its logits are kept for the rows
under it, and it never samples), so that a step's slots index every sequence it runs.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from batchllm.sampling_params import SamplingParams

PREFIX_SLOT = 0


class RowSlots:
    _FIELDS: ClassVar[dict[str, type]] = {
        "temperature": np.float64,  # the SamplingParams value, as given
        "top_k": np.int64,  # 0 = off
        "top_p": np.float64,  # 1 = off
        "key": np.uint64,  # the row's generator key (sampler.row_key)
        "generated": np.int64,  # tokens generated so far: the draw counter
        "num_prompt": np.int64,
        "max_tokens": np.int64,
        "logprobs": np.int64,  # top alternatives asked for, 0 = none
        "greedy": np.bool_,  # sampler.greedy_only
        "eos_stops": np.bool_,  # not ignore_eos
        "checked": np.bool_,  # stop strings or a grammar: the stop checker sees every token
        "constrained": np.bool_,  # a grammar: its mask applies
    }

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        for name, dtype in self._FIELDS.items():
            setattr(self, name, np.zeros(capacity, dtype=dtype))
        self._free = list(range(capacity - 1, PREFIX_SLOT, -1))

    def _grow(self) -> None:
        old = self.capacity
        self.capacity *= 2
        for name, dtype in self._FIELDS.items():
            grown = np.zeros(self.capacity, dtype=dtype)
            grown[:old] = getattr(self, name)
            setattr(self, name, grown)
        self._free = list(range(self.capacity - 1, old - 1, -1))

    def take(self, num_prompt: int, sampling: SamplingParams, key: int,
             matcher: bool = False, greedy: bool = False) -> int:
        """A slot for a new row's request."""
        if not self._free:
            self._grow()
        s = self._free.pop()
        self.num_prompt[s] = num_prompt
        self.generated[s] = 0
        self.greedy[s] = greedy
        self.constrained[s] = matcher
        self.temperature[s] = sampling.temperature
        self.top_k[s] = sampling.top_k
        self.top_p[s] = sampling.top_p
        self.key[s] = key
        self.max_tokens[s] = sampling.max_tokens
        self.logprobs[s] = sampling.logprobs
        self.eos_stops[s] = not sampling.ignore_eos
        self.checked[s] = bool(sampling.stop) or matcher
        return s

    def give_back(self, slot: int) -> None:
        self._free.append(slot)
