"""Rows out: checkpoint parts, resume, final file order/schema/metadata, atomic writes."""

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchllm.config import ConfigError
from batchllm.rows.lock import OutputLock
from batchllm.rows.record import Row
from batchllm.rows.writer import CheckpointWriter, output_schema, write_metrics
from batchllm.sampling_params import SamplingParams
from batchllm_kernels import atomic_write

FP = {"job": "legal", "model": "smollm2-135m-instruct", "sampling": {"max_tokens": 8}}


def _row(i: int, ok: bool = True, row_id: object = None) -> Row:
    row = Row(i, f"r{i}" if row_id is None else row_id, np.arange(10 + i, dtype=np.int32),
              SamplingParams(max_tokens=8), f"prompt {i}")
    if ok:
        row.finish([i, i + 1], f"text {i}", "length", 4)
    else:
        row.fail("prompt too long")
    return row


def test_parts_flush_by_count_and_carry_fingerprint(tmp_path):
    out = tmp_path / "out" / "legal.parquet"
    w = CheckpointWriter(out, FP, flush_rows=2, flush_seconds=1e9)
    for i in (4, 1, 3):
        w.add(_row(i))
    assert sorted(os.listdir(w.parts_dir)) == ["part-00000.parquet"]
    w.flush()
    w.flush()  # nothing buffered: no empty part
    assert sorted(os.listdir(w.parts_dir)) == ["part-00000.parquet", "part-00001.parquet"]
    part = pq.read_table(os.path.join(w.parts_dir, "part-00000.parquet"))
    assert part.column("row").to_pylist() == [4, 1]
    assert json.loads(part.schema.metadata[b"batchllm.fingerprint"]) == FP
    assert w.done_rows() == {1, 3, 4}


def test_flush_by_time(tmp_path):
    w = CheckpointWriter(tmp_path / "o.parquet", FP, flush_rows=100, flush_seconds=0.0)
    w.add(_row(0))
    assert w.has_checkpoint()


def test_resume_continues_numbering_and_finalizes_everything(tmp_path):
    out = tmp_path / "legal.parquet"
    first = CheckpointWriter(out, FP, flush_rows=2)
    for i in (2, 0, 5):
        first.add(_row(i))
    # crash: row 5 was only buffered and is lost
    resumed = CheckpointWriter(out, dict(FP))
    assert resumed.done_rows() == {0, 2}
    for i in (1, 3, 4, 5):
        resumed.add(_row(i, ok=i != 3))
    resumed.flush()
    assert sorted(os.listdir(resumed.parts_dir)) == ["part-00000.parquet", "part-00001.parquet"]
    resumed.finalize(pa.string(), {"job": "legal"}, include_prompt=False,
                     include_token_ids=False, num_rows=6)
    table = pq.read_table(out)
    assert table.column("id").to_pylist() == [f"r{i}" for i in range(6)]
    assert table.column("completion").to_pylist()[3] is None
    assert table.column("error").to_pylist()[3] == "prompt too long"
    assert not os.path.exists(resumed.parts_dir)


def test_fingerprint_mismatch(tmp_path):
    out = tmp_path / "legal.parquet"
    w = CheckpointWriter(out, FP)
    w.add(_row(0))
    w.flush()
    other = CheckpointWriter(out, {**FP, "sampling": {"max_tokens": 9}})
    with pytest.raises(ConfigError) as e:
        other.done_rows()
    assert str(e.value) == (f"output.mode: the checkpoint in {out}.parts was written by a "
                            "different job (differs in: sampling); use output.mode: overwrite "
                            "to start again")
    other.clear()
    assert not other.has_checkpoint() and other.done_rows() == set()


def test_damaged_part_is_moved_aside(tmp_path):
    w = CheckpointWriter(tmp_path / "o.parquet", FP)
    w.add(_row(0))
    w.flush()
    with open(os.path.join(w.parts_dir, "part-00001.parquet"), "wb") as f:
        f.write(b"PAR1 torn")
    assert w.done_rows() == {0}
    assert [os.path.basename(d.path) for d in w.discarded] == ["part-00001.parquet"]


