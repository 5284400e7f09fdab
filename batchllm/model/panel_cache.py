"""The projection weights laid out for the C kernel (kernels/cpu/linear.py), kept in a file
beside the model so that a warm start maps them instead of laying out every weight again.

Each projection keeps up to two tensors, `Packed`: its panels (pack_panels, [P, K, 16]
float32) and padded bias. For SmolLM2-135M that is ~2.5 s of packing 538 MB at every load; a
warm start maps them and computes none.

One file per model folder: `batchllm_panels.bin` inside a folder batchllm converted itself (the
GGUF cache, gguf.py), else under cache_root()/panels/ (a user's own folder, or a read-only
one, is never written into); its format is panel_file.py's. The header carries the key (each
*.safetensors file's path, size, mtime_ns and inode, a digest of config.json, the layout: panel
width, dtype, LAYOUT_VERSION, and a digest of the code, Python and C, that lays it out) and one
entry a projection, in the order the model builds them. A file is served only when its header
is whole (crc32, length, every offset where the recorded shapes put it), its key
matches and each projection asks for the shape recorded at its place; anything else (a changed
weight file, layout or code, a truncated or damaged file, a stale order) is a miss: from there
on everything is laid out again and the file written anew at close. The data bytes carry no
checksum: reading 500 MB through crc32 costs 0.23 s here, as much as packing them, and they are
trusted as the safetensors bytes they come from are.

A hit maps the file read-only and copy-on-write (torch.from_file, shared=False): the tensors
are the page cache's pages, read as the first forward touches them; the unpacked projections
are never read (their safetensors pages stay untouched).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
from collections.abc import Iterator
from pathlib import Path

import torch

from batchllm.model import panel_file
from batchllm.model.panel_file import FILE_NAME, Packed, read_header
from batchllm_kernels.cpu import linear as cpu_linear

LAYOUT_VERSION = 3  # the file format (3: panels and bias only); the code is in the key by its digest

_ACTIVE: contextvars.ContextVar[PanelStore | None] = contextvars.ContextVar("panel_store",
                                                                            default=None)


# The code that decides what is laid out, in which order and where: a change to any of them is
# a new key (no version to remember to bump when a layer's build changes).
_CODE = [Path(__file__).parent / n for n in ("panel_cache.py", "panel_file.py", "linear.py",
                                             "layers.py", "experts.py", "decoder.py",
                                             "rotary.py", "families.py")]
_CODE += [Path(cpu_linear.__file__), Path(cpu_linear.__file__).with_suffix(".c")]


def pack(weight: torch.Tensor | list[torch.Tensor],  # [N, K] float32, or its row blocks
         bias: torch.Tensor | None) -> Packed:
    """Lay out one projection: its panels and bias."""
    panels = cpu_linear.pack_panels(weight)
    return Packed(panels, cpu_linear.pack_bias(bias, cpu_linear.rows(weight)))


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
    from batchllm.model.cache_dir import cache_root

    folder = folder.resolve()
    root = cache_root().resolve()
    inside = [folder / FILE_NAME] if (root / "models") in folder.parents else []
    name = hashlib.sha256(str(folder).encode()).hexdigest()[:16]
    return [*inside, root / "panels" / f"{folder.name}-{name}.bin"]


class PanelStore:
    """The layout of one model build: taken from the mapped file on a hit, made otherwise.

    Each projection asks `take` in the order the model builds them; `close` writes the file
    when anything was made (a miss, or a file that stopped matching part way)."""

    def __init__(self, folder: Path) -> None:
        self.key = source_key(folder)
        self.paths = cache_paths(folder)
        self.status = "miss"  # hit | written | miss (made, not written: no writable place)
        self._entries: list[dict] = []
        self._data: torch.Tensor | None = None  # the mapped file, uint8
        self._built: list[tuple[int, Packed]] = []  # (N, its tensors) a projection
        self._stale = True
        for path in self.paths:
            header = read_header(path)
            if header is None or header.get("key") != self.key:
                continue
            try:  # replaced meanwhile by another run: a miss, laid out and written again
                self._data = torch.from_file(str(path), shared=False, size=header["file_bytes"],
                                             dtype=torch.uint8)
            except (OSError, RuntimeError):
                continue
            self._entries = header["entries"]
            self._stale = False
            break

    def take(self, weight: torch.Tensor | list[torch.Tensor],  # [N, K] float32, or row blocks
             bias: torch.Tensor | None) -> Packed:  # [N] or None
        """One projection's layout (see `pack`); on a hit `weight` is not read."""
        n = cpu_linear.rows(weight)
        k = (weight if isinstance(weight, torch.Tensor) else weight[0]).shape[1]
        i = len(self._built)
        served = None
        if not self._stale and i < len(self._entries):
            served = self._serve(self._entries[i], n, k, bias is not None)
        if served is None:
            self._stale = True
            served = pack(weight, bias)
        self._built.append((n, served))
        return served

    def _serve(self, entry: dict, n: int, k: int, has_bias: bool) -> Packed | None:
        """The views of one entry, or None where it does not describe this projection."""
        if entry["shape"] != [n, k] or (entry["bias"] is not None) != has_bias:
            return None
        return panel_file.views(self._data, entry)

    def close(self) -> str:
        """Write the file if this build made anything; returns the status."""
        if not self._stale and len(self._built) == len(self._entries):
            self.status = "hit"
            return self.status
        if not self._built:  # a model without panels (another layout): nothing to keep
            self.status = "off"
            return self.status
        for path in self.paths:
            _sweep(path.parent)
            if panel_file.write(path, self.key, self._built):
                self.status = "written"
                break
        return self.status


def _sweep(folder: Path) -> None:
    """Remove the panel files of model folders that are gone (each as large as the model's
    projections) and the temporary files of writers killed an hour ago or more."""
    from batchllm.model.cache_dir import remove_stale_temps

    remove_stale_temps(folder, FILE_NAME)
    if folder.name != "panels":
        return
    for old in folder.glob("*.bin"):
        header = read_header(old)
        files = header["key"]["files"] if header and isinstance(header.get("key"), dict) else []
        if not files or not Path(files[0][0]).exists():
            with contextlib.suppress(OSError):
                old.unlink()


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
