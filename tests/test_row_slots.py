"""engine/row_slots.py: a request's settings written once, read back by slot, slots reused."""

from __future__ import annotations

from batchllm.engine.row_slots import RowSlots
from batchllm.sampling_params import SamplingParams


def test_slots_hold_each_rows_settings_and_grow_past_their_capacity() -> None:
    slots = RowSlots(capacity=4)
    params = [SamplingParams(max_tokens=5 + i, temperature=0.5 * (i % 2), top_k=i, seed=i,
                             stop=("x",) if i % 3 == 0 else (), ignore_eos=i % 2 == 0,
                             logprobs=i % 4)
              for i in range(10)]
    taken = [slots.take(7 + i, sp, 1000 + i, matcher=i == 4, greedy=i % 2 == 0)
             for i, sp in enumerate(params)]
    assert len(set(taken)) == 10 and slots.capacity >= 10
    for i, s in enumerate(taken):
        sp = params[i]
        assert (slots.temperature[s], slots.top_k[s], slots.top_p[s]) == (
            sp.temperature, sp.top_k, sp.top_p)
        assert (int(slots.key[s]), slots.num_prompt[s], slots.max_tokens[s]) == (
            1000 + i, 7 + i, sp.max_tokens)
        assert slots.logprobs[s] == sp.logprobs and slots.generated[s] == 0
        assert slots.eos_stops[s] == (not sp.ignore_eos) and slots.greedy[s] == (i % 2 == 0)
        assert slots.checked[s] == (bool(sp.stop) or i == 4) and slots.constrained[s] == (i == 4)
    slots.generated[taken[3]] = 9
    slots.give_back(taken[3])
    again = slots.take(1, params[0], 1, matcher=False, greedy=True)
    assert again == taken[3] and slots.generated[again] == 0  # the counter starts over
