"""Which safetensors files of a model folder hold its weights, and which tensor is in which.

A sharded checkpoint (model-0000k-of-0000n.safetensors) has an index, model.safetensors.index.json,
whose weight_map names each tensor's file: the index decides, and files it does not name are
never read (a Mistral repository ships consolidated.safetensors, the same weights under other
names, beside its shards). Without an index: model.safetensors, else every *.safetensors file.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open

from batchllm.model.errors import ModelNotFoundError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def weight_map(folder: Path) -> dict[str, str] | None:
    """The index's tensor name -> file name, or None where the folder has no index."""
    index = Path(folder) / INDEX
    if not index.is_file():
        return None
    try:
        names = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelNotFoundError(f"model.path: {folder}: {INDEX} is not a safetensors index "
                                 f"({type(e).__name__}: {e})") from e
    if not isinstance(names, dict) or not all(isinstance(v, str) for v in names.values()):
        raise ModelNotFoundError(f"model.path: {folder}: {INDEX}: weight_map is not a mapping "
                                 "of tensor names to file names")
    return names


def weight_files(folder: Path) -> list[Path]:
    """The files a load reads, sorted: the index's shards, else model.safetensors, else every
    *.safetensors file ([] when there is none). A shard the index names and the folder lacks is
    a ModelNotFoundError naming it."""
    folder = Path(folder)
    names = weight_map(folder)
    if names is None:
        single = folder / SINGLE
        return [single] if single.is_file() else sorted(folder.glob("*.safetensors"))
    files = [folder / n for n in sorted(set(names.values()))]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelNotFoundError(f"model.path: {folder}: {INDEX} names "
                                 f"{', '.join(missing[:3])}{more}, missing from the folder")
    return files


def tensor_files(folder: Path) -> dict[str, Path]:
    """Every tensor of the checkpoint -> the file holding it (the index's word, else each file's
    header; a header is read, no tensor data)."""
    folder = Path(folder)
    files = weight_files(folder)
    names = weight_map(folder)
    if names is not None:
        return {name: folder / file for name, file in names.items()}
    owners: dict[str, Path] = {}
    for file in files:
        with safe_open(file, "pt") as f:
            owners.update(dict.fromkeys(f.keys(), file))
    return owners
