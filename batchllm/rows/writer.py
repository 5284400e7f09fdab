"""Rows out: checkpoint parts while the job runs, then one final Parquet in input order.

Parts live in "<output>.parts/part-00000.parquet", ... (with a writer tag, as Ray workers use:
"part-00000-w1.parquet", so that writers sharing the folder never pick the same name; on object
storage, which has no rename, each writer adds a random token too); each holds finished rows with
their input row index ("row") and, in its key-value metadata, the job's fingerprint as JSON, so a
resumed job only trusts parts written by the same job. Every file is written whole or not at all
(storage.write_atomic): a reader never sees a half-written part, final file or metrics file.

A part that cannot be read, lacks the part columns, or was written by another job is moved aside
to "<output>.discarded/" (never deleted) and its rows run again; `discarded` lists them. When no
part at all belongs to this job, the job itself changed since the checkpoint: that is a
ConfigError (use output.mode: overwrite), not a reason to quietly run everything again.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import time
from collections.abc import Callable
from typing import IO, Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchllm.config import ConfigError
from batchllm.rows import storage
from batchllm.rows.record import ERROR, Row
from batchllm.rows.samples import (
    SAMPLE_FIELDS,
    check_complete,
    done_keys,
    extra_fields,
    sample_values,
    unique_lines,
)

FINGERPRINT_KEY = b"batchllm.fingerprint"

# Part schema, minus "id" (typed by the values; cast to the input id type by finalize).
_PART_FIELDS = [
    pa.field("row", pa.int64(), nullable=False),
    pa.field("completion", pa.string()),
    pa.field("finish_reason", pa.string()),
    pa.field("prompt_tokens", pa.int32()),
    pa.field("completion_tokens", pa.int32()),
    pa.field("cached_tokens", pa.int32()),
    pa.field("error", pa.string()),
    pa.field("prompt", pa.string()),
    pa.field("token_ids", pa.list_(pa.int32())),
    *SAMPLE_FIELDS,  # sample, samples (the row's n), logprobs: rows/samples.py
]


class Discarded(NamedTuple):
    """A part moved aside on resume: where it was, where it is now, and why."""

    path: str
    moved_to: str
    why: str


class Finalized(NamedTuple):
    """What finalize wrote: the output file, its rows, and how many of them are errors."""

    path: str
    rows: int
    rows_error: int


def part_row(row: Row) -> dict[str, Any]:
    """A finished row as one line of a part: the values of _PART_FIELDS, and its id."""
    return {
        "row": row.index, "completion": row.completion, "finish_reason": row.finish_reason,
        "prompt_tokens": row.prompt_tokens, "completion_tokens": len(row.token_ids),
        "cached_tokens": row.cached_tokens, "error": row.error, "prompt": row.prompt,
        "token_ids": row.token_ids, "id": row.id, **sample_values(row),
    }


OUTPUT_COLUMNS = ("id", "completion", "finish_reason", "prompt_tokens", "completion_tokens",
                  "cached_tokens", "error")


def _canonical(d: dict) -> str:
    return json.dumps(d, sort_keys=True, default=str)


def _schema_problem(schema: pa.Schema) -> str | None:
    """Why a part's columns are not those of a part, or None."""
    names = set(schema.names)
    missing = [f.name for f in _PART_FIELDS if f.name not in names] + (
        [] if "id" in names else ["id"])
    if missing:
        return f"lacks the column(s) {', '.join(missing)}"
    for f in _PART_FIELDS:
        t = schema.field(f.name).type
        if t != f.type and not pa.types.is_null(t):
            return f"has column {f.name} of type {t}, expected {f.type}"
    return None


def output_schema(id_type: pa.DataType, include_prompt: bool = False,
                  include_token_ids: bool = False, extra: list[pa.Field] = ()) -> pa.Schema:
    """The final file's schema (DESIGN.md "Output Parquet"), without metadata; `extra`: the
    sample and logprobs fields the lines call for (rows/samples.py extra_fields)."""
    fields = [pa.field("id", id_type)] + [f for f in _PART_FIELDS if f.name in OUTPUT_COLUMNS]
    if include_prompt:
        fields.append(_PART_FIELDS[7])
    if include_token_ids:
        fields.append(_PART_FIELDS[8])
    return pa.schema(fields + list(extra))


