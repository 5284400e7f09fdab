"""Every op the forward pass runs, picked once per (device, dtype, head shape): one frozen record
that the attention (attention.py), the layers (layers.py, experts.py, decoder.py) and the
projections (linear.py) take, so that no other file chooses a backend.

  CUDA                 the Triton kernels (kernels/triton/), torch's pointwise ops, F.linear
  the CPU, float32     the C kernels (kernels/cpu/), each where it builds and serves the shape,
                       unless BATCHLLM_CPU_KERNEL=0; the torch twins (kernels/reference/) for
                       the rest; projections on the C kernel's panels, else oneDNN's layout
  anything else        the torch twins and F.linear

Forcing the Triton kernels on any device (issue 14's BATCHLLM_BACKEND=triton, with
TRITON_INTERPRET=1 on the CPU) is a second condition on the one branch in `pick_ops`:
`_triton_ops()` asks nothing of the device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from kernels.cpu import attention as cpu_attention
from kernels.cpu import build as cpu_build
from kernels.cpu import decode as cpu_decode
from kernels.cpu import linear as cpu_linear
from kernels.cpu import ops as cpu_ops
from kernels.cpu import prefill as cpu_prefill
from kernels.reference.merge_states import merge_states_ref
from kernels.reference.paged_attention import paged_attention_ref
from kernels.reference.pointwise import TORCH_OPS, PointwiseOps
from kernels.reference.prefix_attention import prefix_attention_ref
from kernels.reference.store_kv import store_kv_ref

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
    pointwise: PointwiseOps  # add_rms_norm, rope_, silu_mul, gelu_tanh_mul
    projection: Projection
    # (x [N, K] rows sorted by expert, w [E, M, K], offsets [E+1] int32) -> [N, M]: each
    # expert's rows times its weight in one launch (MoE, model/experts.py); None: one
    # projection per expert in the `projection` layout
    grouped_matmul: Callable | None = None


def pick_ops(device: torch.device, dtype: torch.dtype, num_heads: int, head_dim: int) -> ModelOps:
    """The ops for a model on `device` in `dtype` with `num_heads` query heads of `head_dim`."""
    device = torch.device(device)
    if device.type == "cuda":
        return _triton_ops()
    return _cpu_ops(device, dtype, num_heads, head_dim)


def _triton_ops() -> ModelOps:
    """The CUDA path: the Triton kernels (imported here only, so the CPU path needs no triton;
    without it this raises ImportError saying so)."""
    from kernels.triton import (
        grouped_matmul,
        merge_states,
        paged_attention,
        prefix_attention,
        store_kv,
    )

    return ModelOps(
        store_kv=store_kv.store_kv,
        # One launch per step for prefill chunks and decodes alike, reading the page tables
        # itself: no step index, no gathers.
        paged_attention=paged_attention.paged_attention,
        # The prefix read once per query tile, not once per request (scripts/bench_kernels.py).
        prefix_attention=prefix_attention.prefix_attention,
        merge_states=merge_states.merge_states,
        prefix_attention_into=None,
        indexes_steps=False,
        gathers_decodes=False,
        gathers_chunks=False,
        # torch's CUDA elementwise kernels: no Triton ones of ours yet.
        pointwise=TORCH_OPS,
        # cuBLAS behind F.linear: no layout of ours on CUDA.
        projection="dense",
        # Experts: one grouped launch per weight, no host sync for the experts' row counts.
        grouped_matmul=grouped_matmul.grouped_matmul,
    )


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
    return ModelOps(
        store_kv=cpu_ops.store_kv_c if c_ops else store_kv_ref,
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
        pointwise=cpu_ops.C_OPS if c_ops else TORCH_OPS,
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
