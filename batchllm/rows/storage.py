"""Where the job's files live: local paths, or object storage URIs (s3://, gs://, abfs://, ...).

Object stores go through pyarrow.fs (S3, GCS, Azure); a scheme pyarrow lacks goes through fsspec
(wrapped as a pyarrow file system). S3 credentials, region and endpoint come from the usual
environment (AWS_ACCESS_KEY_ID, AWS_DEFAULT_REGION, AWS_ENDPOINT_URL, ...), or from the URI
(s3://key:secret@bucket/...): rows/redact.py takes them out of every text the job prints or
records.

Writes are whole or nothing (`write_atomic`): a local file through kernels/atomic_write.py (a
temporary file under a fresh random name beside it, synced, renamed over `path`); an object
store has no rename, but an object appears only once its upload completes: a small file is
serialized in memory and uploaded in one request; a large one (stream=True: the final file) is
streamed to a temporary object beside it, then moved (a copy inside the store) over `path`.
Either way a reader never sees half a file, and a failed write leaves no temporary file behind
and raises WriteFailed.
"""

from __future__ import annotations

import io
import os
import posixpath
import re
import secrets
import shutil
from collections.abc import Callable
from functools import lru_cache
from typing import IO, Any
from urllib.parse import urlsplit

from batchllm.rows.redact import redact
from batchllm_kernels.atomic_write import write_atomic as write_local

_URI = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")


class WriteFailed(OSError):
    """A file could not be written (disk full, permissions, the object store refused)."""

    def __init__(self, path: str, cause: BaseException) -> None:
        reason = getattr(cause, "strerror", None) or str(cause) or type(cause).__name__
        super().__init__(getattr(cause, "errno", None), reason)
        self.path = path
        self.reason = reason

    def __str__(self) -> str:
        return redact(f"cannot write {self.path}: {self.reason}")


def is_remote(path: str) -> bool:
    """Whether `path` is an object-storage (or other non-local) URI."""
    m = _URI.match(path)
    return bool(m) and m.group(1).lower() != "file"


def _local(path: str) -> str:
    return path.removeprefix("file://")


@lru_cache(maxsize=32)
def _filesystem(root: str) -> tuple[Any, str]:
    """(a pyarrow FileSystem, the prefix its paths take) for "scheme://netloc"."""
    import pyarrow.fs as pafs

    try:
        fs, inner = pafs.FileSystem.from_uri(root + "/x")
    except (pafs.ArrowInvalid, ValueError, NotImplementedError, OSError):
        import fsspec  # a scheme pyarrow has no file system for

        fs = pafs.PyFileSystem(pafs.FSSpecHandler(fsspec.filesystem(urlsplit(root).scheme)))
        inner = root + "/x"
    return fs, inner[:-1]


def _fs(path: str) -> tuple[Any, str]:
    """(file system, its path for `path`) of a URI."""
    parts = urlsplit(path)
    fs, prefix = _filesystem(f"{parts.scheme}://{parts.netloc}")
    return fs, prefix + parts.path.lstrip("/")


def join(folder: str, name: str) -> str:
    return posixpath.join(folder, name) if is_remote(folder) else os.path.join(folder, name)


def dirname(path: str) -> str:
    return posixpath.dirname(path) if is_remote(path) else os.path.dirname(_local(path))


def absolute(path: str) -> str:
    """A local path made absolute (workers may start elsewhere); a URI as it is."""
    return path if is_remote(path) else os.path.abspath(_local(path))


def _info(path: str):
    fs, inner = _fs(path)
    return fs.get_file_info(inner)


def exists(path: str) -> bool:
    if not is_remote(path):
        return os.path.exists(_local(path))
    import pyarrow.fs as pafs

    return _info(path).type != pafs.FileType.NotFound


def is_dir(path: str) -> bool:
    if not is_remote(path):
        return os.path.isdir(_local(path))
    import pyarrow.fs as pafs

    return _info(path).type == pafs.FileType.Directory


def is_file(path: str) -> bool:
    if not is_remote(path):
        return os.path.isfile(_local(path))
    import pyarrow.fs as pafs

    return _info(path).type == pafs.FileType.File


def list_dir(folder: str) -> list[str]:
    """The names of the files directly in `folder`, sorted ([] when it does not exist)."""
    if not is_remote(folder):
        folder = _local(folder)
        return sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    import pyarrow.fs as pafs

    fs, inner = _fs(folder)
    infos = fs.get_file_info(pafs.FileSelector(inner, allow_not_found=True))
    return sorted(posixpath.basename(i.path) for i in infos if i.type == pafs.FileType.File)


