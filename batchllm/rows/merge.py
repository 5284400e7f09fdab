"""The final file from the checkpoint's parts, written by streaming: an external merge over the
parts' row index, so that one group of lines at a time is in memory whatever the job's size.

1. index: the row, sample and samples columns of every part, in the parts' order (24 bytes a
   line), sorted by (row, sample), each (row, sample) kept once (its first line: a line
   written twice, by a rerun after a crash, is the same line) and checked complete;
2. spill: each part read once, its kept lines split by output group (consecutive whole rows
   that hold about `group_bytes`) into one Arrow IPC file per group, in a private folder;
3. write: each group's file read back, put in order, cast to the final schema and handed to
   the format's writer (a Parquet row group; the OpenAI Batch results' lines), which writes to
   the output as a stream (storage.write_atomic with stream=True).
The file is the one that sorting all parts in one table would give (values, order, metadata);
only its row groups are smaller.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import IO, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchllm.rows import storage
from batchllm.rows.record import ERROR
from batchllm.rows.samples import SAMPLE_FIELDS, check_complete

KEYS = ["row", "sample", "samples"]
# A group's lines as the parts hold them uncompressed. Finalize's peak is a few times one group
# (read back, sorted, cast, encoded as a row group), so the group is small: with 32 MiB, a job of
# 24,000 rows with logprobs 5 (1.3 KB a line) merged in one group and finalize's peak grew by
# 142 MiB, against 66 MiB at 4,000 rows (scripts/measure_row_memory.py's job).
GROUP_BYTES = 4 << 20
# Spill files open at once: each open IPC writer holds buffers of its own (~1 MiB measured;
# ~3.5 with lz4, whose frame contexts made _spill's peak grow ~1 KB a line from 4,000 to 24,000
# lines), so their number is bounded, and past MAX_GROUPS groups a group holds more lines.
MAX_GROUPS = 64
# write_final(groups in order, the final schema with its metadata, the output file)
FinalWriter = Callable[[Iterator[pa.Table], pa.Schema, IO[bytes]], None]


class Part(NamedTuple):
    """A part of this job: where it is, its key columns (KEYS), its uncompressed bytes."""

    path: str
    keys: pa.Table
    nbytes: int


class Merged(NamedTuple):
    lines: int
    errors: int


def write_parquet(groups: Iterator[pa.Table], schema: pa.Schema, f: IO[bytes]) -> None:
    """The default final writer: each group as row groups of one Parquet file."""
    with pq.ParquetWriter(f, schema) as out:
        for table in groups:
            out.write_table(table)
            table = None  # let go before the next group is read


def _index(parts: list[Part]) -> tuple[np.ndarray, pa.Table]:
    """(the output position of each part line in the parts' order, -1 for a repeated line;
    the kept lines' KEYS in output order). One stable sort of one key a line (row and sample
    in one int64), its arrays let go as they are used: ~55 bytes a line at its peak, not the
    ~100 of a three-key lexsort over int64 copies of the key columns."""
    def column(name: str) -> np.ndarray:
        return np.concatenate([p.keys[name].to_numpy() for p in parts] or [np.zeros(0, int)])

    row, sample = column("row").astype(np.int64, copy=False), column("sample")
    if not len(row):
        empty = pa.table({k: pa.array([], pa.int64()) for k in KEYS})
        return np.zeros(0, np.int64), empty
    key = row * (int(sample.max()) + 1) + sample  # (row, sample) in order
    order = np.argsort(key, kind="stable")  # ties: the parts' order
    key = key[order]
    kept = order[np.r_[True, key[1:] != key[:-1]]]
    del key, order
    position = np.full(len(row), -1, np.int32 if len(row) < 2**31 else np.int64)
    position[kept] = np.arange(len(kept))
    lines = pa.table({"row": row[kept], "sample": sample[kept].astype(np.int64),
                      "samples": column("samples")[kept].astype(np.int64)})
    return position, lines


def _line_bytes(parts: list[Part], schema: pa.Schema) -> float:
    """About how many bytes of memory a line takes once read: the larger of the parts' own
    figure (Parquet's uncompressed bytes, after its dictionary and run-length encodings: for
    lines that repeat each other, such as log-probability structs, a fraction of their Arrow
    size) and the Arrow size of the largest part's lines. With the Parquet figure alone, a job
    of 24,000 like lines (16 tokens, logprobs 5) made one group of all its lines: finalize's
    peak grew by ~3.9 KB a line."""
    total = sum(p.keys.num_rows for p in parts)
    encoded = sum(p.nbytes for p in parts) / max(total, 1)
    big = max(parts, key=lambda p: p.keys.num_rows, default=None)
    if big is None or not big.keys.num_rows:
        return encoded
    table = pq.read_table(storage.arrow_source(big.path), columns=schema.names)
    return max(encoded, table.nbytes / table.num_rows)


def _groups(lines: pa.Table, line_bytes: float, group_bytes: int) -> np.ndarray:
    """[K] the output group of each kept line: whole rows, about group_bytes a group."""
    rows = lines["row"].to_numpy()
    if not len(rows):
        return np.zeros(0, np.int64)
    per = max(1, int(group_bytes // max(line_bytes, 1.0)), -(-len(rows) // MAX_GROUPS))
    first = np.r_[True, rows[1:] != rows[:-1]]
    start = np.maximum.accumulate(np.where(first, np.arange(len(rows)), 0))  # row's first line
    _, group = np.unique(start // per, return_inverse=True)
    return group.astype(np.int64)


def _spill(parts: list[Part], position: np.ndarray, group: np.ndarray, schema: pa.Schema,
           folder: str) -> tuple[list[str], bool]:
    """Each part read once; its kept lines, with their output position ("_pos"), appended to
    their group's IPC file. Returns the files in group order and whether any kept line has
    log-probabilities."""
    paths = [os.path.join(folder, f"group-{g:05d}.arrow") for g in range(int(group.max()) + 1)]
    writers: dict[int, pa.ipc.RecordBatchFileWriter] = {}
    options = pa.ipc.IpcWriteOptions(compression=None)  # no codec context per writer
    logprobs = False
    offset = 0
    try:
        for part in parts:
            pos = position[offset : offset + part.keys.num_rows]
            offset += part.keys.num_rows
            keep = np.flatnonzero(pos >= 0)
            if not len(keep):
                continue
            table = pq.read_table(storage.arrow_source(part.path)).select(schema.names)
            table = table.cast(schema).take(keep).append_column("_pos", pa.array(pos[keep]))
            logprobs |= table["logprobs"].null_count < table.num_rows
            where = group[pos[keep]]
            for g in np.unique(where).tolist():
                if g not in writers:
                    writers[g] = pa.ipc.new_file(paths[g], table.schema, options=options)
                writers[g].write_table(table.take(np.flatnonzero(where == g)))
    finally:
        for w in writers.values():
            w.close()
    return paths, logprobs


def _read_groups(paths: list[str], schema: pa.Schema, counts: list[int]) -> Iterator[pa.Table]:
    """Each spilled group in output order, cast to the final schema (its file removed once
    read); counts[0] += its error lines."""
    for path in paths:
        with pa.memory_map(path) as source:
            table = pa.ipc.open_file(source).read_all()
        os.remove(path)
        table = table.take(pc.sort_indices(table["_pos"])).select(schema.names).cast(schema)
        counts[0] += pc.sum(pc.equal(table["finish_reason"], ERROR)).as_py() or 0
        yield table
        table = None  # one group in memory: this one goes before the next is read


@contextlib.contextmanager
def _spill_folder(near: str) -> Iterator[str]:
    """A private folder for the spilled groups: inside `near` (the parts folder, on the same
    disk) when it is a local folder, else in the system's temporary folder."""
    inside = near if not storage.is_remote(near) and os.path.isdir(near) else None
    folder = tempfile.mkdtemp(prefix=".merge-", dir=inside)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def merge_parts(parts: list[Part], part_schema: pa.Schema, output: str, parts_dir: str,
                final_schema: Callable[[list[pa.Field]], pa.Schema], num_rows: int | None,
                write_final: FinalWriter = write_parquet,
                group_bytes: int = GROUP_BYTES) -> Merged:
    """Write `output` from `parts` (module docstring; the spilled groups go into parts_dir when
    it is a local folder). final_schema(extra fields the lines call for: sample, logprobs) ->
    the final schema with its metadata. With num_rows, check that rows 0..num_rows-1 are all
    there with all their samples (RuntimeError if not: nothing is written)."""
    position, lines = _index(parts)
    if num_rows is not None:
        check_complete(lines, num_rows)
    group = _groups(lines, _line_bytes(parts, part_schema), group_bytes)
    with _spill_folder(parts_dir) as folder:
        paths, logprobs = ([], False) if not len(group) else _spill(
            parts, position, group, part_schema, folder)
        extra = []
        if lines.num_rows and pc.max(lines["samples"]).as_py() > 1:
            extra.append(SAMPLE_FIELDS[0])
        if logprobs:
            extra.append(SAMPLE_FIELDS[2])
        schema = final_schema(extra)
        counts = [0]
        storage.makedirs(storage.dirname(output))
        storage.write_atomic(output, lambda f: write_final(
            _read_groups(paths, schema.remove_metadata(), counts), schema, f), stream=True)
    return Merged(lines.num_rows, counts[0])
