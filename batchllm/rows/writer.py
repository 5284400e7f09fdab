"""Rows out: checkpoint parts while the job runs, then one final Parquet in input order.

Parts live in "<output>.parts/part-00000.parquet", ... (with a writer tag, as Ray workers use:
"part-00000-w1.parquet", so that writers sharing the folder never pick the same name; on object
storage, which has no rename, each writer adds a random token too); each holds finished rows with
their input row index ("row") and, in its key-value metadata, the job's fingerprint as JSON
(rows/fingerprint.py), so a resumed job only trusts parts written by the same job; the final file
carries it too. Every file is written whole or not at all (storage.write_atomic): a reader never
sees a half-written part, final file or metrics file.

A part that cannot be read, lacks the part columns, or was written by another job is moved aside
to "<output>.discarded/" (never deleted) and its rows run again; `discarded` lists them. When no
part at all belongs to this job, the job itself changed since the checkpoint: that is a
ConfigError (use output.mode: overwrite), not a reason to quietly run everything again; so is a
part of this job computed with other numerics (model files, dtype, device, kernels).

The final file is written by streaming the parts through an external merge (rows/merge.py):
memory does not grow with the job's rows.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import threading
import time
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchllm.config import ConfigError
from batchllm.rows import storage
from batchllm.rows.fingerprint import canonical, differences, identity, loads, numerics_changed
from batchllm.rows.logprob_column import logprobs_column
from batchllm.rows.merge import GROUP_BYTES, KEYS, FinalWriter, Part, merge_parts, write_parquet
from batchllm.rows.record import Row
from batchllm.rows.redact import redact
from batchllm.rows.samples import SAMPLE_FIELDS, done_keys, sample_values

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
    return {**_line(row), **sample_values(row)}


def _line(row: Row) -> dict[str, Any]:  # part_row, log-probabilities as held (arrays)
    return {"row": row.index, "completion": row.completion, "finish_reason": row.finish_reason,
            "prompt_tokens": row.prompt_tokens, "completion_tokens": len(row.token_ids),
            "cached_tokens": row.cached_tokens, "error": row.error, "prompt": row.prompt,
            "token_ids": row.token_ids, "id": row.id, "sample": row.sample,
            "samples": row.num_samples, "logprobs": row.logprobs}


OUTPUT_COLUMNS = ("id", "completion", "finish_reason", "prompt_tokens", "completion_tokens",
                  "cached_tokens", "error")


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
    sample and logprobs fields the lines call for."""
    fields = [pa.field("id", id_type)] + [f for f in _PART_FIELDS if f.name in OUTPUT_COLUMNS]
    if include_prompt:
        fields.append(_PART_FIELDS[7])
    if include_token_ids:
        fields.append(_PART_FIELDS[8])
    return pa.schema(fields + list(extra))


