"""Load a model for the engine: resolve the path, read weights, tokenizer and stop tokens."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from batchllm.model.decoder import DecoderModel, model_shape
from batchllm.model.errors import ModelError
from batchllm.model.families import describe
from batchllm.model.weights import (
    eos_token_ids,
    load_config,
    load_tokenizer,
    load_weights,
    model_len_limit,
    resolve_model,
)


@dataclass
class LoadedModel:
    model: DecoderModel
    tokenizer: object  # a transformers fast tokenizer
    eos_ids: set[int]
    folder: Path
    name: str
    device: torch.device
    max_model_len: int


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelError("model.device: cuda was asked for but no CUDA device is available")
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def describe_model(path: str, dtype: str = "auto", device: str = "auto") -> dict[str, object]:
    """What `batchllm plan` says of the model without loading its weights: the family and the
    KV cache bytes per token in the dtype a run would use."""
    config = load_config(resolve_model(path))
    planned = torch.device("cuda" if device == "cuda" or (
        device == "auto" and torch.cuda.is_available()) else "cpu")
    return {"model_family": describe(config).summary(),
            "kv_bytes_per_token": model_shape(config).kv_bytes_per_token(
                pick_dtype(dtype, planned))}


def load_model(
    path: str, dtype: str = "auto", device: str = "auto", max_model_len: int | None = None
) -> LoadedModel:
    """`path` is a built-in alias or a local Hugging Face folder."""
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    folder = resolve_model(path)
    describe(load_config(folder))  # an unsupported family fails before its weights are read
    config, state = load_weights(folder, dt, dev)
    limit = model_len_limit(config, max_model_len)
    tokenizer = load_tokenizer(folder)
    model = DecoderModel(config, state, limit, folder)
    return LoadedModel(model, tokenizer, eos_token_ids(folder, config, tokenizer), folder,
                       str(path), dev, limit)
