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

from batchllm.config import JobConfig
from batchllm.plan.partition import (
    BlockSample,
    choose_cuts,
    route,
    sample_block,
    samples_per_block,
)
from batchllm.rows.blocks import InputBlock, InputIndex, read_block
from batchllm.scale.worker import ShardInput


@functools.cache
def _tokenizer(model_path: str):
    from batchllm.model.weights import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(model_path))


def tokenize_block(cfg: JobConfig, block: InputBlock,
                   max_samples: int) -> tuple[ShardInput, BlockSample]:
    """A block's engine rows (rows: indices over all files) and its sample."""
    from batchllm.rows.requests import build_rows

    rows = read_block(cfg.input, block)
    inputs, prompts = build_rows(_tokenizer(cfg.model.path), cfg.input, cfg.sampling, rows,
                                 list(range(rows.num_rows)))
    if not cfg.output.include_prompt:
        prompts = [None] * len(prompts)
    indices = list(range(block.first_row, block.first_row + rows.num_rows))
    payload = ShardInput(-1, indices, inputs, rows.ids.to_pylist(), prompts, [])
    return payload, sample_block(inputs, max_samples)


def split_block(payload: ShardInput, uppers: list[bytes], num_parts: int) -> tuple:
    """(part of each row [n] int32, then one ShardInput per part)."""
    part = route(payload.inputs, uppers)
    out: list = [part]
    for k in range(num_parts):
        take = np.flatnonzero(part == k).tolist()
        out.append(ShardInput(k, [payload.rows[j] for j in take],
                              [payload.inputs[j] for j in take], [payload.ids[j] for j in take],
                              [payload.prompts[j] for j in take], []))
    return tuple(out)


@dataclass(eq=False)
class Partitions:
    """Where each row of the job went: rows[k] are worker k's input row indices (sorted), pieces[k]
    the object refs of its ShardInput pieces (one per block)."""

    rows: list[np.ndarray]
    pieces: list[list]
    blocks: int


def partition_rows(cfg: JobConfig, index: InputIndex, num_parts: int) -> Partitions:
    """Run the two rounds of tasks; the tokenized rows stay in Ray's object store."""
    import ray

    from batchllm.config import ConfigError

    tokenize = ray.remote(tokenize_block).options(num_returns=2)
    split = ray.remote(split_block).options(num_returns=num_parts + 1)
    per_block = samples_per_block(len(index.blocks))
    first = [tokenize.remote(cfg, b, per_block) for b in index.blocks]
    try:
        samples = ray.get([s for _, s in first])
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, ConfigError):  # a block's column has the wrong type
            raise e.cause from None
        raise
    uppers = choose_cuts(samples, num_parts)
    second = [split.remote(payload, uppers, num_parts) for payload, _ in first]
    where = ray.get([refs[0] for refs in second])  # [blocks] of [n] int32
    rows = [np.concatenate([b.first_row + np.flatnonzero(w == k)
                            for b, w in zip(index.blocks, where)]).astype(np.int64)
            for k in range(num_parts)]
    pieces = [[refs[k + 1] for refs in second] for k in range(num_parts)]
    return Partitions(rows, pieces, len(index.blocks))


def gather_pieces(pieces: list[ShardInput], worker: int, done: set[int]) -> ShardInput:
    """A worker's pieces as one ShardInput in input order, rows in `done` to skip."""
    rows, inputs, ids, prompts = [], [], [], []
    for p in pieces:
        rows += p.rows
        inputs += p.inputs
        ids += p.ids
        prompts += p.prompts
    order = sorted(range(len(rows)), key=rows.__getitem__)
    rows = [rows[j] for j in order]
    return ShardInput(worker, rows, [inputs[j] for j in order], [ids[j] for j in order],
                      [prompts[j] for j in order], [j for j, i in enumerate(rows) if i in done])
