"""Whether a model and its KV cache fit a device, and how many tokens and rows run at once, from
its config alone (`batchllm plan`; a 70B is planned without its weights).

Per device, with the model split over `tensor_parallel` of them (Megatron-style: q/k/v, o, the
MLP and the experts split; KV heads split, each rank keeping one when there are fewer than
ranks; embedding and lm_head split by vocabulary; norms whole on every rank):

  weights      parameters x bytes: the model dtype; with quantization fp8 the layers'
               projections 1 byte a value (scales aside), embedding, lm_head, norms, biases
               and routers in the model dtype
  activations  an estimate of a step of max_batched_tokens T (the CUDA path, one MLP block):
               the larger of the attention's (h, x, qkv, its output, o's: T x (3H + (2Hq +
               2Hkv) A / tp)) and the MLP's (T x (3H + 3I / tp); experts: T x 3H + T k x (2H +
               3 I_e / tp) + T x E router logits), plus the logits of max_num_seqs rows (S x V in
               the model dtype and in float32); the run measures its own (the warm-up step)
  runtime      CUDA_RUNTIME for the CUDA context, kernels' workspaces and graphs (an estimate)
  kv pool      kv_cache_memory of what is left (a fraction), or that size
  kv per token 2 x L x H_kv per rank x A x bytes of the KV dtype (fp8: 1)

The pool holds whole pages; a row at max_model_len needs ceil(len / page) pages. A model
"fits" when the pool holds one such row.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

from batchllm.model.errors import ModelError
from batchllm.model.families import describe
from batchllm.model.rotary import head_dim_of

GIB = 1 << 30
MIB = 1 << 20
# What torch reports as total_memory (the OOM messages' "total capacity"): 79.19 and 139.81 GiB.
GPUS = {"H100": 81091 * MIB, "H200": 143166 * MIB}
CUDA_RUNTIME = 1 * GIB
_DEVICES = re.compile(r"(?:(\d+)\s*x\s*)?([A-Za-z0-9]+?)(?:\s*(GiB|GB))?", re.IGNORECASE)


@dataclass(frozen=True)
class Devices:
    """`count` devices of `memory` bytes each; not `gpu`: the CPU (its RAM)."""

    name: str
    count: int
    memory: int
    gpu: bool = True


def parse_devices(text: str) -> Devices:
    """`2xH200`, `8xH100`, `H200` (one), `4x80GiB` (a size each)."""
    m = _DEVICES.fullmatch(text.strip())
    if m is None:
        raise ModelError(f"--devices: {text!r}: expected COUNTxKIND such as 2xH200 or 8xH100 "
                         f"(kinds: {', '.join(GPUS)}) or COUNTxSIZE such as 4x80GiB")
    count, kind, unit = int(m.group(1) or 1), m.group(2), m.group(3)
    if unit is not None and kind.isdigit():
        size = int(kind) * (GIB if unit.lower() == "gib" else 10**9)
        return Devices(f"{kind}{unit}", count, size)
    known = {k.lower(): k for k in GPUS}
    if kind.lower() not in known or count < 1:
        raise ModelError(f"--devices: {text!r}: unknown device {kind!r}; known: "
                         f"{', '.join(GPUS)}, or a size such as 80GiB")
    name = known[kind.lower()]
    return Devices(name, count, GPUS[name])


@dataclass(frozen=True)
class Settings:
    """What a run would use: bytes a value of the weights and of the KV cache, the engine's
    sizes, the length limit."""

    dtype_bytes: int
    kv_bytes: int
    fp8_weights: bool
    tensor_parallel: int
    kv_cache_memory: float | int  # a fraction of what is left, or bytes
    max_batched_tokens: int
    max_num_seqs: int
    page_size: int
    max_model_len: int


@dataclass(frozen=True)
class MemoryPlan:
    """One device's share (bytes), and what runs at once."""

    settings: Settings
    parameters: int  # of the whole model
    weights: int
    activations: int
    runtime: int
    left: int  # device memory after weights, activations and runtime
    kv_pool: int
    kv_per_token: int
    kv_tokens: int  # whole pages
    rows_at_max_len: int  # rows of max_model_len tokens at once, at most max_num_seqs

    @property
    def fits(self) -> bool:
        return self.rows_at_max_len >= 1


def split_ok(config, tensor_parallel: int) -> bool:
    """Whether the heads split evenly over `tensor_parallel` ranks (KV heads may be fewer)."""
    hq, hkv = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    return hq % tensor_parallel == 0 and (hkv % tensor_parallel == 0
                                          or tensor_parallel % hkv == 0)


