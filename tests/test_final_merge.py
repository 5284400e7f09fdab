"""The final file written by streaming (rows/merge.py): the same file as concatenating and sorting
every part in one table (values bit for bit, order, schema, metadata), for Parquet and the OpenAI
Batch results, on parts in finishing order with n > 1 samples, log-probabilities, error rows and
lines written twice; and finalize's peak memory, measured in child processes, not growing with
the job's lines."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchllm.rows.openai_results import write_results
from batchllm.rows.record import Row, TokenLogprob
from batchllm.rows.samples import extra_fields
from batchllm.rows.writer import _PART_FIELDS, FINGERPRINT_KEY, CheckpointWriter, output_schema
from batchllm.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
FP = {"input": {"prompt_column": "prompt"}, "sampling": {"n": 3}, "numerics": {"dtype": "f32"}}


def finished(i: int, s: int, n: int, tokens: int, logprobs: int, fail: bool) -> Row:
    row = Row(i, f"r{i}", np.arange(5 + i % 7, dtype=np.int32),
              SamplingParams(max_tokens=tokens, n=n, logprobs=logprobs), f"prompt {i}", sample=s)
    if fail:
        row.fail(f"row {i}: prompt too long")
        return row
    ids = [(i * 31 + s * 7 + t) % 1000 for t in range(tokens)]
    lps = [TokenLogprob(t, -0.25 * (k + 1), [(t + j, -0.5 * (j + 1)) for j in range(logprobs)])
           for k, t in enumerate(ids)] if logprobs else None
    row.finish(ids, f"text {i}.{s} é", "length" if i % 4 else "stop", i % 5, lps)
    return row


def write_parts(out: Path, rows: int, n: int, tokens: int = 6, logprobs: int = 2,
                flush_rows: int = 7) -> CheckpointWriter:
    """Every (row, sample) in a shuffled finishing order, every 9th row an error row, a few
    lines written twice (a rerun after a crash), flushed as parts of flush_rows lines."""
    rng = np.random.default_rng(3)
    keys = [(i, s) for i in range(rows) for s in range(n)]
    keys = [keys[k] for k in rng.permutation(len(keys))]
    keys += keys[: len(keys) // 10]
    writer = CheckpointWriter(out, FP, flush_rows=flush_rows)
    for i, s in keys:
        writer.add(finished(i, s, n, tokens, logprobs, fail=i % 9 == 4))
    writer.flush()
    return writer


def concatenated(parts: Path, id_type: pa.DataType, metadata: dict) -> pa.Table:
    """The final table as finalize built it before streaming: every part in one table, sorted by
    (row, sample) with the first of repeated lines kept, cast to the final schema."""
    part_schema = pa.schema(_PART_FIELDS + [pa.field("id", id_type)])
    tables = [pq.read_table(p).select(part_schema.names).cast(part_schema)
              for p in sorted(parts.glob("part-*.parquet"))]
    table = pa.concat_tables(tables).sort_by([("row", "ascending"), ("sample", "ascending")])
    rows, samples = table["row"].to_numpy(), table["sample"].to_numpy()
    first = np.r_[True, (rows[1:] != rows[:-1]) | (samples[1:] != samples[:-1])]
    table = table.take(np.flatnonzero(first))
    schema = output_schema(id_type, True, True, extra_fields(table))
    return table.select(schema.names).cast(schema).replace_schema_metadata(metadata)


@pytest.mark.parametrize("n", [1, 3])
def test_streamed_file_equals_the_concatenated_one(tmp_path, n):
    out = tmp_path / "o.parquet"
    writer = write_parts(out, rows=40, n=n)
    shutil.copytree(writer.parts_dir, tmp_path / "parts")
    meta = {"batchllm.job": "merge", FINGERPRINT_KEY.decode(): json.dumps(FP, sort_keys=True)}
    done = writer.finalize(pa.string(), {"batchllm.job": "merge"}, True, True, num_rows=40,
                           group_bytes=4096)  # many groups
    expected = concatenated(tmp_path / "parts", pa.string(), meta)
    final = pq.read_table(out)
    assert final.equals(expected) and final.schema.metadata == expected.schema.metadata
    assert final["id"].to_pylist()[:3] == (["r0", "r0", "r0"] if n == 3 else ["r0", "r1", "r2"])
    assert pq.ParquetFile(out).num_row_groups > 3  # it was written group by group
    assert done.rows == 40 * n and done.rows_error == sum(n for i in range(40) if i % 9 == 4)


def test_streamed_results_jsonl_equal_those_of_the_whole_table(tmp_path):
    writer = write_parts(tmp_path / "o.jsonl", rows=30, n=3)
    shutil.copytree(writer.parts_dir, tmp_path / "parts")
    kinds = ["chat" if i % 2 else "completion" for i in range(30)]

    def piece(token_id: int, first: bool) -> tuple[str, bytes]:
        text = f"<{token_id}>" if first else f" <{token_id}>"
        return text, text.encode()

    def results(groups, schema, f):
        write_results(groups, f, kinds, "m", 7, piece)

    writer.finalize(pa.string(), {}, True, True, num_rows=30, write_final=results,
                    group_bytes=2048)
    whole = io.BytesIO()
    write_results(concatenated(tmp_path / "parts", pa.string(), {}), whole, kinds, "m", 7,
                  piece)
    lines = (tmp_path / "o.jsonl").read_bytes()
    assert lines == whole.getvalue() and len(lines.splitlines()) == 30


# -- memory: finalize's peak RSS in child processes ----------------------------------------------

_CHILD = """
import sys
import pyarrow as pa
from test_final_merge import write_parts
mode, out, lines, group = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if mode == "parts":
    write_parts(out, rows=lines, n=1, tokens=16, logprobs=5, flush_rows=256)
