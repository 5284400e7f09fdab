"""The launches the CUDA path makes for one layer of a step, planned on meta tensors by the
launchers' own plan_* functions: what scripts/compile_check.py compiles for each variant.

A variant is a dict of compile_check's COLUMNS (dtype, head_dim, group, kv_heads, page_size,
step, window, softcap, kv_cache: "auto" for a cache in the model's dtype, "fp8" for an FP8 one
with its scales). The model is Hkv = kv_heads KV heads of head_dim, Hq = group * Hkv query heads, hidden
size Hq * head_dim. Step kinds, as the runner (batchllm/engine/device_runner.py) launches them:
  decode   decode-only: every sequence in the decode tile, few and long ones split by key range
  mixed    prefill chunks and decodes: the decode tile, and the 64-row tiles skipping decodes
  prefill  prefill chunks only: the 64-row tiles
  shared   decodes in shared-prefix groups: the prefix part (split, combined) merged in place
The decode and prefill steps also plan the layer's projections with FP8 weights (per channel
and in 128x128 blocks): W8A8 (activations quantized per token, FP8 products: compiled for
sm_89 and later only) and W8A16 (sm_80's path).
"""

from __future__ import annotations

import importlib
import pkgutil

import torch

import batchllm_kernels.triton
from batchllm_kernels.triton.fp8_matmul import plan_fp8_linear
from batchllm_kernels.triton.gated_mul import plan_gated_mul
from batchllm_kernels.triton.grouped_matmul import plan_grouped_matmul
from batchllm_kernels.triton.launch import Launch
from batchllm_kernels.triton.merge_states import plan_merge_states
from batchllm_kernels.triton.paged_attention import plan_paged_attention
from batchllm_kernels.triton.prefix_attention import plan_prefix_attention
from batchllm_kernels.triton.rms_norm import plan_add_rms_norm
from batchllm_kernels.triton.rotary import plan_rope_store
from batchllm_kernels.triton.store_kv import plan_store_kv

STEPS = ("decode", "mixed", "prefill", "shared")
# The variant's columns each attention launcher takes as keywords.
PAGED_COLUMNS: tuple[str, ...] = ("window", "softcap")
PREFIX_COLUMNS: tuple[str, ...] = ("softcap",)
_EXPERTS, _TOP_K = 8, 2  # the MoE projections (prefill steps): rows per token, experts

# (query rows, context length) per sequence; lengths odd and over several pages
_SEQS = {
    "decode": [(1, 1000), (1, 701)],
    "mixed": [(1, 300), (37, 37), (1, 90), (17, 60)],
    "prefill": [(37, 37), (100, 229)],
    "shared": [(1, 301), (1, 300), (1, 333), (1, 50)],  # the first three share 256 keys
}
_SHARED_KEYS = 256
META = torch.device("meta")


def kernel_names() -> list[str]:
    """Every kernel (a jitted `_*_kernel`) of kernels/triton/: what the check must reach."""
    names = []
    for info in pkgutil.iter_modules(batchllm_kernels.triton.__path__):
        module = importlib.import_module(f"batchllm_kernels.triton.{info.name}")
        names += [n for n, v in vars(module).items()
                  if n.startswith("_") and n.endswith("_kernel") and hasattr(v, "fn")]
    return sorted(set(names))


def _empty(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device=META)


