"""What transformers makes of a model folder's config (and tokenizer), kept as JSON so that a
warm start does not import transformers for them.

Config: AutoConfig fills what config.json leaves out with the family's defaults and rewrites old
keys (rope_theta / rope_scaling into rope_parameters, per layer type where the family has them);
importing a family's config class costs about 1 s here (it pulls in transformers' model-loading
and torch.distributed modules), transformers itself 0.4 s more. So the config is resolved by
transformers once, and what it says (`to_dict()`, plus every attribute batchllm reads,
properties included: READS) is stored in cache_root()/hf/, named by the digest of config.json
and the installed transformers version. Later loads read it into a ResolvedConfig.

The tokenizer is cached the same way (tokenizer.py). A changed file or an upgrade is a new
name, never a stale entry; an entry that cannot be read is resolved again.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
from pathlib import Path
from typing import Any

from batchllm.model.cache_dir import cache_root
from batchllm_kernels.atomic_write import write_atomic

# Every attribute of a config that batchllm's model code reads (families.py, rotary.py,
# decoder.py, loader.py, experts.py); tests/test_hf_cache.py checks the code against it.
READS = (
    "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
    "max_position_embeddings", "original_max_position_embeddings", "rms_norm_eps",
    "rope_parameters", "partial_rotary_factor", "layer_types", "sliding_window", "hidden_act",
    "hidden_activation", "attention_bias", "mlp_bias", "qkv_bias", "tie_word_embeddings",
    "eos_token_id", "use_bidirectional_attention", "query_pre_attn_scalar",
    "attn_logit_softcapping", "final_logit_softcapping", "num_experts", "num_local_experts",
    "num_experts_per_tok", "norm_topk_prob", "moe_intermediate_size",
    "shared_expert_intermediate_size", "mlp_only_layers", "decoder_sparse_step", "clip_qkv",
)
_MISSING = "__batchllm_missing__"  # an attribute the config does not have (getattr's default)


class ResolvedConfig:
    """A config read back from the cache: the attributes transformers' config had."""

    def __init__(self, values: dict[str, Any]) -> None:
        for name, value in values.items():
            if value != _MISSING:
                setattr(self, name, value)

    def __repr__(self) -> str:
        return f"ResolvedConfig(model_type={getattr(self, 'model_type', None)!r})"


def _transformers_version() -> str:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return "?"


def cache_file(kind: str, key: bytes) -> Path:
    """cache_root()/hf/<kind>-<digest of key and the transformers version>.json"""
    digest = hashlib.sha256(key + b"\0" + _transformers_version().encode()).hexdigest()[:32]
    return cache_root() / "hf" / f"{kind}-{digest}.json"


def _values(config: Any) -> dict[str, Any]:
    values = dict(config.to_dict())
    for name in READS:
        values[name] = getattr(config, name, _MISSING)
    return values


def load_config(folder: Path) -> Any:
    """The folder's config: the cached resolution when there is one, else transformers'
    AutoConfig (and its resolution cached for the next load)."""
    try:
        path = cache_file("config", (folder / "config.json").read_bytes())
    except OSError:  # no config.json: let transformers say so
        path = None
    if path is not None:
        with contextlib.suppress(OSError, ValueError):
            values = json.loads(path.read_text())
            if isinstance(values, dict) and "model_type" in values:
                return ResolvedConfig(values)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    values = _values(config)
    if path is not None and _default_rope(values.get("rope_parameters")):
        write(path, values)
    return config


def _default_rope(params: Any) -> bool:
    """Whether every layer kind's rotary embedding is the plain one (rotary.py computes it);
    the scaled ones are transformers' functions, which take transformers' config itself."""
    if not isinstance(params, dict):
        return params is None or params == _MISSING
    kinds = [p for p in params.values() if isinstance(p, dict)] or [params]
    return all(p.get("rope_type", "default") == "default" for p in kinds)


def write(path: Path, values: Any) -> None:
    """Atomically (kernels/atomic_write.py; a cache: not synced); one that cannot be written
    is skipped."""
    try:
        text = values if isinstance(values, str) else json.dumps(values, sort_keys=True)
    except (TypeError, ValueError):  # a value JSON cannot hold: transformers at every load
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, lambda f: f.write(text.encode()), mode=0o644, durable=False)
    except OSError:
        pass
