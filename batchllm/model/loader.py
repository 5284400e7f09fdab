"""Load a model for the engine: resolve the path, read weights, tokenizer and stop tokens."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from batchllm.model import panel_cache
from batchllm.model import tokenizer as tokenizers
from batchllm.model.decoder import DecoderModel, model_shape
from batchllm.model.errors import ModelError
from batchllm.model.families import describe
from batchllm.model.fp8_checkpoint import (
    KvScales,
    quantization_config,
    take_fp8_weights,
    take_kv_scales,
)
from batchllm.model.gguf_blocks import take_blocks
from batchllm.model.hf_cache import load_config
from batchllm.model.resolve import resolve_model
from batchllm.model.rotary import head_permutation, position_limit
from batchllm.model.tensor_parallel import load_shard
from batchllm.model.tokenizer import eos_token_ids
from batchllm.model.weights import give_back_freed_heap, load_weights


@dataclass
class LoadedModel:
    model: DecoderModel
    tokenizer: object  # a transformers fast tokenizer, or model/tokenizer.py's twin of one
    eos_ids: set[int]
    folder: Path
    name: str
    device: torch.device
    max_model_len: int
    panel_cache: str = "off"  # hit | written | miss (nowhere writable) | off (not panels, or off)
    first_forward: float | None = None  # perf_counter time the first forward began
    kv_scales: KvScales | None = None  # an FP8 KV cache's scales, where the checkpoint has them

    def __post_init__(self) -> None:
        # The end of start-up (metrics.Phases): noted by the model's own layers' pass
        # (`hidden`, which forward and the device runners call), at one check per step.
        hidden = self.model.hidden

        def noted(*args, **kwargs):
            if self.first_forward is None:
                self.first_forward = time.perf_counter()
            return hidden(*args, **kwargs)

        self.model.hidden = noted


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelError("model.device: cuda was asked for but no CUDA device is available")
    return torch.device(device)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """A tensor-parallel rank's device: on CUDA the rank's own GPU of those visible (cuda:rank;
    a Ray worker group sees its N devices as 0..N-1), made the current one before any weight is
    placed, so that NCCL never finds two ranks on one GPU; elsewhere the device as asked."""
    if device.type != "cuda":
        return device
    if rank >= torch.cuda.device_count():
        raise ModelError(f"engine.tensor_parallel: rank {rank} needs CUDA device {rank}; "
                         f"{torch.cuda.device_count()} visible")
    torch.cuda.set_device(rank)
    return torch.device("cuda", rank)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def model_len_limit(config, requested: int | None = None) -> int:
    """The longest sequence (prompt and completion) a run allows: the model's own limit, or
    model.max_model_len when the job asks for less. Phi-3's longrope models stop at
    original_max_position_embeddings (model/rotary.py says why)."""
    limit, why = position_limit(config)
    if requested is not None and requested > limit:
        raise ModelError(f"model.max_model_len: {requested} exceeds the model's limit of {limit}"
                         + (f" ({why})" if why else ""))
    return limit if requested is None else requested


def job_model(path: str, requested_len: int | None, revision: str | None = None):
    """What planning a job needs of its model without loading the weights: the tokenizer and
    the length limit (model_len_limit). An unsupported family fails here, before any row is
    tokenized."""
    folder = resolve_model(path, revision)
    config = load_config(folder)
    describe(config)
    return tokenizers.load(folder), model_len_limit(config, requested_len)


def load_model(
    path: str, dtype: str = "auto", device: str = "auto", max_model_len: int | None = None,
    revision: str | None = None, quantization: str | None = None,
    shard: tuple[int, int] | None = None,
) -> LoadedModel:
    """The model at `path` (resolve.resolve_model says what it may be), ready to run;
    quantization: None (as the checkpoint is) or "fp8" (its projections quantized at load);
    shard: (rank, ranks) for one rank's slice of it (model/tensor_parallel.py)."""
    dev = pick_device(device) if shard is None else rank_device(pick_device(device), shard[0])
    dt = pick_dtype(dtype, dev)
    folder = resolve_model(path, revision)
    found = load_config(folder)
    describe(found)  # an unsupported family fails before its weights are read
    if shard is not None and (quantization is not None or quantization_config(found)):
        raise ModelError("engine.tensor_parallel: FP8 weights (model.quantization: fp8, or an "
                         "FP8 checkpoint) are not split yet; use tensor_parallel: 1")
    config, state = load_weights(folder, dt, dev)
    if shard is not None:
        limit = model_len_limit(config, max_model_len)
        model = load_shard(config, state, limit, folder, *shard)
        tokenizer = tokenizers.load(folder)
        return LoadedModel(model, tokenizer, eos_token_ids(folder, config, tokenizer), folder,
                           str(path), dev, limit)
    shape = model_shape(config)
    if dev.type == "cpu" and dt == torch.float32 and quantization is None:  # gguf_blocks.py
        take_blocks(folder, state, bool(getattr(config, "tie_word_embeddings", False)),
                    attention=head_permutation(config) is None)
    kv_scales = take_kv_scales(state, shape.num_layers, shape.num_kv_heads)  # fp8_checkpoint.py
    take_fp8_weights(config, state, quantization, dt, head_permutation(config) is not None)
    limit = model_len_limit(config, max_model_len)
    tokenizer = tokenizers.load(folder)
    model, cached = _build(config, state, limit, folder)
    give_back_freed_heap()  # what the last layers' packing freed
    return LoadedModel(model, tokenizer, eos_token_ids(folder, config, tokenizer), folder,
                       str(path), dev, limit, cached, kv_scales=kv_scales)


def _build(config, state: dict[str, torch.Tensor], limit: int,
           folder: Path) -> tuple[DecoderModel, str]:
    """The model, its projections' panels through the panel file where the C kernel's layout
    is used (panel_cache.py; BATCHLLM_PANEL_CACHE=0 packs without it); and the file's status."""
    if os.environ.get("BATCHLLM_PANEL_CACHE", "1") == "0":
        return DecoderModel(config, state, limit, folder), "off"
    with panel_cache.serving(folder) as store:
        model = DecoderModel(config, state, limit, folder)
    return model, store.status
