"""model.path -> the local Hugging Face folder a run reads: a built-in alias or a .gguf file
(converted once, gguf.py), a folder of config.json, safetensors weights (one file or shards with
their index, shards.py) and tokenizer files, or a hub id org/name (hub.py)."""

from __future__ import annotations

from pathlib import Path

from batchllm.model import gguf, hub
from batchllm.model.errors import ModelNotFoundError
from batchllm.model.shards import weight_files

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def resolve_model(path: str, revision: str | None = None, config_only: bool = False) -> Path:
    """The local folder of model.path `path`, without loading anything from it (the weights'
    files of it: shards.weight_files): an existing folder, a .gguf file, a built-in alias
    (case-insensitive), else a hub id found in or fetched into the Hugging Face cache at
    `revision`. `config_only`: only config.json is needed (and fetched). Raises
    ModelNotFoundError with a message that names what was looked for and where."""
    local = Path(path).expanduser()
    alias = path.strip().lower()
    if local.is_dir():
        folder = local.resolve()
    elif alias in gguf.ALIASES:
        folder = gguf.alias_folder(alias)
    elif local.suffix.lower() == ".gguf" and local.is_file():
        folder = gguf.gguf_folder(local.resolve())
    elif hub.is_hub_id(path) and not local.exists() and local.suffix.lower() != ".gguf":
        return _checked(hub.hub_folder(path, revision, config_only), config_only)
    else:
        if local.exists():
            check_model_folder(local)  # not a folder: says so
        known = ", ".join(sorted(gguf.ALIASES))
        raise ModelNotFoundError(
            f"model.path: {path}: no such folder or .gguf file, not a built-in alias "
            f"(built-in: {known}) nor a hub id (org/name)")
    if revision is not None:
        raise ModelNotFoundError(f"model.revision: {revision}: only a hub id (org/name) takes a "
                                 f"revision; model.path {path} is a local model")
    return _checked(folder, config_only)


def _checked(folder: Path, config_only: bool) -> Path:
    if config_only:
        if not (folder / "config.json").is_file():
            raise ModelNotFoundError(f"model.path: {folder}: no config.json")
        return folder
    check_model_folder(folder)
    return folder


def check_model_folder(folder: Path) -> None:
    """Raise ModelNotFoundError naming what a Hugging Face model folder lacks."""
    if not folder.is_dir():
        raise ModelNotFoundError(f"model.path: {folder}: not a folder")
    missing = []
    if not (folder / "config.json").is_file():
        missing.append("config.json")
    if not weight_files(folder):
        missing.append("*.safetensors weights")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        missing.append("tokenizer files (" + " or ".join(TOKENIZER_FILES) + ")")
    if missing:
        raise ModelNotFoundError(
            f"model.path: {folder}: not a Hugging Face model folder, missing " + ", ".join(missing)
        )
