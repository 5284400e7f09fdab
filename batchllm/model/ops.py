"""Every op the forward pass runs, picked once per (device, dtype, head shape): one frozen record
that the attention (attention.py), the layers (layers.py, experts.py, decoder.py) and the
projections (linear.py) take, so that no other file chooses a backend.

  CUDA                 the Triton kernels (kernels/triton/: attention, the fused pointwise
                       steps, the rotary embedding with the KV store), F.linear; and the
                       CUDA path's step loop (device_steps: engine/device_runner.py)
  the CPU, float32     the C kernels (kernels/cpu/), each where it builds and serves the shape,
                       unless BATCHLLM_CPU_KERNEL=0; the torch twins (kernels/reference/) for
                       the rest; projections on the C kernel's panels, else oneDNN's layout
  anything else        the torch twins and F.linear

BATCHLLM_BACKEND=triton forces the CUDA path (its kernels and its step loop) on any device: on
one without CUDA, in Triton's interpreter (TRITON_INTERPRET=1, set here before the kernels are
made), slowly; that is how the GPU path is tested without a GPU. A missing or broken Triton is
a ModelError (exit 2) when the ops are picked, at load, not at the first layer.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from batchllm.model.errors import ModelError
from batchllm_kernels.cpu import attention as cpu_attention
from batchllm_kernels.cpu import build as cpu_build
from batchllm_kernels.cpu import decode as cpu_decode
from batchllm_kernels.cpu import linear as cpu_linear
from batchllm_kernels.cpu import ops as cpu_ops
from batchllm_kernels.cpu import prefill as cpu_prefill
from batchllm_kernels.reference.merge_states import merge_states_ref
from batchllm_kernels.reference.paged_attention import paged_attention_ref
from batchllm_kernels.reference.pointwise import TORCH_OPS, PointwiseOps
from batchllm_kernels.reference.prefix_attention import prefix_attention_ref
from batchllm_kernels.reference.rope_store import rope_then_store
from batchllm_kernels.reference.store_kv import store_kv_ref

# How a projection's weight is laid out at load and multiplied (model/linear.py):
#   "panels"  the C kernel's 16-column panels (kernels/cpu/linear.py)
#   "onednn"  oneDNN's blocked layout, run by oneDNN's matmul
#   "dense"   the weight as loaded, F.linear
Projection = Literal["panels", "onednn", "dense"]


@dataclass(frozen=True)
class ModelOps:
    """The ops of one model's forward pass. Shapes: T tokens of the step, B sequences, G groups,
    Hq / Hkv query / KV heads of size D; caches [num_pages, page_size, Hkv, D]."""

    # (k, v [T, Hkv, D], k_cache, v_cache, slot_mapping [T] int64) -> None
    store_kv: Callable
    # (qkv [T, (Hq+2Hkv)*D], positions [T] int64, cos, sin [P, D] fp32, Hq, k_cache, v_cache,
    #  slot_mapping) -> None: q and k heads rotated in place, k and v stored
    rope_store: Callable
    # (q [T, Hq, D], k_cache, v_cache, page_table [B, max_pages], cu_q [B+1], context_lens [B],
    #  kv_start [B], scale[, step=StepIndex]) -> (o [T, Hq, D], lse [T, Hq] fp32)
    paged_attention: Callable
    # (q, k_cache, v_cache, prefix_pages [G, max_pages], prefix_lens [G], cu_q [G+1], scale)
    #   -> (o, lse) of each group's queries against its shared prefix
    prefix_attention: Callable
    # (o_a, lse_a, o_b, lse_b) -> (o, lse): two parts merged by the log-sum-exp rule
    merge_states: Callable
    # prefix_attention's arguments + (o, lse): the prefix part merged into them in place;
    # None: prefix_attention, then merge_states
    prefix_attention_into: Callable | None
    indexes_steps: bool  # paged_attention takes a StepIndex (step=), built once per step
    gathers_decodes: bool  # that index holds gather rows for the one-query sequences
    gathers_chunks: bool  # and for the prefill chunks
    tiles_decodes: bool  # paged_attention takes decode_seqs= and max_context= (a decode tile)
    device_steps: bool  # the CUDA path's step loop: pages, inputs and graphs on the device
    pointwise: PointwiseOps  # add_rms_norm, rope_, silu_mul, gelu_tanh_mul
    projection: Projection
    # (x [N, K] rows sorted by expert, w [E, M, K], offsets [E+1] int32) -> [N, M]: each
    # expert's rows times its weight in one launch (MoE, model/experts.py); None: one
    # projection per expert in the `projection` layout
    grouped_matmul: Callable | None = None


def pick_ops(device: torch.device, dtype: torch.dtype, num_heads: int, head_dim: int) -> ModelOps:
    """The ops for a model on `device` in `dtype` with `num_heads` query heads of `head_dim`."""
    device = torch.device(device)
    if device.type == "cuda" or backend() == "triton":
        return _triton_ops(device)
    return _cpu_ops(device, dtype, num_heads, head_dim)


def backend() -> str:
    """BATCHLLM_BACKEND: "triton" forces the CUDA path on any device; "auto" (or unset) picks by
    device."""
    value = os.environ.get("BATCHLLM_BACKEND", "") or "auto"
    if value not in ("auto", "triton"):
        raise ModelError(f"BATCHLLM_BACKEND: expected auto or triton, got {value!r}")
    return value


def kernel_path(device: str, dtype: str) -> str:
    """Which kernels a model on `device` in `dtype` runs, as DESIGN's metrics key kernel_path
    names them, by pick_ops' rules: cuda-triton on CUDA; triton-interpreter where
    BATCHLLM_BACKEND=triton runs the CUDA path on the CPU; cpu-c-<isa> (cpu-c-avx512,
    cpu-c-avx2) in float32 on x86 with AVX2 or AVX-512 where the C kernels build (enabled, a
    compiler, a safe folder); else cpu-torch (ARM, macOS, BATCHLLM_CPU_KERNEL=0, no compiler,
    another dtype)."""
    from batchllm_kernels.cpu import linear as cpu_linear

    if device == "cuda":
        return "cuda-triton"
    if backend() == "triton":
        return "triton-interpreter"
    if (device == "cpu" and dtype == "float32" and cpu_build.enabled()
            and cpu_linear.load() is not None):
        return f"cpu-c-{cpu_build.isa()}"
    return f"{device}-torch"


def _triton_ops(device: torch.device) -> ModelOps:
    """The CUDA path: the Triton kernels (imported here only, so the CPU path needs no triton),
    checked by one small launch where the device is there."""
    if device.type != "cuda":
        # before batchllm_kernels.triton's modules make the kernels
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        from batchllm_kernels.triton import (
            gated_mul,
            grouped_matmul,
            merge_states,
            paged_attention,
            prefix_attention,
            rms_norm,
            rotary,
            store_kv,
        )
    except Exception as error:  # not installed, or an install that fails at import
        raise ModelError(
            f"model.device: the {device.type} path runs Triton kernels, and triton cannot be "
            f"imported ({type(error).__name__}: {error}); install a triton that matches torch "
            "(pip install triton)") from error
    if device.type != "cuda" or torch.cuda.is_available():
        _check_triton_runs(str(device))
    return ModelOps(
        store_kv=store_kv.store_kv,
        # The rotary embedding writes the rotated k (and v) to the cache from its registers.
        rope_store=rotary.rope_store,
        # One launch per step for the prefill chunks, one for the decodes in a tile of their
        # own (split-KV when few and long), reading the page tables: no step index, no gathers.
        paged_attention=paged_attention.paged_attention,
        # The prefix read once per query tile, not once per request (scripts/bench_kernels.py).
        prefix_attention=prefix_attention.prefix_attention,
        merge_states=merge_states.merge_states,
        # The prefix part merged into the own part in place: no copy of the merged rows back.
        prefix_attention_into=prefix_attention.prefix_attention_into,
        indexes_steps=False,
        gathers_decodes=False,
        gathers_chunks=False,
        tiles_decodes=True,
        device_steps=True,
        # One pass each where torch runs chains of elementwise kernels (add+RMSNorm ~8,
        # the rotary embedding ~10): the launches a decode step is bound by.
        pointwise=PointwiseOps(rms_norm.add_rms_norm, rotary.rope_, gated_mul.silu_mul,
                               gated_mul.gelu_tanh_mul),
        # cuBLAS behind F.linear: no layout of ours on CUDA.
        projection="dense",
        # Experts: one grouped launch per weight, no host sync for the experts' row counts.
        grouped_matmul=grouped_matmul.grouped_matmul,
    )


@functools.cache
def _check_triton_runs(device: str) -> None:
    """One small kernel compiled and run on `device`: a Triton that imports but cannot compile or
    launch (no ptxas, a driver too old) fails here, once, with the reason."""
    from batchllm_kernels.triton import gated_mul

    x = torch.linspace(-4, 4, 64, device=device).view(1, 64)
    try:
        y = gated_mul.silu_mul(x)
        ok = torch.allclose(y.cpu(), torch.nn.functional.silu(x[:, :32]).cpu() * x[:, 32:].cpu(),
                            atol=1e-5)
    except Exception as error:  # whatever Triton, its compiler or the driver raises
        raise ModelError(
            f"model.device: the Triton kernels cannot run on {device} ({type(error).__name__}: "
            f"{error}); check that triton matches torch and the driver") from error
    if not ok:
        raise ModelError(f"model.device: a Triton kernel computed wrong values on {device}")


def _cpu_ops(device: torch.device, dtype: torch.dtype, num_heads: int, head_dim: int) -> ModelOps:
    """The CPU path: each C kernel where it serves, the torch twin where it does not (on a
    device other than the CPU and CUDA: the twins only)."""
    # The C kernels compute in float32 only, on the CPU only, and are switched off by
    # BATCHLLM_CPU_KERNEL=0; each is then used only where it built (no compiler: none is).
    c = device.type == "cpu" and dtype == torch.float32 and cpu_build.enabled()
    # Decode attention in C reads each sequence's pages once, in place, where the twin gathers
    # a padded copy first: 2.5-4x faster (kernels/cpu/decode.py); within its fixed buffers.
    c_decode = c and cpu_decode.supports(dtype, num_heads, head_dim)
    # Prefill chunks in C skip the key blocks a causal block cannot see and read the pages in
    # place: 1.9x torch's flash kernel (kernels/cpu/prefill.py); head sizes in multiples of 16.
    # The same kernel merges a shared prefix into the own part in one pass.
    c_prefill = c and cpu_prefill.supports(dtype, head_dim)
    # Pointwise steps and the store in C: one pass over memory each instead of torch's chain
    # of elementwise ops (~6 s -> ~1.7 s of a 77 s run; kernels/cpu/ops.py).
    c_ops = c and cpu_ops.load() is not None
    pointwise = cpu_ops.C_OPS if c_ops else TORCH_OPS
    store_kv = cpu_ops.store_kv_c if c_ops else store_kv_ref
    return ModelOps(
        store_kv=store_kv,
        rope_store=rope_then_store(pointwise.rope_, store_kv),
        # The dispatcher runs each part (decodes, chunks) in C where it can, in torch otherwise.
        paged_attention=(cpu_attention.paged_attention_cpu if c_decode or c_prefill
                         else paged_attention_ref),
        prefix_attention=prefix_attention_ref,
        merge_states=merge_states_ref,
        prefix_attention_into=cpu_prefill.prefix_attention_into if c_prefill else None,
        # The twins' gathers depend only on the page tables: indexed once per step, not per
        # layer; a part the C kernels run needs no gather rows.
        indexes_steps=True,
        gathers_decodes=not c_decode,
        gathers_chunks=not c_prefill,
        tiles_decodes=False,
        device_steps=False,
        pointwise=pointwise,
        projection=_cpu_projection(device, dtype, c),
    )


def _cpu_projection(device: torch.device, dtype: torch.dtype, c: bool) -> Projection:
    # The C kernel on panels, faster than oneDNN at every row count measured; oneDNN on its own
    # reordered weight where it cannot be built, faster than MKL's sgemm behind F.linear with
    # a decode step's few rows (the measurements: model/linear.py, kernels/cpu/linear.py).
    if c and cpu_linear.load() is not None:
        return "panels"
    if (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return "onednn"
    return "dense"
