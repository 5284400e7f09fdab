"""One run per output: an exclusive OS file lock on "<output>.lock", beside the output.

The lock is flock(2) on an open file: the kernel releases it when the holding process ends, however
it ends (kill -9 included), so there is never a stale lock to clean. The file holds who took it
(pid, host, start time, command) so that a refused run can name the holder; it is removed when the
holder releases it. Acquiring checks, after flock succeeds, that the path still names the file it
locked: a holder that removed the file just before (its release) would otherwise let two runs lock
two different files.

The lock file is opened with O_NOFOLLOW and must be a regular file: a symlink or a FIFO planted
under its name in a shared output folder is refused (OSError), never followed. Its holder's
command is recorded with the credentials of any URI in it redacted (rows/redact.py).

Not covered: file systems whose locks do not reach other machines (NFS without lockd, some FUSE
and SMB mounts). Object storage has no lock at all: for an s3:// (gs://, ...) output the lock is
taken on a local file named after the output (in $BATCHLLM_CACHE or ~/.cache/batchllm/locks, a
folder made 0700), so it stops a second run on the same machine only (`local_only`).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import socket
import stat
import sys
import time
from dataclasses import dataclass
from typing import Self

from batchllm.rows import storage
from batchllm.rows.redact import redact


@dataclass(frozen=True)
class Holder:
    """Who holds a lock."""

    pid: int | None
    host: str
    started: str  # local time, ISO 8601
    command: str

    def describe(self) -> str:
        if self.pid is None:
            return "a run that has just started"
        return f"pid {self.pid} on {self.host}, started {self.started}"


class OutputLocked(Exception):
    """Another run holds the output's lock."""

    def __init__(self, output: str, lock_path: str, holder: Holder) -> None:
        super().__init__(output, lock_path, holder)
        self.output, self.lock_path, self.holder = output, lock_path, holder

    def __str__(self) -> str:
        return (f"output.path: another run is writing {self.output} "
                f"({self.holder.describe()}; lock {self.lock_path})")


def lock_path(output: str) -> str:
    """The lock file of an output: beside it, or for object storage a local file."""
    if not storage.is_remote(output):
        return os.path.abspath(output) + ".lock"
    cache = os.environ.get("BATCHLLM_CACHE") or os.path.expanduser("~/.cache/batchllm")
    digest = hashlib.blake2b(output.encode(), digest_size=12).hexdigest()
    return os.path.join(cache, "locks", f"{digest}.lock")


def _read_holder(path: str, tries: int = 20) -> Holder:
    """The holder written in the lock file; a holder that has locked but not yet written it is
    given a moment (it writes right after flock)."""
    for _ in range(tries):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd) as f:
                d = json.loads(f.read())
            return Holder(int(d["pid"]), str(d["host"]), str(d["started"]), str(d["command"]))
        except (OSError, ValueError, KeyError, TypeError):
            time.sleep(0.05)
    return Holder(None, "?", "?", "?")


class OutputLock:
    """The exclusive lock of one output; `acquire` raises OutputLocked when another run has it."""

    def __init__(self, output: str) -> None:
        self.output = output
        self.path = lock_path(output)
        self.local_only = storage.is_remote(output)
        self._fd: int | None = None

    def acquire(self) -> Self:
        """Take the lock; OutputLocked when another run holds it, OSError when the lock file
        cannot be created or is not a regular file (a planted symlink: ELOOP)."""
        os.makedirs(os.path.dirname(self.path), mode=0o700 if self.local_only else 0o777,
                    exist_ok=True)
        while True:
            # not inherited (PEP 446); a symlink is never followed
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise OSError(f"{self.path} is not a regular file")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise OutputLocked(self.output, self.path, _read_holder(self.path)) from None
            try:
                same = os.path.samestat(os.fstat(fd), os.lstat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the previous holder removed the file as we opened it: again
        holder = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                  "command": redact(" ".join(sys.argv))}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Remove the lock file, then release the lock (in this order: see the module
        docstring). Nothing when not held."""
        if self._fd is None:
            return
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass
        os.close(self._fd)  # closing the last descriptor releases the flock
        self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> Self:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