class CheckpointWriter:
    """Buffers finished rows and flushes them as parts; finalize() merges them in input order.

    add() from one thread; flush() from any (a Ray worker's driver asks it to flush while its
    shard runs), one at a time. flush() takes the buffer before writing, so a signal handler may
    call it while add() runs without writing a row twice.
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
        self._fingerprint_json = canonical(fingerprint)
        self.flush_rows = flush_rows
        self.flush_seconds = flush_seconds
        self._rows: list[dict] = []  # _line of each finished row not yet in a part
        self._last_flush = time.monotonic()
        self._next_part: int | None = None
        self.rows_flushed = 0  # rows this writer has written to parts
        self.discarded: list[Discarded] = []  # parts moved aside (bad, or of another job)
        self._flushing = threading.RLock()

    # -- while running ---------------------------------------------------------------------
    def add(self, row: Row) -> None:
        """Buffer one finished row (it is copied: later changes to it are not written)."""
        self._rows.append(_line(row))
        self.maybe_flush()

    def maybe_flush(self) -> None:
        """Flush when flush_rows rows are waiting or flush_seconds passed since the last flush."""
        waited = time.monotonic() - self._last_flush
        if len(self._rows) >= self.flush_rows or (self._rows and waited >= self.flush_seconds):
            self.flush()

    def flush(self) -> None:
        """Write the buffered rows as the next part (nothing when none are buffered)."""
        with self._flushing:
            rows, self._rows = self._rows, []
            self._last_flush = time.monotonic()
            if rows:
                self._write_part(rows)

    def _write_part(self, rows: list[dict]) -> None:
        storage.makedirs(self.parts_dir)
        if self._next_part is None:
            self._next_part = 1 + max((int(n[5:10]) for n in self._part_names()), default=-1)
        index, self._next_part = self._next_part, self._next_part + 1
        columns = {f.name: logprobs_column([r[f.name] for r in rows]) if f.name == "logprobs"
                   else pa.array([r.get(f.name) for r in rows], f.type) for f in _PART_FIELDS}
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

    def _read_parts(self) -> list[Part]:
        """The parts of this job with their key columns; bad ones and other jobs' are moved
        aside, and parts of this job with other numerics refused (module docstring)."""
        parts, foreign = [], []
        ours = loads(self._fingerprint_json)
        for name in self._part_names():
            path = storage.join(self.parts_dir, name)
            try:
                pf = pq.ParquetFile(storage.arrow_source(path))
                stored = (pf.schema_arrow.metadata or {}).get(FINGERPRINT_KEY, b"{}").decode()
                problem = _schema_problem(pf.schema_arrow)
                keys = None if problem else pf.read(columns=KEYS)
                nbytes = sum(pf.metadata.row_group(i).total_byte_size
                             for i in range(pf.metadata.num_row_groups))
            except (OSError, pa.ArrowException, UnicodeDecodeError) as e:
                self._discard(name, f"cannot be read ({e})")
                continue
            if problem:
                self._discard(name, problem)
            elif stored == self._fingerprint_json:
                parts.append(Part(path, keys, nbytes))
            elif canonical(identity(loads(stored))) == canonical(identity(ours)):
                raise ConfigError(numerics_changed(f"the checkpoint in {self.parts_dir}",
                                                   loads(stored), ours))
            else:
                foreign.append((name, stored))
        if foreign and not parts:
            raise ConfigError(_mismatch(self.parts_dir, loads(foreign[0][1]), ours))
        for name, stored in foreign:
            differs = ", ".join(differences(loads(stored), ours)) or "?"
            self._discard(name, f"was written by another job (differs in: {differs})")
        return parts

    def done_rows(self) -> set[int | tuple[int, int]]:
        """What is already in parts (plus any buffered): the index of each row with all its
        samples there, and (index, sample) for the samples of a row not all done (with n = 1:
        row indices only). Bad parts and other jobs' parts are moved aside; ConfigError when the
        parts hold no part of this job but some of another (the job changed since the
        checkpoint)."""
        columns = [[np.asarray([r[k] for r in self._rows], np.int64)] for k in KEYS]
        for part in self._read_parts():
            for col, k in zip(columns, KEYS):
                col.append(part.keys.column(k).to_numpy())
        return done_keys(*(np.concatenate(c) for c in columns))

    # -- the end -------------------------------------------------------------------------------
    def finalize(self, id_type: pa.DataType, metadata: dict[str, str], include_prompt: bool,
                 include_token_ids: bool, num_rows: int | None = None,
                 write_final: FinalWriter | None = None,
                 group_bytes: int = GROUP_BYTES) -> Finalized:
        """Write the final file sorted by row, atomically and by streaming (rows/merge.py),
        then remove the parts folder. Its metadata: `metadata` and the job's fingerprint.

        One line per (row, sample), in that order. With num_rows, check that rows
        0..num_rows-1 are all there with all their samples (RuntimeError if not).
        write_final(groups, schema, file): writes the final file in another format (default
        Parquet); group_bytes: about how much of the lines is in memory at once.
        Returns the path and the lines written, error lines counted as they are written.
        """
        self.flush()
        part_schema = pa.schema(_PART_FIELDS + [pa.field("id", id_type)])
        meta = {**metadata, FINGERPRINT_KEY.decode(): self._fingerprint_json}

        def schema(extra: list[pa.Field]) -> pa.Schema:
            return output_schema(id_type, include_prompt, include_token_ids,
                                 extra).with_metadata(meta)

        merged = merge_parts(self._read_parts(), part_schema, self.output_path, self.parts_dir,
                             schema, num_rows, write_final or write_parquet, group_bytes)
        self.clear()
        return Finalized(self.output_path, merged.lines, merged.errors)


def _mismatch(where: str, theirs: dict, ours: dict) -> str:
    keys = differences(theirs, ours)
    return (f"output.mode: the checkpoint in {where} was written by a different job (differs in: "
            f"{', '.join(keys) or '?'}); use output.mode: overwrite to start again")


def _finite(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return None if isinstance(x, float) and not math.isfinite(x) else x


def write_metrics(output_path: str | os.PathLike, metrics: dict[str, Any]) -> str:
    """Write metrics as JSON to "<output>.metrics.json" atomically; returns that path.
    Non-finite floats become null (JSON has no NaN)."""
    path = os.fspath(output_path) + ".metrics.json"
    text = redact(json.dumps(_finite(metrics), indent=2, default=str))
    storage.write_text(path, text + "\n")
    return path