def test_final_schema_and_metadata(tmp_path):
    out = tmp_path / "o.parquet"
    w = CheckpointWriter(out, FP)
    for i in (1, 0):
        w.add(_row(i, row_id=i))
    w.finalize(pa.int64(), {"job": "legal", "model": "m"}, include_prompt=True,
               include_token_ids=True, num_rows=2)
    table = pq.read_table(out)
    assert table.schema.remove_metadata() == output_schema(pa.int64(), True, True)
    assert [f"{f.name}:{f.type}" for f in table.schema] == [
        "id:int64", "completion:string", "finish_reason:string", "prompt_tokens:int32",
        "completion_tokens:int32", "cached_tokens:int32", "error:string", "prompt:string",
        "token_ids:list<element: int32>"]
    stamp = json.dumps(FP, sort_keys=True).encode()  # the job's fingerprint
    assert table.schema.metadata == {b"job": b"legal", b"model": b"m",
                                     b"batchllm.fingerprint": stamp}
    assert table.column("token_ids").to_pylist() == [[0, 1], [1, 2]]
    assert table.column("prompt_tokens").to_pylist() == [10, 11]


def test_id_cast_to_input_type_and_empty_job(tmp_path):
    w = CheckpointWriter(tmp_path / "o.parquet", FP)
    w.add(_row(0, row_id=7))
    w.finalize(pa.int32(), {}, include_prompt=False, include_token_ids=False)
    table = pq.read_table(tmp_path / "o.parquet")
    assert table.schema.field("id").type == pa.int32() and table.num_rows == 1
    assert table.column_names == ["id", "completion", "finish_reason", "prompt_tokens",
                                  "completion_tokens", "cached_tokens", "error"]
    empty = CheckpointWriter(tmp_path / "e.parquet", FP)
    empty.finalize(pa.string(), {}, include_prompt=False, include_token_ids=False, num_rows=0)
    assert pq.read_table(tmp_path / "e.parquet").num_rows == 0


def test_missing_rows_refused(tmp_path):
    w = CheckpointWriter(tmp_path / "o.parquet", FP)
    w.add(_row(0))
    w.add(_row(2))
    with pytest.raises(RuntimeError, match=r"1 of 3 rows are missing \(e.g. \[1\]\)"):
        w.finalize(pa.string(), {}, include_prompt=False, include_token_ids=False, num_rows=3)
    assert not os.path.exists(tmp_path / "o.parquet") and w.has_checkpoint()


