"""The projection weights' panel layout (kernels/cpu/linear.py), kept in a file beside the model
so that a warm start maps it instead of packing every weight again.

One file per model folder: `batchllm_panels.bin` inside a folder batchllm converted itself (the
GGUF cache, weights.py), else under cache_root()/panels/ (a user's own folder, or a read-only
one, is never written into). It holds the panels of every projection in the order the model
builds them, after a header that names what they were packed from:

  b"BLLMPNL1" | header length u64 | crc32 of the header u32 | header (JSON) | padding | data

The header carries the key (each *.safetensors file's path, size, mtime_ns and inode, a digest
of config.json, the layout: panel width, dtype, LAYOUT_VERSION), every tensor's shape and
offset, and the file's total length. A file is served only when its crc32, its key and its
length all match and each projection asks for the shape recorded at its place; anything else
(a changed weight file or layout, a truncated or damaged header, a stale order) is a miss, and
the panels are packed and the file written again (a temporary file, then a rename). The data
bytes carry no checksum: reading 500 MB through crc32 costs 0.23 s here, as much as packing
them, and they are trusted as the safetensors bytes they come from are.

A hit maps the file read-only and copy-on-write (torch.from_file, shared=False): the panels
are the page cache's pages, read as the first forward touches them; the unpacked projections
are never read (their safetensors pages stay untouched).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import os
import struct
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch

from kernels.cpu import linear as cpu_linear

MAGIC = b"BLLMPNL1"
LAYOUT_VERSION = 1  # the file format; the code that packs is in the key by its digest
FILE_NAME = "batchllm_panels.bin"
_ALIGN = 64  # every tensor's offset: the kernel wants 32-byte aligned panels
_PREFIX = struct.Struct("<8sQI")  # magic, header length, crc32 of the header

_ACTIVE: contextvars.ContextVar[PanelStore | None] = contextvars.ContextVar("panel_store",
                                                                            default=None)


# The code that decides what is packed, in which order: a change to any of them is a new key
# (no version to remember to bump when a layer's build changes).
_CODE = [Path(__file__).parent / n for n in ("panel_cache.py", "linear.py", "layers.py",
                                             "experts.py", "decoder.py", "rotary.py",
                                             "families.py")]
_CODE += [Path(cpu_linear.__file__), Path(cpu_linear.__file__).with_suffix(".c")]


def source_key(folder: Path) -> dict:
    """What the panels depend on: the weight files' identity, the config, the layout and the
    code that builds it."""
    code = hashlib.sha256(b"".join(p.read_bytes() for p in _CODE)).hexdigest()
    files = []
    for f in sorted(folder.glob("*.safetensors")):
        s = f.stat()
        files.append([str(f.resolve()), s.st_size, s.st_mtime_ns, s.st_ino])
    config = folder / "config.json"
    digest = hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else ""
    return {"files": files, "config": digest, "panel": cpu_linear.PANEL, "dtype": "float32",
            "version": LAYOUT_VERSION, "code": code}


def cache_paths(folder: Path) -> list[Path]:
    """Where the panel file of `folder` may live, in the order tried: inside a folder batchllm
    made (the GGUF cache), then under cache_root()/panels/."""
    from batchllm.model.weights import cache_root  # weights imports transformers: not at import

    folder = folder.resolve()
    root = cache_root().resolve()
    inside = [folder / FILE_NAME] if (root / "models") in folder.parents else []
    name = hashlib.sha256(str(folder).encode()).hexdigest()[:16]
    return [*inside, root / "panels" / f"{folder.name}-{name}.bin"]


def read_header(path: Path) -> dict | None:
    """The header of a panel file, or None when the file is missing, truncated or damaged."""
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
    if not isinstance(header, dict) or header.get("file_bytes") != size:
        return None
    return header


class PanelStore:
    """The panels of one model build: taken from the mapped file on a hit, packed otherwise.

    Each projection asks `take` in the order the model builds them; `close` writes the file
    when anything was packed (a miss, or a file that stopped matching part way)."""

    def __init__(self, folder: Path) -> None:
        self.key = source_key(folder)
        self.paths = cache_paths(folder)
        self.status = "miss"  # hit | written | miss (packed, not written: no writable place)
        self._entries: list[dict] = []
        self._data: torch.Tensor | None = None  # the mapped file, uint8
        self._built: list[tuple[int, tuple[torch.Tensor, torch.Tensor | None]]] = []
        self._stale = True
        for path in self.paths:
            header = read_header(path)
            if header is None or header.get("key") != self.key:
                continue
            try:  # replaced meanwhile by another run: a miss, packed and written again
                self._data = torch.from_file(str(path), shared=False, size=header["file_bytes"],
                                             dtype=torch.uint8)
            except (OSError, RuntimeError):
                continue
            self._entries = header.get("entries") or []
            self._stale = False
            break

    def take(self, weight: torch.Tensor | list[torch.Tensor],  # [N, K] float32, or row blocks
             bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(panels [ceil(N / 16), K, 16], bias [16 ceil(N / 16)] or None) of one projection;
        on a hit `weight` is not read."""
        n = cpu_linear.rows(weight)
        k = (weight if isinstance(weight, torch.Tensor) else weight[0]).shape[1]
        i = len(self._built)
        served = None
        if not self._stale and i < len(self._entries):
            served = self._serve(self._entries[i], n, k, bias is not None)
        if served is None:
            self._stale = True
            served = cpu_linear.pack_panels(weight), cpu_linear.pack_bias(bias, n)
        self._built.append((n, served))
        return served

    def _serve(self, entry: dict, n: int, k: int,
               has_bias: bool) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The views of one entry, or None where it does not describe this projection."""
        try:
            return self._views(entry, n, k, has_bias)
        except (KeyError, TypeError, ValueError, RuntimeError):  # a header not of this writer
            return None

    def _views(self, entry: dict, n: int, k: int,
               has_bias: bool) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        if entry["shape"] != [n, k] or (entry["bias"] is not None) != has_bias:
            return None
        count = -(-n // cpu_linear.PANEL)
        end = max(entry["panels"] + 4 * count * k * cpu_linear.PANEL,
                  (entry["bias"] or 0) + 4 * count * cpu_linear.PANEL)
        if end > self._data.numel():
            return None
        panels = self._view(entry["panels"], (count, k, cpu_linear.PANEL))
        bias = self._view(entry["bias"], (count * cpu_linear.PANEL,)) if has_bias else None
        return panels, bias

    def _view(self, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
        count = 1
        for s in shape:
            count *= s
        return self._data[offset : offset + 4 * count].view(torch.float32).view(shape)

    def close(self) -> str:
        """Write the file if this build packed anything; returns the status."""
        if not self._stale and len(self._built) == len(self._entries):
            self.status = "hit"
            return self.status
        if not self._built:  # a model without panels (another layout): nothing to keep
            self.status = "off"
            return self.status
        for path in self.paths:
            _sweep(path.parent)
            if self._write(path):
                self.status = "written"
                break
        return self.status

    def _write(self, path: Path) -> bool:
        """The file at `path` (a temporary file beside it, then a rename); False when that
        place cannot be written."""
        entries, offset = [], 0  # offsets in the data; the header's room is added below
        for n, (panels, bias) in self._built:
            entry = {"shape": [n, panels.shape[1]], "panels": offset, "bias": None}
            offset = _aligned(offset + panels.numel() * 4)
            if bias is not None:
                entry["bias"] = offset
                offset = _aligned(offset + bias.numel() * 4)
            entries.append(entry)
        # The header's own length moves the data: room for it is reserved in whole pages.
        draft = json.dumps({"key": self.key, "entries": entries, "file_bytes": 0}).encode()
        room = -(-(_PREFIX.size + len(draft) + 16 * len(entries) + 64) // 4096) * 4096
        for entry in entries:
            entry["panels"] += room
            if entry["bias"] is not None:
                entry["bias"] += room
        header = json.dumps({"key": self.key, "entries": entries,
                             "file_bytes": offset + room}).encode()
        assert _PREFIX.size + len(header) <= room  # offsets grew by a digit at most
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{FILE_NAME}.tmp-", dir=path.parent)
            with os.fdopen(fd, "wb") as f:
                f.write(_PREFIX.pack(MAGIC, len(header), zlib.crc32(header)) + header)
                for entry, (_, (panels, bias)) in zip(entries, self._built):
                    for start, t in ((entry["panels"], panels), (entry["bias"], bias)):
                        if t is not None:
                            f.seek(start)
                            f.write(t.contiguous().numpy())  # [..] float32, no copy
                f.truncate(offset + room)
            os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache is shared
            os.replace(tmp, path)
            return True
        except OSError:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            return False


def _sweep(folder: Path) -> None:
    """Remove the panel files of model folders that are gone (each as large as the model's
    projections) and the temporary files of writers killed an hour ago or more."""
    from batchllm.model.weights import remove_stale_temps

    remove_stale_temps(folder, FILE_NAME)
    if folder.name != "panels":
        return
    for old in folder.glob("*.bin"):
        header = read_header(old)
        files = header["key"]["files"] if header and isinstance(header.get("key"), dict) else []
        if not files or not Path(files[0][0]).exists():
            with contextlib.suppress(OSError):
                old.unlink()


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


@contextlib.contextmanager
def serving(folder: Path) -> Iterator[PanelStore]:
    """Make a PanelStore of `folder` the one Linear packs through while a model is built."""
    store = PanelStore(folder)
    token = _ACTIVE.set(store)
    try:
        yield store
    finally:
        _ACTIVE.reset(token)
    store.close()


def active() -> PanelStore | None:
    """The store of the model being built, or None (then Linear packs by itself)."""
    return _ACTIVE.get()
