"""model.path -> the local Hugging Face folder a run reads: a built-in alias or a .gguf file
(converted once, gguf.py) or a folder of config.json, *.safetensors and tokenizer files."""

from __future__ import annotations

from pathlib import Path

from batchllm.model import gguf
from batchllm.model.errors import ModelNotFoundError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def resolve_model(path: str, revision: str | None = None) -> Path:
    """The local folder of `path`, without loading anything from it: an existing folder, a
    .gguf file or a built-in alias (case-insensitive). Raises ModelNotFoundError with a message
    a user can act on."""
    if revision is not None:
        raise ModelNotFoundError(f"model.revision: {revision}: only hub ids take a revision")
    local = Path(path).expanduser()
    alias = path.strip().lower()
    if alias in gguf.ALIASES and not local.is_dir():
        return gguf.alias_folder(alias)
    if local.suffix.lower() == ".gguf" and local.is_file():
        return gguf.gguf_folder(local.resolve())
    if not local.exists():
        known = ", ".join(sorted(gguf.ALIASES))
        raise ModelNotFoundError(
            f"model.path: {path}: no such folder or .gguf file, and not a built-in alias "
            f"(built-in: {known})"
        )
    check_model_folder(local)
    return local.resolve()


def check_model_folder(folder: Path) -> None:
    """Raise ModelNotFoundError naming what a Hugging Face model folder lacks."""
    if not folder.is_dir():
        raise ModelNotFoundError(f"model.path: {folder}: not a folder")
    missing = []
    if not (folder / "config.json").is_file():
        missing.append("config.json")
    if not any(folder.glob("*.safetensors")):
        missing.append("*.safetensors weights")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        missing.append("tokenizer files (" + " or ".join(TOKENIZER_FILES) + ")")
    if missing:
        raise ModelNotFoundError(
            f"model.path: {folder}: not a Hugging Face model folder, missing " + ", ".join(missing)
        )