else:
    from batchllm.rows.writer import CheckpointWriter
    from test_final_merge import FP
    w = CheckpointWriter(out, FP)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak so far (the imports') forgotten: VmHWM is now the current RSS
    w.finalize(pa.string(), {}, False, True, num_rows=lines, group_bytes=group)
    status = open("/proc/self/status").read().split()
    print(int(status[status.index("VmHWM:") + 1]) * 1024)
"""


def _finalize_peak(tmp: Path, lines: int, group_bytes: int) -> int:
    """Peak RSS (bytes) during finalize in a fresh process, of `lines` lines of 16 tokens with 5
    log-probabilities each (the parts written by another process): Linux's peak RSS, reset just
    before finalize (/proc/self/clear_refs), so the imports' peak does not hide it."""
    out = tmp / f"{lines}-{group_bytes}" / "o.parquet"
    out.parent.mkdir()
    env = {"PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}",
           # the system allocator, one arena: its caches otherwise move the peak by +-5 MB
           "ARROW_DEFAULT_MEMORY_POOL": "system", "MALLOC_ARENA_MAX": "1"}
    for mode in ("parts", "finalize"):
        done = subprocess.run([sys.executable, "-c", _CHILD, mode, str(out), str(lines),
                               str(group_bytes)], capture_output=True, text=True, check=True,
                              cwd=ROOT, env={**os.environ, **env})
    assert pq.read_metadata(out).num_rows == lines
    return int(done.stdout.split()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux's peak RSS reset")
def test_finalize_memory_does_not_grow_with_the_lines(tmp_path):
    """Between 1,500 and 6,000 lines (about 1 KB each as parts hold them), finalize's peak grows
    by less than 400 bytes a line (measured: 160-210, the row index and its sort: a few arrays
    of 8 bytes a line); the same merge in one group (what concatenating every part did) grows
    by more than 2,000 bytes a line (measured: ~5,100), so the measurement can see what it
    rules out."""
    small, large = 1_500, 6_000
    streamed = _finalize_peak(tmp_path, large, 64 << 10) - _finalize_peak(tmp_path, small, 64 << 10)
    whole = _finalize_peak(tmp_path, large, 1 << 40) - _finalize_peak(tmp_path, small, 1 << 40)
    per_line = (streamed / (large - small), whole / (large - small))
    assert per_line[0] < 400 and per_line[1] > 2000, per_line
