"""A job's fingerprint: what a checkpoint's parts must match for a resume to use them."""

from __future__ import annotations

import hashlib
import os

from batchllm.config import JobConfig
from batchllm.rows import storage


def _file_digest(path: str) -> str:
    h = hashlib.blake2b(digest_size=16)
    with storage.open_bytes(path) as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fingerprint(cfg: JobConfig, files: tuple[str, ...]) -> dict:
    """What must not change between a run and its resume: the model, the input and its
    contents, the sampling settings. Engine settings and the order may change."""
    d = cfg.to_dict()
    return {
        "model": d["model"]["path"],
        "dtype": d["model"]["dtype"],
        "input": {k: v for k, v in d["input"].items() if k != "path"},
        "sampling": d["sampling"],
        "files": [[os.path.basename(f), _file_digest(f)] for f in files],
        "include": [cfg.output.include_prompt, cfg.output.include_token_ids],
    }
