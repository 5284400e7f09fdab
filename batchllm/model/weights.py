"""A checkpoint's tensors as a state dict with Hugging Face key names."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from batchllm.model.errors import ModelNotFoundError
from batchllm.model.hf_cache import load_config
from batchllm.model.shards import weight_files


def load_weights(folder: Path, dtype: torch.dtype, device: torch.device | str):
    """Read the checkpoint's files (shards.weight_files) into one state dict with Hugging Face
    key names.

    Floating tensors are cast to `dtype`, all moved to `device`. `lm_head.weight` is left out when
    the config ties it to `model.embed_tokens.weight` (as transformers does).
    Returns (config, state).
    """
    config = load_config(folder)
    files = weight_files(Path(folder))
    if not files:
        raise ModelNotFoundError(f"model.path: {folder}: no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in load_file(file, device="cpu").items():
            if name.endswith("rotary_emb.inv_freq"):
                continue  # a buffer some old checkpoints saved; recomputed from the config
            if tensor.is_floating_point():
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