def step_plans(v: dict) -> list[Launch]:
    """Every launch of one layer of a step of kind v["step"] of v's model."""
    dtype = getattr(torch, v["dtype"])
    d, hkv, ps = v["head_dim"], v["kv_heads"], v["page_size"]
    hq = v["group"] * hkv
    hidden, inter = hq * d, 3 * hq * d
    seqs = _SEQS[v["step"]]
    t, b = sum(n for n, _ in seqs), len(seqs)
    max_pages = -(-max(c for _, c in seqs) // ps)
    i32, i64 = torch.int32, torch.int64
    cache_dtype = torch.float8_e4m3fn if v["kv_cache"] == "fp8" else dtype
    k_cache, v_cache = (_empty(b * max_pages + 1, ps, hkv, d, dtype=cache_dtype) for _ in "kv")
    scales = {}
    if v["kv_cache"] == "fp8":
        scales = {"k_scale": _empty(hkv, dtype=torch.float32),
                  "v_scale": _empty(hkv, dtype=torch.float32)}
    qkv = _empty(t, (hq + 2 * hkv) * d, dtype=dtype)
    q = qkv[:, : hq * d].view(t, hq, d)  # a view of the projection, as in the forward
    positions, slots = _empty(t, dtype=i64), _empty(t, dtype=i64)
    cos, sin = _empty(4096, d, dtype=torch.float32), _empty(4096, d, dtype=torch.float32)
    h, w = _empty(t, hidden, dtype=dtype), _empty(hidden, dtype=dtype)
    launches: list[Launch] = []
    for delta in (None, _empty(t, hidden, dtype=dtype)):
        launches += plan_add_rms_norm(h, delta, w, 1e-5)[1]
    launches += plan_rope_store(qkv, positions, cos, sin, hq, k_cache, v_cache, slots, **scales)
    decodes = [i for i, (n, _) in enumerate(seqs) if n == 1]
    attn = plan_paged_attention(
        q, k_cache, v_cache, _empty(b, max_pages, dtype=i32), _empty(b + 1, dtype=i32),
        _empty(b, dtype=i32), _empty(b, dtype=i32), d**-0.5,
        decode_seqs=_empty(len(decodes), dtype=i32), max_context=max(c for _, c in seqs),
        **{c: v[c] for c in PAGED_COLUMNS}, **scales)
    o, lse = attn[0], attn[1]
    launches += attn[2]
    if v["step"] == "shared":
        n = 3  # the group's rows: prefix_attention_into's two plans
        pages = -(-_SHARED_KEYS // ps)
        o_pre, lse_pre, pre = plan_prefix_attention(
            q[:n], k_cache, v_cache, _empty(1, pages, dtype=i32), _empty(1, dtype=i32),
            _empty(2, dtype=i32), d**-0.5, **{c: v[c] for c in PREFIX_COLUMNS}, **scales)
        launches += pre + plan_merge_states(o_pre, lse_pre, o[:n], lse[:n],
                                            out=(o[:n], lse[:n]))[2]
    for gelu_tanh in (False, True):  # SiLU, and Gemma's GELU-tanh
        launches += plan_gated_mul(_empty(t, 2 * inter, dtype=dtype), gelu_tanh)[1]
    if v["step"] in ("decode", "prefill"):  # FP8 projections: qkv, o, gate_up, down
        fp8 = torch.float8_e4m3fn
        for n, k in (((hq + 2 * hkv) * d, hidden), (hidden, hidden), (2 * inter, hidden),
                     (hidden, inter)):
            for rb, cb in ((1, k), (128, 128)):
                scale = _empty(-(-n // rb), -(-k // cb), dtype=torch.float32)
                for fp8_dot in (True, False):
                    launches += plan_fp8_linear(_empty(t, k, dtype=dtype),
                                                _empty(n, k, dtype=fp8), scale, rb, cb,
                                                fp8_dot=fp8_dot)[1]
    if v["step"] == "prefill":  # the launchers the forward does not call on this path
        k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
        launches += plan_store_kv(k, k, k_cache, v_cache, slots, **scales)
        launches += plan_rope_store(qkv, positions, cos, sin, hq + hkv)
        # a MoE layer's expert projections: gate-up, then down
        x, offsets = _empty(t * _TOP_K, hidden, dtype=dtype), _empty(_EXPERTS + 1, dtype=i32)
        launches += plan_grouped_matmul(x, _empty(_EXPERTS, inter, hidden, dtype=dtype),
                                        offsets)[1]
        launches += plan_grouped_matmul(_empty(t * _TOP_K, inter, dtype=dtype),
                                        _empty(_EXPERTS, hidden, inter, dtype=dtype), offsets)[1]
    return launches
