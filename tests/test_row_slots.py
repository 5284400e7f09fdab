"""engine/row_slots.py: a request's settings written once, read back by slot, slots reused."""

from __future__ import annotations

from batchllm.engine.pages import PagePool
from batchllm.engine.request import Kind, Request
from batchllm.engine.row_slots import RowSlots
from batchllm.engine.scheduler import Scheduler
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


def test_page_ids_past_a_slots_pages_are_zero() -> None:
    """The CPU runner reads a step's page table as a plain gather of the slots' rows: ids past
    a sequence's pages must be 0 after its pages are replaced (a preemption's reset, a prefix
    borrowed) or released, and in a slot taken again."""
    slots = RowSlots(capacity=2)
    a = Request(Kind.ROW, 0, [1, 2, 3], 3, state=slots)
    a.add_pages([5, 6, 7])
    a.set_pages([9])
    assert slots.table[a.slot, :4].tolist() == [9, 0, 0, 0]
    a.add_pages([4, 8])
    sched = Scheduler(PagePool(10), 4, 2, 16, state=slots)
    sched.pool.allocate(10)
    sched.finish_many([a])  # its pages released
    assert not slots.table[a.slot].any()
    slots.table[a.slot, :3] = [1, 2, 3]  # a slot given back with ids left in it
    slots.give_back(a.slot)
    b = Request(Kind.ROW, 1, [1], 1, state=slots)
    assert b.slot == a.slot and not slots.table[b.slot].any()
