"""A job's fingerprint: what a checkpoint's parts and a final file must match for a resume to
use them. It is written into each part and into the final file's metadata.

Two kinds of field:
  identity  what makes a part another job's: the input's contents, the prompt settings, the
            sampling, the columns asked for. A part of another job is moved aside (its rows
            run again).
  numerics  (the "numerics" key) what changes the numbers a row gets: the model's files
            (config, tokenizer and weight files by name, size and mtime), the resolved dtype
            and device, the kernel path, the weight and KV formats. A part with the job's
            identity and other numerics is refused (ConfigError): one file never mixes them.
Engine settings that do not change a row's numbers (page size, token budget, order, workers)
may change between a run and its resume.
"""

from __future__ import annotations

import hashlib
import json
import os

from batchllm.config import JobConfig
from batchllm.rows import storage

NUMERICS = "numerics"
# a model folder's files that decide its numbers: these names, and every *.safetensors
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer.model",
               "tokenizer_config.json", "special_tokens_map.json")


def _file_digest(path: str) -> str:
    h = hashlib.blake2b(digest_size=16)
    with storage.open_bytes(path) as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def model_files(folder: str | os.PathLike) -> list[list]:
    """[name, size, mtime_ns] of each file of a model folder that decides its numbers."""
    out = []
    for name in sorted(os.listdir(folder)):
        if name in MODEL_FILES or name.endswith(".safetensors"):
            st = os.stat(os.path.join(folder, name))  # a hub cache's symlink: its blob
            out.append([name, st.st_size, st.st_mtime_ns])
    return out


def fingerprint(cfg: JobConfig, files: tuple[str, ...], numerics: dict) -> dict:
    """The job's identity (the input and its contents, the prompt and sampling settings, the
    columns asked for) and `numerics` (resume.numerics: what the run's numbers depend on)."""
    d = cfg.to_dict()
    return {
        "input": {k: v for k, v in d["input"].items() if k != "path"},
        "sampling": d["sampling"],
        "files": [[os.path.basename(f), _file_digest(f)] for f in files],
        "include": [cfg.output.include_prompt, cfg.output.include_token_ids],
        NUMERICS: numerics,
    }


def canonical(fp: dict) -> str:
    """The fingerprint as it is stored: JSON with sorted keys."""
    return json.dumps(fp, sort_keys=True, default=str)


def loads(text: str | bytes | None) -> dict:
    """A stored fingerprint ({} when there is none or it is not one)."""
    try:
        d = json.loads(text) if text else {}
    except ValueError:
        return {}
    return d if isinstance(d, dict) else {}


def identity(fp: dict) -> dict:
    """The identity fields of a fingerprint (everything but its numerics)."""
    return {k: v for k, v in fp.items() if k != NUMERICS}


def differences(theirs: dict, ours: dict) -> list[str]:
    """The fields that differ: top-level keys, and numerics.<key> for the numerics."""
    keys = sorted(k for k in set(identity(theirs)) | set(identity(ours))
                  if theirs.get(k) != ours.get(k))
    a, b = theirs.get(NUMERICS), ours.get(NUMERICS)
    if isinstance(a, dict) and isinstance(b, dict):
        keys += [f"{NUMERICS}.{k}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    elif a != b:
        keys.append(NUMERICS)
    return keys


def numerics_changed(where: str, theirs: dict, ours: dict) -> str:
    """The message refusing to resume `where` with other numerics."""
    a, b = theirs.get(NUMERICS) or {}, ours.get(NUMERICS) or {}
    what = ", ".join(f"{k}: {a.get(k)!r} then, {b.get(k)!r} now"
                     for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k) and k != "model")
    if a.get("model") != b.get("model"):
        what = "the model's files" + (f", {what}" if what else "")
    return (f"output.mode: {where} was computed with other numerics ({what or 'unknown'}); a "
            "resume would mix them in one file: use output.mode: overwrite to start again, or "
            "run as before")
