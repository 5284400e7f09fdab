"""Input files holding what real producers emit and batchllm must survive (tests/test_bad_rows.py,
tests/test_bad_lines.py): text that is not UTF-8, values nested thousands of levels deep,
numbers out of range; and a job over them on the tiny random Llama."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from hf_reference import tiny_model_folder

DEEP_SCHEMA = '{"type":"object","properties":{"a":' * 3000 + '{"type":"string"}' + "}}" * 3000
DEEP_ARRAY = "[" * 5000 + "]" * 5000


def text_column(cells: list[bytes | str | None]) -> pa.Array:
    """A string column holding the bytes as they are: pyarrow does not check them, so a cell
    that is not UTF-8 reaches the file (as a Spark export writes it)."""
    raw = [c.encode() if isinstance(c, str) else c for c in cells]
    return pa.array(raw, pa.binary()).view(pa.string())


def texts_column(cells: list[list[bytes | str] | None]) -> pa.Array:
    """A list<string> column (per-row stop strings) whose strings may be any bytes."""
    offsets, values = [0], []
    for c in cells:
        values += c or []
        offsets.append(len(values))
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), text_column(values),
                                    mask=pa.array([c is None for c in cells]))


def messages_column(contents: list[bytes | str]) -> pa.Array:
    """list<struct<role, content>>: a system message, then the user's content (any bytes)."""
    n = len(contents)
    roles = text_column(["system", "user"] * n)
    content = text_column([x for c in contents for x in ("Answer briefly.", c)])
    structs = pa.StructArray.from_arrays([roles, content], ["role", "content"])
    return pa.ListArray.from_arrays(pa.array(range(0, 2 * n + 1, 2), pa.int32()), structs)


def write_parquet(path: Path, columns: dict[str, pa.Array]) -> Path:
    pq.write_table(pa.table(columns), path)
    table = pq.read_table(path)  # the file really holds the bad bytes
    bad = 0
    for col in table.columns:
        try:
            col.validate(full=True)
        except pa.ArrowInvalid:
            bad += 1
    assert bad, "no column of the file holds invalid UTF-8"
    return path


def job_file(tmp: Path, name: str, input_section: dict, **sampling) -> Path:
    """tmp/<name>.yaml: the tiny Llama on the CPU over the input, 3 tokens a row by default."""
    job = {
        "name": name,
        "model": {"path": str(tiny_model_folder("llama")), "device": "cpu",
                  "max_model_len": 96},
        "input": input_section,
        "output": {"path": str(tmp / name / "out.parquet")},
        "sampling": {"max_tokens": 3, **sampling},
        "engine": {"kv_cache_memory": "64MiB", "max_num_seqs": 16},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(json.dumps(job))
    return path


def output_rows(job: Path) -> dict:
    """The job's output as {id: row dict}, in order."""
    out = json.loads(job.read_text())["output"]["path"]
    return {r["id"]: r for r in pq.read_table(out).to_pylist()}