class CheckpointWriter:
    """Buffers finished rows and flushes them as parts; finalize() merges them in input order.

    Not thread-safe. flush() takes the buffer before writing, so a signal handler may call it
    while add() runs without writing a row twice.
    """

    def __init__(self, output_path: str | os.PathLike, fingerprint: dict,
                 flush_rows: int = 256, flush_seconds: float = 5.0, tag: str = "") -> None:
        """tag: appended to this writer's part names ("-w1"): letters, digits, '-' and '_'."""
        if not all(c.isascii() and (c.isalnum() or c in "-_") for c in tag):
            raise ValueError(f"part tag must be letters, digits, '-' or '_', got {tag!r}")
        self.output_path = os.fspath(output_path)
        if storage.is_remote(self.output_path):  # no rename there: names no other writer picks
            tag = f"{tag}-{secrets.token_hex(4)}"
        self.tag = tag
        self.parts_dir = self.output_path + ".parts"
        self.discarded_dir = self.output_path + ".discarded"
        self.fingerprint = fingerprint
        self._fingerprint_json = _canonical(fingerprint)
        self.flush_rows = flush_rows
        self.flush_seconds = flush_seconds
        self._rows: list[dict] = []  # part_row of each finished row not yet in a part
        self._last_flush = time.monotonic()
        self._next_part: int | None = None
        self.rows_flushed = 0  # rows this writer has written to parts
        self.discarded: list[Discarded] = []  # parts moved aside (bad, or of another job)

    # -- while running ---------------------------------------------------------------------
    def add(self, row: Row) -> None:
        """Buffer one finished row (it is copied: later changes to it are not written)."""
        self._rows.append(part_row(row))
        self.maybe_flush()

    def maybe_flush(self) -> None:
        """Flush when flush_rows rows are waiting or flush_seconds passed since the last flush."""
        waited = time.monotonic() - self._last_flush
        if len(self._rows) >= self.flush_rows or (self._rows and waited >= self.flush_seconds):
            self.flush()

    def flush(self) -> None:
        """Write the buffered rows as the next part (nothing when none are buffered)."""
        rows, self._rows = self._rows, []
        self._last_flush = time.monotonic()
        if not rows:
            return
        storage.makedirs(self.parts_dir)
        if self._next_part is None:
            self._next_part = 1 + max((int(n[5:10]) for n in self._part_names()), default=-1)
        index, self._next_part = self._next_part, self._next_part + 1
        columns = {f.name: pa.array([r.get(f.name) for r in rows], f.type) for f in _PART_FIELDS}
        columns["id"] = pa.array([r["id"] for r in rows])
        table = pa.table(columns).replace_schema_metadata(
            {FINGERPRINT_KEY: self._fingerprint_json.encode()})
        path = storage.join(self.parts_dir, f"part-{index:05d}{self.tag}.parquet")
        storage.write_atomic(path, lambda f: pq.write_table(table, f))
        self.rows_flushed += len(rows)

    # -- resume ------------------------------------------------------------------------------
    def _part_names(self) -> list[str]:
        return [n for n in storage.list_dir(self.parts_dir)
                if n.startswith("part-") and n.endswith(".parquet")]

    def has_checkpoint(self) -> bool:
        """Whether parts of an earlier run exist."""
        return bool(self._part_names())

    def clear(self) -> None:
        """Remove the parts folder (output.mode overwrite starts from nothing)."""
        storage.remove_tree(self.parts_dir)
        self._next_part = None

    def _discard(self, name: str, why: str) -> None:
        """Move a part aside (never delete it: it may be someone's only copy)."""
        path = storage.join(self.parts_dir, name)
        stamp = time.strftime("%Y%m%dT%H%M%S")
        moved_to = storage.join(self.discarded_dir, f"{name[:-len('.parquet')]}.{stamp}.parquet")
        storage.move(path, moved_to)
        self.discarded.append(Discarded(path, moved_to, why))

    def _read_parts(self, columns: list[str] | None = None) -> list[pa.Table]:
        """The parts of this job; bad ones and other jobs' are moved aside (module docstring)."""
        tables, foreign = [], []
        for name in self._part_names():
            try:
                pf = pq.ParquetFile(storage.arrow_source(storage.join(self.parts_dir, name)))
                stored = (pf.schema_arrow.metadata or {}).get(FINGERPRINT_KEY, b"{}").decode()
                problem = _schema_problem(pf.schema_arrow)
                table = None if problem else pf.read(columns=columns)
            except (OSError, pa.ArrowException) as e:
                self._discard(name, f"cannot be read ({e})")
                continue
            if problem:
                self._discard(name, problem)
            elif stored != self._fingerprint_json:
                foreign.append((name, stored))
            else:
                tables.append(table)
        ours = json.loads(self._fingerprint_json)
        if foreign and not tables:
            raise ConfigError(_mismatch(self.parts_dir, _loads(foreign[0][1]), ours))
        for name, stored in foreign:
            differs = ", ".join(_differences(_loads(stored), ours)) or "?"
            self._discard(name, f"was written by another job (differs in: {differs})")
        return tables

    def done_rows(self) -> set[int | tuple[int, int]]:
        """What is already in parts (plus any buffered): the index of each row with all its
        samples there, and (index, sample) for the samples of a row not all done (with n = 1:
        row indices only). Bad parts and other jobs' parts are moved aside; ConfigError when the
        parts hold no part of this job but some of another (the job changed since the
        checkpoint)."""
        keys = ("row", "sample", "samples")
        columns = [[np.asarray([r[k] for r in self._rows], np.int64)] for k in keys]
        for table in self._read_parts(list(keys)):
            for col, k in zip(columns, keys):
                col.append(table.column(k).to_numpy())
        return done_keys(*(np.concatenate(c) for c in columns))

    # -- the end -------------------------------------------------------------------------------
    def finalize(self, id_type: pa.DataType, metadata: dict[str, str], include_prompt: bool,
                 include_token_ids: bool, num_rows: int | None = None,
                 write_final: Callable[[pa.Table, IO[bytes]], None] | None = None) -> Finalized:
        """Write the final file sorted by row, atomically, then remove the parts folder.

        One line per (row, sample), in that order. With num_rows, check that rows
        0..num_rows-1 are all there with all their samples (RuntimeError if not).
        write_final(table, file): writes the final table in another format (default Parquet).
        Returns the path and the lines written, error lines counted as they are written.
        """
        self.flush()
        part_schema = pa.schema(_PART_FIELDS + [pa.field("id", id_type)])
        parts = [t.select(part_schema.names).cast(part_schema) for t in self._read_parts()]
        table = unique_lines(pa.concat_tables(parts) if parts else part_schema.empty_table())
        if num_rows is not None:
            check_complete(table, num_rows)
        schema = output_schema(id_type, include_prompt, include_token_ids, extra_fields(table))
        final = table.select(schema.names).cast(schema).replace_schema_metadata(metadata)
        storage.makedirs(storage.dirname(self.output_path))
        write = write_final or pq.write_table
        storage.write_atomic(self.output_path, lambda f: write(final, f))
        self.clear()
        errors = pc.sum(pc.equal(final.column("finish_reason"), ERROR)).as_py() or 0
        return Finalized(self.output_path, final.num_rows, errors)


def _loads(text: str) -> dict:
    try:
        d = json.loads(text)
    except ValueError:
        return {}
    return d if isinstance(d, dict) else {}


def _differences(theirs: dict, ours: dict) -> list[str]:
    return sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))


def _mismatch(where: str, theirs: dict, ours: dict) -> str:
    keys = _differences(theirs, ours)
    return (f"output.mode: the checkpoint in {where} was written by a different job (differs in: "
            f"{', '.join(keys) or '?'}); use output.mode: overwrite to start again")


def _finite(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def write_metrics(output_path: str | os.PathLike, metrics: dict[str, Any]) -> str:
    """Write metrics as JSON to "<output>.metrics.json" atomically; returns that path.
    Non-finite floats become null (JSON has no NaN)."""
    path = os.fspath(output_path) + ".metrics.json"
    storage.write_text(path, json.dumps(_finite(metrics), indent=2, default=str) + "\n")
    return path
