"""The CUDA path's device page table (batchllm/engine/block_table.py): exact rows and entries
written per step, a reset rewritten whole, idle rows taken back; the step buffers' staging
(step_buffers.py); the decode graphs' padded inputs (cuda_graphs.py). On the CPU: the same code
as on a GPU, with plain copies."""

from __future__ import annotations

import numpy as np
import torch

from batchllm.engine.block_table import BlockTable
from batchllm.engine.cuda_graphs import buckets
from batchllm.engine.request import Kind, Request
from batchllm.engine.row_slots import RowSlots
from batchllm.engine.step_buffers import StepBuffers

CPU = torch.device("cpu")


def seq(slots: RowSlots, pages: list[int], computed: int) -> Request:
    s = Request(Kind.ROW, 0, list(range(100)), 100, state=slots)
    s.set_pages(list(pages))
    s.computed = computed
    return s


def apply(table: BlockTable, seqs: list[Request]) -> tuple[list[int], list[int], list[int]]:
    rows, index, pages = table.update(np.array([s.slot for s in seqs]), seqs[0].state)
    table.write(torch.from_numpy(index), torch.from_numpy(pages))
    return rows.tolist(), index.tolist(), pages.tolist()


def test_only_new_pages_are_written():
    slots = RowSlots(4)
    table = BlockTable(4, 5, CPU)
    a, b = seq(slots, [7, 3], 0), seq(slots, [9], 0)
    assert apply(table, [a, b]) == ([0, 1], [0, 1, 5], [7, 3, 9])
    a.computed, b.computed = 20, 10
    assert apply(table, [a, b]) == ([0, 1], [], [])  # no new page: nothing to write
    a.add_pages([4])
    a.computed = 21
    assert apply(table, [a]) == ([0], [2], [4])
    assert table.table[0, :3].tolist() == [7, 3, 4] and table.table[1, 0] == 9


def test_a_reset_is_written_whole():
    """Preempted and admitted again: its pages replaced (here the same count, different ids:
    appending alone would miss them), then appended to again."""
    slots = RowSlots(2)
    table = BlockTable(2, 4, CPU)
    a = seq(slots, [1, 2, 3], 30)
    apply(table, [a])
    a.set_pages([5, 6, 8])
    a.computed = 0
    assert apply(table, [a]) == ([0], [0, 1, 2], [5, 6, 8])
    a.computed = 16  # it ran: advancing again
    a.add_pages([2])
    assert apply(table, [a]) == ([0], [3], [2])
    assert table.table[0].tolist() == [5, 6, 8, 2]


def test_a_slot_taken_by_a_new_sequence_is_written_whole():
    slots = RowSlots(1)
    table = BlockTable(2, 4, CPU)
    a = seq(slots, [1, 2], 5)
    apply(table, [a])
    slots.give_back(a.slot)
    b = seq(slots, [4, 9], 7)
    assert b.slot == a.slot
    assert apply(table, [b]) == ([0], [0, 1], [4, 9])


def test_idle_rows_are_taken_back():
    slots = RowSlots(4)
    table = BlockTable(2, 2, CPU)
    a, b, c = seq(slots, [1], 0), seq(slots, [2], 0), seq(slots, [3], 0)
    apply(table, [a])
    apply(table, [b])
    rows, index, _ = apply(table, [c])  # no free row: a's (least recently used) is taken back
    assert rows == [0] and index == [0]
    b.computed = 5
    assert apply(table, [b])[0] == [1]
    a.computed = 5
    rows, index, pages = apply(table, [a])  # a is back: written whole in a row of its own
    assert pages == [1] and rows in ([0], [1])


def test_step_buffers_stage_each_dtype_in_one_copy():
    buffers = StepBuffers({"ids": (torch.int64, 4), "rows": (torch.int64, 3),
                           "lens": (torch.int32, 2)}, CPU)
    buffers.stage({"rows": [5, 6], "ids": np.array([1, 2, 3]), "lens": [9]})
    assert buffers.dev["ids"][:3].tolist() == [1, 2, 3]
    assert buffers.dev["rows"][:2].tolist() == [5, 6] and buffers.dev["lens"][0] == 9
    buffers.stage({"ids": [4]})
    assert buffers.dev["ids"][0] == 4 and buffers.capacity("rows") == 3


def test_graph_buckets():
    assert buckets(256)[:6] == [1, 2, 4, 8, 16, 32] and buckets(256)[-1] == 256
    assert buckets(40) == [1, 2, 4, 8, 16, 32, 40] and buckets(1) == [1]


def test_graph_inputs_pad_the_step_to_its_bucket():
    """3 decodes, two of them in a group under one shared page: bucket 4; the padding row reads
    no keys and stores nothing; after the real group, one group of prefix length 0 holds the
    ungrouped and padding rows, then empty groups."""
    from batchllm.engine.cuda_graphs import DecodeGraphs
    from batchllm.engine.step_batch import build_batch

    buffers = StepBuffers({"x": (torch.int64, 1)}, CPU)
    graphs = DecodeGraphs(None, None, buffers, torch.zeros(1, 1, dtype=torch.int32), 16, 8, 64,
                          capture=False)
    slots = RowSlots(4)
    shared = [seq(slots, [7, 1], 17), seq(slots, [7, 2], 20), seq(slots, [3], 5)]
    for s in shared[:2]:
        s.num_borrowed_pages = 1
    for s in shared:
        s.append(5)  # one known id past its computed ones: a decode
    order = np.array([s.slot for s in [shared[2], *shared[:2]]])
    batch = build_batch(order, np.ones(3, dtype=np.int64), np.ones(3, dtype=bool), slots, 16,
                        cascade=True)
    values, key = graphs.inputs(batch, np.array([10, 11, 12]), greedy=True)
    values = {k: list(v) for k, v in values.items()}
    assert key == (4, True, True)
    assert values["slots"] == [17, 36, 53, -1] and values["context_lens"] == [18, 21, 6, 0]
    assert values["kv_start"] == [16, 16, 0, 0] and values["seq_rows"] == [10, 11, 12, 0]
    assert values["prefix_rows"] == [10, 0, 0] and values["prefix_lens"] == [16, 0, 0]
    assert values["cu_prefix_q"] == [0, 2, 4, 4]
