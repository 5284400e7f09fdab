"""What a worker of a sharded job runs: a Shard of tokenized rows, plain data (no Ray, no torch),
which the driver (engine.sharding: tree) or the partition tasks (scale/shuffle.py) make and the
worker (scale/worker.py) runs."""

from __future__ import annotations

from dataclasses import dataclass, field

from batchllm.rows.record import Row


@dataclass
class Shard:
    """What a worker runs: its rows, already tokenized, in input order."""

    worker: int  # shard number; the parts are tagged "-w{worker}"
    rows: list[Row]
    skip: set[int] = field(default_factory=set)  # row indices already in parts: planned, not run


def gather_pieces(pieces: list[Shard], worker: int, done: set[int]) -> Shard:
    """A worker's pieces (one per input block) as one Shard in input order, the rows in `done`
    to skip."""
    rows = sorted((r for p in pieces for r in p.rows), key=lambda r: r.index)
    return Shard(worker, rows, done & {r.index for r in rows})


def part_tag(worker: int) -> str:
    """The tag of a worker's part names: part-00000-w1.parquet."""
    return f"-w{worker}"
