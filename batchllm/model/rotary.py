"""Rotary embedding tables per layer kind, computed as transformers computes them.

The frequencies come from transformers' own rope functions (ROPE_INIT_FUNCTIONS: linear,
llama3, yarn, longrope, dynamic) or the default formula, so every rope type is what the
reference runs. A config whose rope_parameters are keyed by layer type (Gemma 3: a local base for
the sliding layers, a global one for the others) gets one table per type.

Two rope types depend on the sequence length in transformers:
  longrope ("su", Phi-3 / Phi-4): transformers switches from the short to the long factors for
      a whole forward call once the sequence is longer than original_max_position_embeddings
      (so a sequence that grows past it mixes keys of both). batchllm keeps to what transformers
      does below the switch: the short factors, and a length limit of
      original_max_position_embeddings; a longer model.max_model_len is refused (position_limit).
  dynamic (NTK): transformers rescales only past max_position_embeddings, which no run reaches.

Partial rotary (Phi-4-mini rotates 3/4 of each head): transformers rotates the first R of D
dims, pairing i with i + R/2. The kernels rotate all D dims pairing i with i + D/2, so the q
and k weights are permuted at load (`head_permutation`: the rotated pairs land on (i, i + D/2),
the pass-through dims pair among themselves) and the tables hold cos 1, sin 0 there. Scores
q . k are unchanged by a permutation of both.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from batchllm.model.errors import ModelError

_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")


def rope_parameters(config: PretrainedConfig) -> dict[str, dict]:
    """{layer kind: its rope parameters}; kind "" when one set serves every layer."""
    params = getattr(config, "rope_parameters", None) or {}
    types = set(getattr(config, "layer_types", None) or ())
    if types and types <= set(params):
        return {kind: params[kind] for kind in sorted(types)}
    return {"": params}


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rotary_dim(config: PretrainedConfig) -> int:
    """R: how many dims of each head rotate (partial_rotary_factor x head_dim)."""
    dims = {int(head_dim_of(config) * p.get("partial_rotary_factor", 1.0))
            for p in rope_parameters(config).values()}
    if len(dims) != 1:
        raise ModelError(f"model.path: rotary sizes {sorted(dims)} differ between layer kinds")
    return dims.pop()


def position_limit(config: PretrainedConfig) -> tuple[int, str]:
    """The longest sequence the tables serve as transformers does, and why, when that is below
    max_position_embeddings (longrope: see the module docstring)."""
    limit, why = config.max_position_embeddings, ""
    for params in rope_parameters(config).values():
        original = params.get("original_max_position_embeddings") or getattr(
            config, "original_max_position_embeddings", None)
        if params.get("rope_type") == "longrope" and original and original < limit:
            limit = original
            why = (f"longrope scaling: transformers switches to its long factors past "
                   f"original_max_position_embeddings={original}, and batchllm runs the short "
                   f"ones only, so sequences stop at {original} tokens")
    return limit, why


def _frequencies(config: PretrainedConfig, kind: str) -> tuple[torch.Tensor, float]:
    """(inv_freq [R/2] fp32, attention scaling) of layer kind `kind`, as transformers' rotary
    module of the family holds them at init."""
    params = rope_parameters(config)[kind]
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        r = rotary_dim(config)
        inv = 1.0 / (params["rope_theta"] ** (torch.arange(0, r, 2, dtype=torch.float) / r))
        return inv, 1.0
    if rope_type not in _TYPES:
        raise ModelError(f"model.path: rope type {rope_type!r} is not supported; supported: "
                         + ", ".join(_TYPES))
    extra = {"layer_type": kind} if kind else {}
    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None, **extra)
    return inv.float(), float(scaling)


def rope_tables(
    config: PretrainedConfig, max_position: int, device: torch.device
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{layer kind: (cos, sin)}, each [max_position, head_dim] fp32 on `device`, in the kernels'
    layout (pairs i, i + D/2; partial rotary padded with cos 1, sin 0)."""
    d, r = head_dim_of(config), rotary_dim(config)
    positions = torch.arange(max_position, dtype=torch.float32)
    tables = {}
    for kind in rope_parameters(config):
        inv, scaling = _frequencies(config, kind)
        freqs = positions[:, None] * inv[None, :]  # [P, R/2]
        cos, sin = freqs.cos() * scaling, freqs.sin() * scaling
        if r < d:  # the pass-through dims: rotated by angle 0
            cos = torch.cat([cos, torch.ones(max_position, (d - r) // 2)], dim=1)
            sin = torch.cat([sin, torch.zeros(max_position, (d - r) // 2)], dim=1)
        tables[kind] = (torch.cat([cos, cos], 1).to(device), torch.cat([sin, sin], 1).to(device))
    return tables


def head_permutation(config: PretrainedConfig) -> torch.Tensor | None:
    """[D] int64: dim i of a head in the kernels' layout is dim perm[i] of transformers' (None
    when every dim rotates): rotated halves [0, R/2) and [R/2, R) at [0, R/2) and [D/2, D/2+R/2),
    the pass-through dims in between."""
    d, r = head_dim_of(config), rotary_dim(config)
    if r == d:
        return None
    if r % 2 or (d - r) % 2:
        raise ModelError(f"model.path: a rotary size of {r} in heads of {d} is not supported")
    half, rest = r // 2, (d - r) // 2
    return torch.cat([torch.arange(0, half), torch.arange(r, r + rest),
                      torch.arange(half, r), torch.arange(r + rest, d)])
