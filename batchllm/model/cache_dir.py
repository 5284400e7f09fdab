"""Where batchllm keeps what it makes of models (converted GGUF folders, resolved configs and
tokenizers, panel files), and the sweep of temporary files that killed runs left there."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path


def cache_root() -> Path:
    """$BATCHLLM_CACHE, else ~/.cache/batchllm."""
    env = os.environ.get("BATCHLLM_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "batchllm"


def remove_stale_temps(parent: Path, name: str, age_s: float = 3600.0) -> None:
    """Temp folders (or files) `.<name>.tmp-*` of runs killed mid-write (an hour old: no live
    run is still writing)."""
    for old in parent.glob(f".{name}.tmp-*"):
        try:
            if time.time() - old.stat().st_mtime > age_s:
                if old.is_dir():
                    shutil.rmtree(old, ignore_errors=True)
                else:
                    old.unlink()
        except OSError:
            pass  # removed by another run meanwhile
