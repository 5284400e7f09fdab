"""The error log: the full traceback of an unexpected failure, credentials redacted, readable by
its owner only, beside the output or else in a private folder of this user's."""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

from batchllm.config import JobConfig
from batchllm.rows import storage
from batchllm.rows.redact import redact


def write_error_log(cfg: JobConfig | None, error: BaseException) -> str:
    """The full traceback of an unexpected failure, credentials redacted, in
    "<output>.error.log", readable by its owner only; where that cannot be written (or without a
    config), in a private folder (error_log_folder). Returns where it went."""
    name = cfg.name if cfg else "?"
    text = redact(f"batchllm run of job {name!r} failed at {time.strftime('%Y-%m-%d %H:%M:%S')}"
                  f"\ncommand: {' '.join(sys.argv)}\n\n"
                  + "".join(traceback.format_exception(error)))
    data = text.encode()
    try:
        if cfg is None:
            raise OSError("no output path")
        path = cfg.output.path + ".error.log"
        storage.makedirs(storage.dirname(path))
        storage.write_atomic(path, lambda f: f.write(data), mode=0o600)
    except OSError:
        path = os.path.join(error_log_folder(), f"batchllm-{os.getpid()}.error.log")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    return redact(path)


def error_log_folder() -> str:
    """A folder of this user's only, for error logs with nowhere else to go: $BATCHLLM_CACHE/logs
    or ~/.cache/batchllm/logs (0700), else a new private folder in the temporary folder."""
    try:
        env = os.environ.get("BATCHLLM_CACHE")
        folder = (Path(env).expanduser() if env else Path.home() / ".cache" / "batchllm") / "logs"
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(folder)
        if os.path.isdir(folder) and st.st_uid == os.getuid() and not st.st_mode & 0o077:
            return str(folder)
    except (OSError, RuntimeError):  # RuntimeError: no home directory
        pass
    return tempfile.mkdtemp(prefix="batchllm-log-")



__all__ = ["error_log_folder", "write_error_log"]
