"""The one write-then-rename helper: a file appears whole under its name or not at all.

Used by every layer that writes a file others read (the job's rows, metrics and logs; the model
caches; the C kernels' libraries), so it imports nothing of batchllm and sits at the bottom of the
import graph (tests/test_layers.py).

The temporary file is created beside the target under a fresh random name (O_CREAT | O_EXCL |
O_NOFOLLOW, as tempfile.mkstemp does): a name planted in a shared folder, a symlink included,
is never opened, so it cannot redirect the write, and two writers never share a temporary file.
The data are synced before the rename, and the folder after it, so that the rename survives a
power loss. On any failure the temporary file is removed and the error raised.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from typing import IO

_FILE_MODE = 0o666  # as open() creates a file, less the umask


def _umask() -> int:
    """The process's umask, read without changing it where Linux shows it."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # elsewhere: read by setting it, and set it back at once
    os.umask(mask)
    return mask


def sync_folder(folder: str) -> None:
    """fsync a folder, so that a rename in it survives a power loss (nothing where folders
    cannot be opened)."""
    if not hasattr(os, "O_DIRECTORY"):
        return
    fd = os.open(folder or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _bits(mode: int | None) -> int:
    return (_FILE_MODE & ~_umask()) if mode is None else mode


@contextlib.contextmanager
def _replacing(path: str | os.PathLike, bits: int, durable: bool) -> Iterator[tuple[int, str]]:
    """A fresh temporary file beside `path` with permission `bits`: its descriptor and its name.
    Closed and renamed over `path` when the block ends without an error (the folder synced if
    durable); closed and removed otherwise."""
    path = os.fspath(path)
    folder, name = os.path.split(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.tmp-", dir=folder)
    try:
        os.fchmod(fd, bits)
        yield fd, tmp
        os.close(fd)
        fd = -1
        os.replace(tmp, path)
        tmp = None
        if durable:
            sync_folder(folder)
    finally:
        if fd >= 0:
            os.close(fd)
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, mode: int | None = None,
                durable: bool = True) -> Iterator[str]:
    """A fresh temporary path beside `path`, for a writer that needs a name (a compiler's -o);
    renamed over `path` when the block ends without an error, removed otherwise.

    mode: the file's permission bits, set again once the writer is done (a linker makes its
    output anew); default: 0o666 less the umask, as open() gives. durable: fsync the file and
    the folder (off for caches that may be lost)."""
    bits = _bits(mode)
    with _replacing(path, bits, durable) as (_, tmp):
        yield tmp
        os.chmod(tmp, bits)
        if durable:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())


def write_atomic(path: str | os.PathLike, write: Callable[[IO[bytes]], None],
                 mode: int | None = None, durable: bool = True) -> None:
    """write(file) into `path`, whole or not at all (see the module docstring). The file object
    is a regular file opened for binary writing: it may seek and truncate."""
    with _replacing(path, _bits(mode), durable) as (fd, _), open(fd, "wb", closefd=False) as f:
        write(f)
        f.flush()
        if durable:
            os.fsync(f.fileno())