def test_final_file_written_to_temp_then_renamed(tmp_path, monkeypatch):
    out = tmp_path / "o.parquet"
    out.write_bytes(b"previous run")
    replaced = []
    real_replace = os.replace

    def spy(src, dst):
        # at the moment of the rename the complete file sits under a fresh temporary name beside
        # the output, and the old output is still intact
        if str(dst) == str(out):
            assert pq.read_table(src).num_rows == 2 and out.read_bytes() == b"previous run"
        replaced.append((str(src), str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(atomic_write.os, "replace", spy)
    w = CheckpointWriter(out, FP)
    w.add(_row(1))
    w.add(_row(0))
    w.finalize(pa.string(), {}, include_prompt=False, include_token_ids=False, num_rows=2)
    temps = [src for src, dst in replaced if dst == str(out)]
    assert len(temps) == 1 and os.path.basename(temps[0]).startswith(".o.parquet.tmp-")
    assert os.path.dirname(temps[0]) == str(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["o.parquet"]  # no temp left, parts removed


@pytest.mark.parametrize("planted", ["o.parquet.tmp", "o.parquet.lock"])
def test_a_planted_symlink_does_not_redirect_a_write(tmp_path, planted):
    """A symlink planted under the old fixed temporary name, or the lock's name, in the output
    folder: the write goes to the output (the symlink's target is untouched), the lock is
    refused rather than followed."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / planted).symlink_to(victim)
    out = tmp_path / "o.parquet"
    if planted.endswith(".lock"):
        with pytest.raises(OSError):
            OutputLock(str(out)).acquire()
    else:
        w = CheckpointWriter(out, FP)
        w.add(_row(0))
        w.finalize(pa.string(), {}, include_prompt=False, include_token_ids=False, num_rows=1)
        assert pq.read_table(out).num_rows == 1
    assert victim.read_text() == "precious" and (tmp_path / planted).is_symlink()


def test_parts_of_this_job_with_other_numerics_refuse_the_resume(tmp_path):
    """A part with this job's identity but other numerics (here: the dtype) is not moved aside
    and rerun: the resume is refused, naming what changed."""
    ours = {**FP, "numerics": {"dtype": "float32", "device": "cpu", "model": [["a", 1, 2]]}}
    w = CheckpointWriter(tmp_path / "o.parquet", ours)
    w.add(_row(0))
    w.flush()
    changed = {**ours, "numerics": {**ours["numerics"], "dtype": "bfloat16"}}
    with pytest.raises(ConfigError, match=r"other numerics \(dtype: 'float32' then, 'bfloat16' "
                       r"now\).*output.mode: overwrite"):
        CheckpointWriter(tmp_path / "o.parquet", changed).done_rows()
    assert w.has_checkpoint() and not os.path.exists(f"{tmp_path}/o.parquet.discarded")


def test_write_metrics(tmp_path):
    out = tmp_path / "out" / "legal.parquet"
    out.parent.mkdir()
    path = write_metrics(out, {"rows": 3, "output_tokens_per_s": float("nan"), "device": "cpu"})
    assert path == f"{out}.metrics.json"
    with open(path) as f:
        assert json.load(f) == {"rows": 3, "output_tokens_per_s": None, "device": "cpu"}
    assert sorted(os.listdir(out.parent)) == ["legal.parquet.metrics.json"]


def test_row_written_twice_is_kept_once(tmp_path):
    w = CheckpointWriter(tmp_path / "o.parquet", FP)
    w.add(_row(0))
    w.flush()
    w.add(_row(0))
    w.add(_row(1))
    w.finalize(pa.string(), {}, include_prompt=False, include_token_ids=False, num_rows=2)
    assert pq.read_table(tmp_path / "o.parquet").column("id").to_pylist() == ["r0", "r1"]


def test_bad_and_foreign_parts_are_moved_aside(tmp_path):
    out = tmp_path / "o.parquet"
    w = CheckpointWriter(out, FP, flush_rows=1)
    w.add(_row(0))
    w.add(_row(1))
    other = CheckpointWriter(out, {**FP, "model": "other"}, flush_rows=1)
    other.add(_row(2))  # part-00002, another job's
    parts = os.path.join(w.parts_dir, "")
    pq.write_table(pa.table({"row": [3]}), parts + "part-00003.parquet")  # not a part's columns
    with open(parts + "part-00004.parquet", "wb") as f:
        f.write(b"PAR1 torn")
    resumed = CheckpointWriter(out, FP)
    assert resumed.done_rows() == {0, 1}
    assert [(os.path.basename(d.path), d.why.split(" (")[0]) for d in resumed.discarded] == [
        ("part-00003.parquet", ("lacks the column(s) completion, finish_reason, prompt_tokens, "
         "completion_tokens, cached_tokens, error, prompt, token_ids, sample, samples, logprobs, "
             "id")),
        ("part-00004.parquet", "cannot be read"),
        ("part-00002.parquet", "was written by another job")]
    assert resumed.discarded[2].why.endswith("(differs in: model)")
    assert sorted(os.listdir(w.parts_dir)) == ["part-00000.parquet", "part-00001.parquet"]
    moved = sorted(os.listdir(f"{out}.discarded"))
    assert [m.split(".")[0] for m in moved] == ["part-00002", "part-00003", "part-00004"]
    assert all(d.moved_to == os.path.join(f"{out}.discarded", os.path.basename(d.moved_to))
               for d in resumed.discarded)


def test_failed_write_leaves_no_temporary_file(tmp_path):
    from batchllm.rows.storage import WriteFailed, write_atomic

    def half(f):
        f.write(b"half a file")
        raise OSError(28, "No space left on device")

    (tmp_path / "o.parquet").write_bytes(b"previous")
    with pytest.raises(WriteFailed) as e:
        write_atomic(str(tmp_path / "o.parquet"), half)
    assert str(e.value) == f"cannot write {tmp_path / 'o.parquet'}: No space left on device"
    assert sorted(os.listdir(tmp_path)) == ["o.parquet"]
    assert (tmp_path / "o.parquet").read_bytes() == b"previous"
