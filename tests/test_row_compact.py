"""What keeps a job's per-row memory small (issue 27 item 2), on tiny inputs: the prefix tree's
chunked window compare gives the tree the one-round compare gives, prompt ids are uint16 where
they fit, admission keeps an all-good table as it is, and the final merge sizes its groups by
the lines' Arrow size."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchllm.plan import arrays as window_module
from batchllm.plan.tree import PrefixTree
from batchllm.rows import merge
from batchllm.rows.admission import admit_table
from batchllm.rows.build import _narrow
from batchllm.rows.record import Row
from batchllm.rows.table import RowTable, row_starts
from batchllm.sampling_params import SamplingParams

_TREE = ("order", "lcp", "node_parent", "node_end", "node_first", "node_last", "row_node")


def _prompts(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    head = rng.integers(0, 5, 9)
    return [np.concatenate((head[: rng.integers(0, 10)], rng.integers(0, 3, rng.integers(0, 37))))
            .astype(np.int32) for _ in range(n)]


def test_chunked_compare_gives_the_same_tree(monkeypatch):
    prompts = _prompts(300)
    whole = PrefixTree.build(prompts)
    for chunk in (1, 7, 64):  # tokens compared at once: fewer than a window, a few windows
        monkeypatch.setattr(window_module, "_CHUNK_ELEMS", chunk)
        chunked = PrefixTree.build(prompts)
        chunked.check()
        assert all(np.array_equal(getattr(whole, f), getattr(chunked, f)) for f in _TREE)


def test_uint16_tokens_give_the_same_tree():
    prompts = _prompts(200, seed=1)
    a = PrefixTree.build(prompts)
    b = PrefixTree.build([p.astype(np.uint16) for p in prompts])
    assert all(np.array_equal(getattr(a, f), getattr(b, f)) for f in _TREE)


def test_ids_narrowed_only_where_they_fit():
    assert _narrow(np.array([0, 65_535], np.int32)).dtype == np.uint16
    assert _narrow(np.array([1, 65_536], np.int32)).dtype == np.int32
    assert _narrow(np.zeros(0, np.int32)).dtype == np.uint16
    assert _narrow(np.array([3, 65_535], np.int32)).tolist() == [3, 65_535]


def test_row_starts_are_int32_until_the_ids_pass_int32():
    small = row_starts(np.array([3, -1, 4, 2], np.int32))  # -1: a row without ids
    assert small.dtype == np.int32 and small.tolist() == [0, 3, 3, 7]
    big = row_starts(np.array([2**31 - 1, 5, 3], np.int32))
    assert big.dtype == np.int64 and big.tolist() == [0, 2**31 - 1, 2**31 + 4]


def test_admission_keeps_an_all_good_table_itself():
    sp = SamplingParams(max_tokens=4)
    table = RowTable.of([Row(i, i, np.arange(1, 4 + i, dtype=np.int32), sp) for i in range(5)])
    kept, failed = admit_table(table, max_model_len=64)
    assert kept is table and failed == []
    # a row past the model's room is capped, one that cannot run fails; the others stay
    kept, failed = admit_table(table, max_model_len=7)  # prompts of 3..7 tokens
    assert [r.index for r in failed] == [4] and "the model allows 7" in failed[0].error
    assert kept.index.tolist() == [0, 1, 2, 3]
    assert [kept.settings[s].max_tokens for s in kept.setting] == [4, 3, 2, 1]


def test_merge_groups_sized_by_the_lines_arrow_size(tmp_path):
    lines = 500
    table = pa.table({"row": pa.array(range(lines), pa.int64()),
                      "text": pa.array(["the same words, again and again " * 8] * lines)})
    path = tmp_path / "part.parquet"
    pq.write_table(table, path)
    nbytes = sum(pq.ParquetFile(path).metadata.row_group(i).total_byte_size
                 for i in range(pq.ParquetFile(path).metadata.num_row_groups))
    part = merge.Part(str(path), table.select(["row"]), nbytes)
    per_line = merge._line_bytes([part], table.schema)
    assert nbytes / lines < table.nbytes / lines / 4  # Parquet's figure: dictionary-encoded
    assert per_line >= table.nbytes / lines  # the lines as read back: at least their size


def test_what_a_check_raises_is_that_rows_error(monkeypatch):
    """The admission guard (issue 27 item 1): a check that raises on one row (what the named
    checks miss) makes that row an error row with the exception's type and message; the other
    rows are admitted, in both admission entries."""
    from batchllm.rows import admission

    real = admission.problem_of

    def raising(error, sampling, prompt_tokens, *args):
        if prompt_tokens == 5:
            raise OverflowError("int too large to convert to float")
        return real(error, sampling, prompt_tokens, *args)

    monkeypatch.setattr(admission, "problem_of", raising)
    sp = SamplingParams(max_tokens=60)  # past the room of rows 2 and 3: they are checked
    rows = [Row(i, i, np.arange(1, 4 + i, dtype=np.int32), sp) for i in range(4)]
    kept, failed = admit_table(RowTable.of(rows), max_model_len=64)
    assert kept.index.tolist() == [0, 1, 3] and [r.index for r in failed] == [2]
    assert failed[0].error == "OverflowError: int too large to convert to float"
    assert [r.index for r in admission.admit(rows, max_model_len=64)] == [0, 1, 3]
    assert rows[2].error == "OverflowError: int too large to convert to float"