def walk_files(folder: str) -> list[str]:
    """Every file under `folder`, recursively, skipping names (and folders) that start with '.'
    or '_' (_SUCCESS, _tmp, .hidden); sorted full paths."""
    hidden = (".", "_")
    if not is_remote(folder):
        out = []
        for root, dirs, names in os.walk(_local(folder)):
            dirs[:] = [d for d in dirs if not d.startswith(hidden)]
            out += [os.path.join(root, n) for n in names if not n.startswith(hidden)]
        return sorted(out)
    import pyarrow.fs as pafs

    fs, inner = _fs(folder)
    base = folder.rstrip("/")
    out = []
    for i in fs.get_file_info(pafs.FileSelector(inner, recursive=True, allow_not_found=True)):
        rel = i.path[len(inner.rstrip("/")) + 1:]
        if i.type == pafs.FileType.File and not any(p.startswith(hidden) for p in rel.split("/")):
            out.append(f"{base}/{rel}")
    return sorted(out)


def glob(pattern: str) -> list[str]:
    """The files matching a glob pattern (`**` spans folders), sorted."""
    if not is_remote(pattern):
        import glob as globmod

        return sorted(p for p in globmod.glob(_local(pattern), recursive=True)
                      if os.path.isfile(p))
    head = re.split(r"[*?\[]", pattern, maxsplit=1)[0]
    regex = _glob_regex(pattern)
    return [f for f in walk_files(head.rsplit("/", 1)[0]) if regex.fullmatch(f)]


def _glob_regex(pattern: str) -> re.Pattern:
    """`*` and `?` within one folder name, `**` across folders, `[...]` a character class."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
            continue
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        end = pattern.find("]", i + 2) if c == "[" else -1
        out.append("[^/]*" if c == "*" else "[^/]" if c == "?" else
                   pattern[i:end + 1] if end > 0 else re.escape(c))
        i = end + 1 if end > 0 else i + 1
    return re.compile("".join(out))


def makedirs(folder: str) -> None:
    """Create a local folder and its parents; object stores have no folders to create."""
    if folder and not is_remote(folder):
        os.makedirs(_local(folder), exist_ok=True)


def remove(path: str) -> None:
    """Remove a file; nothing when it is not there."""
    if not is_remote(path):
        try:
            os.remove(_local(path))
        except FileNotFoundError:
            pass
        return
    if exists(path):
        fs, inner = _fs(path)
        fs.delete_file(inner)


def remove_tree(folder: str) -> None:
    """Remove a folder and everything in it; nothing when it is not there."""
    if not is_remote(folder):
        shutil.rmtree(_local(folder), ignore_errors=True)
        return
    if exists(folder):
        fs, inner = _fs(folder)
        fs.delete_dir(inner)


def move(src: str, dst: str) -> None:
    """Move a file (a rename locally; copy then delete on object stores)."""
    if not is_remote(src):
        makedirs(os.path.dirname(_local(dst)))
        os.replace(_local(src), _local(dst))
        return
    fs, inner = _fs(src)
    fs.move(inner, _fs(dst)[1])


def arrow_source(path: str):
    """What pyarrow readers take for `path`: the path itself, or an open remote file."""
    if not is_remote(path):
        return _local(path)
    fs, inner = _fs(path)
    return fs.open_input_file(inner)


def open_bytes(path: str) -> IO[bytes]:
    """`path` opened for reading bytes (close it, or use it in a with block)."""
    if not is_remote(path):
        return open(_local(path), "rb")
    fs, inner = _fs(path)
    return fs.open_input_stream(inner)


def write_atomic(path: str, write: Callable[[IO[bytes]], None], stream: bool = False,
                 mode: int | None = None) -> None:
    """write(file object) into `path`, whole or not at all (see the module docstring). Raises
    WriteFailed naming `path` when it cannot be written; no temporary file is left behind.
    stream: on object storage, write through a temporary object instead of memory (for a file
    too large to hold; locally every write streams). mode: a local file's permission bits
    (default: as open() makes them)."""
    if not is_remote(path):
        try:
            write_local(_local(path), write, mode=mode)
        except OSError as e:  # pyarrow's write errors are OSErrors too (ArrowIOError)
            raise WriteFailed(path, e) from e
        return
    fs, inner = _fs(path)
    if not stream:
        buffer = io.BytesIO()
        write(buffer)
        try:
            with fs.open_output_stream(inner) as out:
                out.write(buffer.getbuffer())
        except OSError as e:
            raise WriteFailed(path, e) from e
        return
    folder, name = posixpath.split(inner)
    tmp = posixpath.join(folder, f".{name}.tmp-{secrets.token_hex(8)}")  # readers skip "."
    try:
        with fs.open_output_stream(tmp) as out:
            write(out)
        fs.move(tmp, inner)
    except OSError as e:
        raise WriteFailed(path, e) from e
    finally:
        try:
            if fs.get_file_info(tmp).type != _not_found():
                fs.delete_file(tmp)
        except OSError:
            pass


def _not_found():
    import pyarrow.fs as pafs

    return pafs.FileType.NotFound


def write_text(path: str, text: str) -> None:
    """Text (UTF-8) into `path`, whole or not at all."""
    data = text.encode()
    write_atomic(path, lambda f: f.write(data))
