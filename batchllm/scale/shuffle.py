"""The partition path of a sharded job (engine.sharding: partition): Ray tasks read and tokenize
the input blocks, the driver cuts the key range from their samples, tasks split each block by
range, and each worker gets its part of every block and plans it where it lands.

The driver holds only ids, samples and each row's worker, never the tokens or the whole plan.
The functions here are plain; `partition_rows` makes them Ray tasks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from batchllm.config import ConfigError, JobConfig
from batchllm.plan.partition import (
    BlockSample,
    choose_cuts,
    route,
    sample_block,
    samples_per_block,
)
from batchllm.rows.admission import admit
from batchllm.rows.blocks import InputBlock, InputIndex, read_block
from batchllm.rows.build import build_rows
from batchllm.scale.shard import Shard


@functools.cache
def _tokenizer(model_path: str, revision: str | None):
    from batchllm.model.resolve import resolve_model
    from batchllm.model.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(model_path, revision))


def tokenize_block(cfg: JobConfig, block: InputBlock, max_samples: int,
                   max_model_len: int) -> tuple[Shard, BlockSample]:
    """A block's rows (indices over all files), admitted, and its sample."""
    rows = build_rows(_tokenizer(cfg.model.path, cfg.model.revision), cfg.input, cfg.sampling,
                      read_block(cfg.input, block), block.first_row, cfg.output.include_prompt)
    admit(rows, max_model_len)  # what the worker's run will admit: sampled and routed alike
    return Shard(-1, rows), sample_block(rows, max_samples)


def split_block(block: Shard, uppers: list[bytes], num_parts: int) -> tuple:
    """(part of each row [n] int32, then one Shard per part)."""
    part = route(block.rows, uppers)
    out: list = [part]
    for k in range(num_parts):
        out.append(Shard(k, [block.rows[j] for j in np.flatnonzero(part == k).tolist()]))
    return tuple(out)


@dataclass(eq=False)
class Partitions:
    """Where each row of the job went: rows[k] are worker k's input row indices (sorted), pieces[k]
    the object refs of its Shard pieces (one per block)."""

    rows: list[np.ndarray]
    pieces: list[list]
    blocks: int


def partition_rows(cfg: JobConfig, index: InputIndex, num_parts: int,
                   max_model_len: int) -> Partitions:
    """Run the two rounds of tasks; the tokenized rows stay in Ray's object store."""
    import ray

    tokenize = ray.remote(tokenize_block).options(num_returns=2)
    split = ray.remote(split_block).options(num_returns=num_parts + 1)
    per_block = samples_per_block(len(index.blocks))
    first = [tokenize.remote(cfg, b, per_block, max_model_len) for b in index.blocks]
    try:
        samples = ray.get([s for _, s in first])
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, ConfigError):  # a block's column has the wrong type
            raise e.cause from None
        raise
    uppers = choose_cuts(samples, num_parts)
    second = [split.remote(block, uppers, num_parts) for block, _ in first]
    where = ray.get([refs[0] for refs in second])  # [blocks] of [n] int32
    rows = [np.concatenate([b.first_row + np.flatnonzero(w == k)
                            for b, w in zip(index.blocks, where)]).astype(np.int64)
            for k in range(num_parts)]
    pieces = [[refs[k + 1] for refs in second] for k in range(num_parts)]
    return Partitions(rows, pieces, len(index.blocks))
