"""The state of every sequence the engine holds (rows and shared prefixes), in arrays indexed by
a slot: its settings written once when its Request is made, its counters, generated ids and page
ids updated in place, read by fancy indexing with a step's slots, the slot given back when the
request leaves the engine. A step's per-sequence work is then numpy over its slots, not Python
over its Requests; a Request (request.py) reads and writes its own slot.

Three 2-D arrays, their widths grown (doubled) on demand: `out` [slot, g] the g-th generated id
(a placeholder < 0 until it is read, future_tokens.py), `lp_at` [slot, g] where its
log-probabilities are kept, `table` [slot, j] the j-th page id (0 from num_pages on).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from batchllm.sampling_params import SamplingParams


class RowSlots:
    _FIELDS: ClassVar[dict[str, type]] = {
        "temperature": np.float64,  # the SamplingParams value, as given
        "top_k": np.int64,  # 0 = off
        "top_p": np.float64,  # 1 = off
        "key": np.uint64,  # the row's generator key (sampler.row_key)
        "generated": np.int64,  # tokens generated so far: the draw counter
        "num_prompt": np.int64,  # a prefix: its tokens
        "max_tokens": np.int64,
        "logprobs": np.int64,  # top alternatives asked for, 0 = none
        "greedy": np.bool_,  # its next token is the plain argmax: a row at temperature 0, no
        # grammar, no logprobs (the lm_head need not write its logits)
        "eos_stops": np.bool_,  # not ignore_eos
        "checked": np.bool_,  # stop strings or a grammar: the stop checker sees every token
        "constrained": np.bool_,  # a grammar: its mask applies
        "is_row": np.bool_,  # a row (else a shared prefix)
        "samples": np.bool_,  # its last position's logits are read: a row, or a prefix rows
        # sample their first token from
        "finished": np.bool_,  # its result is out: a token sampled for it since is discarded
        "computed": np.int64,  # tokens whose KV is in the cache
        "total": np.int64,  # known ids: the prompt, then generated ones (placeholders too)
        "num_pages": np.int64,  # page ids in its `table` row
        "borrowed": np.int64,  # leading pages shared from its parent prefix (not written by it)
        "stop_skips": np.int64,  # tokens its stop-string scan may still leave undecoded in a
        # row, 0: the next is decoded (stopping.py)
        "stop_ends": np.int64,  # its stop strings' last characters, as StopChecker numbers them
        "fast_skipped": np.int64,  # tokens left undecoded by StopChecker.skip_many, not yet
        # counted by its scan
        "held": np.bool_,  # taken, not given back
        "renewed": np.bool_,  # its pages were replaced (not only appended to) since the CUDA
        # path's device table last copied them (block_table.py), or the slot is new
    }

    def __init__(self, capacity: int = 256, width: int = 16) -> None:
        self.capacity = capacity
        for name, dtype in self._FIELDS.items():
            setattr(self, name, np.zeros(capacity, dtype=dtype))
        self.out = np.zeros((capacity, width), dtype=np.int64)  # [slot, g] generated ids
        self.lp_at = np.zeros((capacity, width), dtype=np.int64)  # [slot, g] its log-probability
        # record's index in the LogprobLog (logprob_log.py)
        self.table = np.zeros((capacity, width), dtype=np.int32)  # [slot, j] page ids
        self.owner: list[object | None] = [None] * capacity  # the Request holding each slot
        self._free = list(range(capacity - 1, -1, -1))

    def _grow(self) -> None:
        old = self.capacity
        self.capacity *= 2
        for name, dtype in self._FIELDS.items():
            grown = np.zeros(self.capacity, dtype=dtype)
            grown[:old] = getattr(self, name)
            setattr(self, name, grown)
        for name in ("out", "lp_at", "table"):
            a = getattr(self, name)
            grown = np.zeros((self.capacity, a.shape[1]), dtype=a.dtype)
            grown[:old] = a
            setattr(self, name, grown)
        self.owner += [None] * old
        self._free = list(range(self.capacity - 1, old - 1, -1))

    def widen(self, name: str, width: int) -> None:
        """`out`, `lp_at` or `table` made at least `width` columns wide (doubling)."""
        a = getattr(self, name)
        if width <= a.shape[1]:
            return
        grown = np.zeros((a.shape[0], max(width, 2 * a.shape[1])), dtype=a.dtype)
        grown[:, : a.shape[1]] = a
        setattr(self, name, grown)

    def widen_out(self, width: int) -> None:
        """`out` and `lp_at` made at least `width` columns wide."""
        if width > self.out.shape[1]:
            self.widen("out", width)
            self.widen("lp_at", width)

    def take(self, num_prompt: int, sampling: SamplingParams | None, key: int = 0,
             matcher: bool = False, greedy: bool = False, samples: bool = True,
             owner: object | None = None) -> int:
        """A slot for a new request: a row's (sampling given), or a shared prefix's (none;
        samples: rows will sample from its last position's logits)."""
        if not self._free:
            self._grow()
        s = self._free.pop()
        self.owner[s] = owner
        self.table[s] = 0  # page ids past num_pages are 0: a step's page table is a plain gather
        self.num_prompt[s] = self.total[s] = num_prompt
        self.generated[s] = self.computed[s] = self.num_pages[s] = self.borrowed[s] = 0
        self.stop_skips[s] = self.fast_skipped[s] = 0
        self.finished[s] = False
        self.renewed[s] = self.held[s] = True
        self.greedy[s] = greedy
        self.constrained[s] = matcher
        self.is_row[s] = sampling is not None
        self.samples[s] = samples
        if sampling is None:
            self.max_tokens[s] = self.logprobs[s] = 0
            self.eos_stops[s] = self.checked[s] = False
            return s
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
        self.owner[slot] = None
        self.held[slot] = False
        self._free.append(slot)
