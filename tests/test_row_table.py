"""RowTable (rows/table.py) holds the same rows as Row objects do: each table[k] equals the Row
it packs, n samples expand as Row.samples does, and a subset keeps each row whole."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from batchllm.rows.record import Row
from batchllm.rows.table import RowTable
from batchllm.sampling_params import SamplingParams

FIELDS = ("index", "id", "sampling", "prompt", "error", "sample", "finish_reason", "token_ids")


def same(a: Row, b: Row) -> bool:
    ids = (a.prompt_ids is None and b.prompt_ids is None) or (
        a.prompt_ids is not None and b.prompt_ids is not None
        and np.array_equal(a.prompt_ids, b.prompt_ids))
    return ids and all(getattr(a, f) == getattr(b, f) for f in FIELDS)


def rows() -> list[Row]:
    three = SamplingParams(n=3, temperature=0.5)
    plain = SamplingParams(max_tokens=7)
    return [
        Row(0, "a", np.array([5, 6, 7], np.int32), plain, "p0"),
        Row(1, "b", None, plain, None, "input.prompt: the prompt is null"),
        Row(2, "c", np.array([5, 6], np.int32), three),
        Row(3, "d", np.array([9], np.int32), SamplingParams(n=0), None),  # invalid n: one record
        Row(4, "e", np.array([1, 2, 3, 4], np.int32), three, "p4", "planted error"),
    ]


def test_table_rows_are_the_rows_it_packs():
    given = rows()
    table = RowTable.of(given)
    assert len(table) == len(given) and len(table.settings) == 3  # shared settings kept once
    assert all(same(a, b) for a, b in zip(table, given))
    assert table.prompt_tokens().tolist() == [r.prompt_tokens for r in given]
    assert table.max_tokens().tolist() == [r.sampling.max_tokens for r in given]


def test_samples_expand_as_row_samples():
    given = rows()
    expected = [r for row in given for r in row.samples()]
    got = list(RowTable.of(given).with_samples())
    assert [(r.index, r.sample) for r in got] == [(r.index, r.sample) for r in expected]
    assert all(same(a, b) for a, b in zip(got, expected))


def test_a_subset_keeps_ids_errors_and_prompts_with_their_rows():
    given = rows()
    for ids in (pa.array([r.id for r in given]), [r.id for r in given]):
        table = RowTable.of(given)
        table.ids = ids
        keep = [4, 0, 1]
        assert all(same(a, given[k]) for a, k in zip(table.taken(np.array(keep)), keep))


def test_listed_is_row_listed_in():
    table = RowTable.of(rows()).with_samples()
    keys = {0, (2, 1), (4, 0), 3}
    assert table.listed(keys).tolist() == [r.listed_in(keys) for r in table]
    assert not table.listed(set()).any()
