"""The panel file's format (panel_cache.py keeps one beside each model): a header, then every
projection's tensors one after another.

  b"BLLMPNL1" | header length u64 | crc32 of the header u32 | header (JSON) | padding | data

The header holds the store's key, one entry a projection and the file's total length. An entry
names its shape [N, K] and the offset of each of its tensors (`Packed`: panels, bias; null
where it has none). The tensors lie in the entries' order, each at the next 64-byte boundary,
from the first whole page after the header; their shapes follow from [N, K]. A header is taken
only when it is exactly that placement of what it records, ending at the file's end: a dropped
or added bias, a truncated file all move an offset or the length and are refused, as a damaged
header is by its crc32.
"""

from __future__ import annotations

import json
import math
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from batchllm_kernels.atomic_write import write_atomic
from batchllm_kernels.cpu import linear as cpu_linear

MAGIC = b"BLLMPNL1"
FILE_NAME = "batchllm_panels.bin"
_ALIGN = 64  # every tensor's offset: the kernel wants 32-byte aligned panels
_PREFIX = struct.Struct("<8sQI")  # magic, header length, crc32 of the header
_FIELDS = ("panels", "bias")  # an entry's tensors, in the file's order
_DTYPES = {"panels": torch.float32, "bias": torch.float32}


@dataclass(frozen=True)
class Packed:
    """One projection in the C kernel's layout (the arguments of kernels/cpu/linear.py)."""

    panels: torch.Tensor  # [P, K, 16] float32, P = ceil(N / 16): pack_panels
    bias: torch.Tensor | None  # [16 P] float32: pack_bias, None without a bias


def read_header(path: Path) -> dict | None:
    """The header of a panel file, or None when the file is missing, truncated, damaged or not
    laid out as its header says."""
    try:
        with open(path, "rb") as f:
            prefix = f.read(_PREFIX.size)
            if len(prefix) != _PREFIX.size:
                return None
            magic, length, crc = _PREFIX.unpack(prefix)
            if magic != MAGIC or length > 1 << 24:
                return None
            text = f.read(length)
            size = os.fstat(f.fileno()).st_size
    except OSError:
        return None
    if len(text) != length or zlib.crc32(text) != crc:
        return None
    try:
        header = json.loads(text)
    except ValueError:
        return None
    if (not isinstance(header, dict) or header.get("file_bytes") != size
            or not _well_formed(header, _PREFIX.size + length)):
        return None
    return header


def views(data: torch.Tensor, entry: dict) -> Packed:
    """The tensors of one entry of a taken header as views of the mapped file `data` (uint8)."""
    out = {}
    for field, shape in _shapes(entry).items():
        if entry[field] is not None:
            offset, dtype = entry[field], _DTYPES[field]
            out[field] = data[offset : offset + _bytes(shape, dtype)].view(dtype).view(shape)
    return Packed(out["panels"], out.get("bias"))


def write(path: Path, key: dict, built: list[tuple[int, Packed]]) -> bool:
    """The file at `path` of the projections `built` ((N, tensors) each, in order): a
    kernels/atomic_write.write_atomic (whole or not at all); False when that place cannot be written."""
    entries = []
    for n, packed in built:  # 0 marks a tensor that is there, placed below
        entry = {f: None if getattr(packed, f) is None else 0 for f in _FIELDS}
        entry["shape"] = [n, packed.panels.shape[1]]
        entries.append(entry)
    # The header's own length moves the data: room for it is reserved in whole pages (each
    # offset grows by 10 digits at most once placed).
    draft = json.dumps({"key": key, "entries": entries, "file_bytes": 0}).encode()
    room = -(-(_PREFIX.size + len(draft) + 64 * len(entries) + 64) // 4096) * 4096
    end = _place(entries, room)
    header = json.dumps({"key": key, "entries": entries, "file_bytes": end}).encode()
    assert _PREFIX.size + len(header) <= room
    def fill(f) -> None:
        f.write(_PREFIX.pack(MAGIC, len(header), zlib.crc32(header)) + header)
        for entry, (_, packed) in zip(entries, built):
            for field in _FIELDS:
                if entry[field] is not None:
                    f.seek(entry[field])
                    f.write(getattr(packed, field).contiguous().numpy())  # no copy
        f.truncate(end)

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, fill, mode=0o644, durable=False)  # shared cache, may be lost
        return True
    except OSError:
        return False


def _shapes(entry: dict) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape in an entry, where it is there (kernels/cpu/linear.py's)."""
    n, k = entry["shape"]
    count = -(-n // cpu_linear.PANEL)
    return {"panels": (count, k, cpu_linear.PANEL), "bias": (count * cpu_linear.PANEL,)}


def _bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _place(entries: list[dict], start: int) -> int:
    """Set the offset of every tensor the entries hold (those not None), one after another
    from `start`, each 64-byte aligned; returns the end of the data, the file's length."""
    offset = start
    for entry in entries:
        shapes = _shapes(entry)
        for field in _FIELDS:
            if entry[field] is not None:
                entry[field] = offset
                offset = -(-(offset + _bytes(shapes[field], _DTYPES[field])) // _ALIGN) * _ALIGN
    return offset


def _well_formed(header: dict, data: int) -> bool:
    """Whether the header's entries are what `write` makes of their shapes: each offset where
    _place puts it from the first, itself at or after `data` (the header's end), the data
    ending at the file's end, and no other field."""
    try:
        entries = header["entries"]
        for entry in entries:
            n, k = entry["shape"]
            if not (isinstance(n, int) and isinstance(k, int) and n > 0 and k > 0):
                return False
            if set(entry) != {*_FIELDS, "shape"}:
                return False
        placed = [dict(entry) for entry in entries]
        start = entries[0]["panels"]
        return (isinstance(start, int) and start >= data
                and _place(placed, start) == header["file_bytes"] and placed == entries)
    except (KeyError, TypeError, ValueError, IndexError):
        return False
