"""The input in blocks, for jobs too large to read on one machine (engine.sharding partition):
the driver reads an index (ids, row count, blocks of whole row groups) and checks every column's
type from the files' schemas; tasks read one block each. Same files, order and checks as
`reader.read_input`. Blocks are row groups: Parquet input only.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from batchllm.config import SAMPLING_FIELDS, ConfigError, InputConfig
from batchllm.rows import storage
from batchllm.rows.json_lines import lines
from batchllm.rows.reader import (
    InputRows,
    _check_schema,
    _concat,
    _ids,
    _missing,
    _plain,
    _read,
    _read_file,
    _rows,
    _text_field,
    input_files,
)
from batchllm.rows.tables import file_format, row_count

BLOCK_ROWS = 65536  # rows of an input block (whole row groups; a file's last block may be short)


@dataclass(frozen=True)
class InputBlock:
    """Consecutive row groups of one input file: the unit that one task reads."""

    file: str
    row_groups: tuple[int, ...]
    first_row: int  # row index (over all files) of the block's first row
    num_rows: int


@dataclass(frozen=True)
class InputIndex:
    """The input without its text: ids, row count and blocks (a sharded job's driver reads
    only this; tasks read the blocks)."""

    ids: pa.Array
    num_rows: int
    files: tuple[str, ...]
    blocks: tuple[InputBlock, ...]


def count_rows(cfg: InputConfig) -> int:
    """The number of input rows (of Parquet files, from their footers)."""
    if cfg.format == "openai-batch":
        return sum(1 for f in input_files(cfg.path, cfg.format)
                   for line in lines(f) if line.strip())
    return sum(row_count(f, cfg.format) for f in input_files(cfg.path, cfg.format))


def _metadata(file: str) -> pq.FileMetaData:
    try:
        return pq.read_metadata(storage.arrow_source(file))
    except (OSError, pa.ArrowException) as e:
        raise ConfigError(f"input.path: cannot read {file} as Parquet: {e}") from None


def read_index(cfg: InputConfig, block_rows: int = BLOCK_ROWS,
               sampling_fields: tuple[str, ...] = SAMPLING_FIELDS) -> InputIndex:
    """Ids (checked as read_input checks them), row count and blocks of about `block_rows`
    rows (whole row groups), reading only the id column; the text column must exist and every
    column's type is checked from the schema, so a bad job stops before anything runs."""
    files = input_files(cfg.path, cfg.format)
    text, field = _text_field(cfg)
    tables, blocks, first = [], [], 0
    for file in files:
        if cfg.format == "openai-batch" or file_format(file, cfg.format) != "parquet":
            raise ConfigError(f"engine.sharding: partition reads Parquet input only, and "
                              f"{file} is not Parquet; set engine.sharding: tree")
        meta = _metadata(file)
        schema = meta.schema.to_arrow_schema()
        if text not in schema.names:
            raise _missing(field, text, file, schema.names)
        _check_schema(schema, cfg, sampling_fields)
        tables.append(_read(file, cfg, [cfg.id_column])[0])
        group: list[int] = []
        rows = 0
        for g in range(meta.num_row_groups):
            group.append(g)
            rows += meta.row_group(g).num_rows
            if rows >= block_rows or g == meta.num_row_groups - 1:
                blocks.append(InputBlock(file, tuple(group), first, rows))
                first, group, rows = first + rows, [], 0
    table = _concat(tables)
    # (a table of no columns, when there is no id column, has no rows: count from the footers)
    return InputIndex(_ids(table, cfg, files, tables, first), first, tuple(files), tuple(blocks))


def read_block(cfg: InputConfig, block: InputBlock,
               sampling_fields: tuple[str, ...] = SAMPLING_FIELDS) -> InputRows:
    """The rows of one block (ids: the id column, or row indices over all files)."""
    table, bad = _read_file(block.file, cfg, sampling_fields, list(block.row_groups))
    if cfg.id_column and cfg.id_column in table.column_names:
        ids = _plain(table.column(cfg.id_column).combine_chunks())
    else:
        ids = pa.array(range(block.first_row, block.first_row + table.num_rows), pa.int64())
    return _rows(table, ids, cfg, (block.file,), sampling_fields, bad)