def _counts(config, tp: int) -> tuple[int, int, int]:
    """(projection values, other values, router values) of one rank: what fp8 would narrow,
    what it would not (embedding, lm_head, norms, biases), the routers (in the model dtype)."""
    f = describe(config)
    h, a, v, layers = config.hidden_size, head_dim_of(config), config.vocab_size, \
        config.num_hidden_layers
    hq = config.num_attention_heads
    hkv = config.num_key_value_heads or hq
    q, kv = hq * a // tp, max(1, hkv // tp) * a  # rows of one rank
    head = 0 if getattr(config, "tie_word_embeddings", False) else v * h // tp
    other, proj, router = v * h // tp + head + h, 0, 0
    for i in range(layers):
        proj += h * (q + 2 * kv) + q * h
        other += (4 if f.sandwich_norms else 2) * h
        other += (q + 2 * kv if f.qkv_bias else 0) + (h if f.o_bias else 0)
        other += {"head": 2 * a, "full": q + kv}.get(f.qk_norm, 0)  # "full": sliced
        e = f.experts
        if e is not None and e.sparse_layers[i]:
            proj += e.num_experts * 3 * h * e.intermediate_size // tp
            router += e.num_experts * h
            if e.shared_size:
                proj += 3 * h * e.shared_size // tp
                router += h
        else:
            proj += 3 * h * config.intermediate_size // tp
            other += (2 * config.intermediate_size // tp + h) if f.mlp_bias else 0
    return proj, other, router


def _activations(config, s: Settings) -> int:
    f, tp, t = describe(config), s.tensor_parallel, s.max_batched_tokens
    h, a = config.hidden_size, head_dim_of(config)
    hq = config.num_attention_heads
    hkv = config.num_key_value_heads or hq
    attention = t * (3 * h + (2 * hq + 2 * hkv) * a // tp)
    if f.experts is not None:
        e = f.experts
        mlp = t * 3 * h + t * e.top_k * (2 * h + 3 * e.intermediate_size // tp) \
            + t * e.num_experts
    else:
        mlp = t * (3 * h + 3 * config.intermediate_size // tp)
    logits = s.max_num_seqs * config.vocab_size * (s.dtype_bytes + 4)
    return max(attention, mlp) * s.dtype_bytes + logits


def plan_memory(config, devices: Devices, s: Settings, cpu_pool: int = 0) -> MemoryPlan:
    """The plan of one device of `devices` (on the CPU the pool is `cpu_pool`, the engine's
    own budget, where the RAM left holds it)."""
    tp = s.tensor_parallel
    if not split_ok(config, tp):
        raise ModelError(f"engine.tensor_parallel: {tp} does not divide the model's "
                         f"{config.num_attention_heads} attention heads and "
                         f"{config.num_key_value_heads} KV heads")
    proj, other, router = _counts(config, tp)
    weights = proj * (1 if s.fp8_weights else s.dtype_bytes) + (other + router) * s.dtype_bytes
    activations = _activations(config, s)
    runtime = CUDA_RUNTIME if devices.gpu else 0
    left = max(0, devices.memory - weights - activations - runtime)
    if not devices.gpu:
        pool = min(cpu_pool, left)
    elif isinstance(s.kv_cache_memory, float):
        pool = int(left * s.kv_cache_memory)
    else:
        pool = min(s.kv_cache_memory, left)
    hkv = config.num_key_value_heads or config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * max(1, hkv // tp) * head_dim_of(config) \
        * s.kv_bytes
    pages = pool // (per_token * s.page_size)
    rows = min(s.max_num_seqs, pages // math.ceil(s.max_model_len / s.page_size))
    return MemoryPlan(s, sum(_counts(config, 1)), weights, activations, runtime, left, pool,
                      per_token, pages * s.page_size, rows)


def alternatives(config, devices: Devices, s: Settings) -> dict[str, MemoryPlan]:
    """What fp8 KV, fp8 weights and both would make of the plan, and the smallest
    tensor_parallel whose plan fits where this one does not (however many devices it takes).
    None of them on the CPU (fp8 and tensor parallelism are the GPU path's)."""
    out: dict[str, MemoryPlan] = {}
    if not devices.gpu:
        return out
    if s.kv_bytes > 1:
        out["fp8 KV cache"] = plan_memory(config, devices, replace(s, kv_bytes=1))
    if not s.fp8_weights:
        out["fp8 weights"] = plan_memory(config, devices, replace(s, fp8_weights=True))
    if s.kv_bytes > 1 and not s.fp8_weights:
        out["fp8 weights and KV"] = plan_memory(config, devices,
                                                replace(s, kv_bytes=1, fp8_weights=True))
    if not plan_memory(config, devices, s).fits:
        for tp in (2, 4, 8, 16):
            if s.tensor_parallel < tp and split_ok(config, tp):
                wider = plan_memory(config, devices, replace(s, tensor_parallel=tp))
                if wider.fits:
                    out[f"tensor_parallel {tp}"] = wider
                    break
    return out
