"""The KV cache tensors and the attention of one step over them.

The kernels are the model's (ops.py picks them): on CUDA the Triton kernels; elsewhere their
pure-torch twins, with the decodes and the prefill chunks in C on the CPU where the kernels
build (kernels/cpu/attention.py). The metadata is built by the runner: from lists on the CPU
path (engine/runner.py), in buffers on the device on the CUDA path (engine/device_runner.py).
A step's attention is
  own part:   every query against its sequence's pages from kv_start on (causal), and
  prefix part: for cascade groups, the group's queries against its shared prefix pages at once,
merged by the log-sum-exp rule. Without cascade groups the own part starts at 0 and is all.

A sliding-window layer (window W: a query at p sees keys p-W+1 .. p) does not split off the
shared prefix: it attends over each sequence's whole page table, from the first key its first
query can see (max(0, first position - W + 1), which also skips what is out of every window),
with the window mask. The prefix's pages are in every member's page table, so this is exact
whatever the prefix's length; the global layers keep the cascade. Pages that fall out of every
window stay allocated (the cache is sized for all layers, and global layers need them).

An FP8 cache (engine.kv_cache_dtype: fp8) holds e4m3 values, one byte each, scaled per layer
and KV head (kernels/reference/kv_fp8.py): the scales are the checkpoint's where it has them
(model/fp8_checkpoint.py), else 1.0, as vLLM does; never computed from the data, so a row's
tokens cannot depend on the other rows, their order, or a resume. Every kernel reads it: the
Triton kernels on the CUDA path; on the CPU, whose C attention reads float32 only, the torch
twins (correct, not fast).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from batchllm.model.ops import ModelOps, pick_ops
from batchllm_kernels.reference.paged_attention import paged_attention_ref
from batchllm_kernels.reference.prefix_attention import prefix_attention_ref
from batchllm_kernels.reference.rope_store import rope_then_store
from batchllm_kernels.reference.step_index import StepIndex, index_step
from batchllm_kernels.reference.store_kv import store_kv_ref

FP8 = torch.float8_e4m3fn
KV_CACHE_DTYPES = ("auto", "fp8")  # engine.kv_cache_dtype


def kv_cache_dtype(setting: str, model_dtype: torch.dtype) -> torch.dtype:
    """engine.kv_cache_dtype -> the cache's dtype: auto is the model's, fp8 float8_e4m3fn."""
    if setting not in KV_CACHE_DTYPES:
        raise ValueError(f"engine.kv_cache_dtype: expected one of {', '.join(KV_CACHE_DTYPES)}, "
                         f"got {setting!r}")
    return FP8 if setting == "fp8" else model_dtype


def fp8_cache_ops(ops: ModelOps) -> ModelOps:
    """The ops that read and write an FP8 cache: the CUDA path's own (its Triton kernels take
    one); on the CPU the torch twins for the store and the attention (the C kernels read
    float32 caches only)."""
    if ops.device_steps:
        return ops
    return dataclasses.replace(
        ops, store_kv=store_kv_ref, rope_store=rope_then_store(ops.pointwise.rope_, store_kv_ref),
        paged_attention=paged_attention_ref, prefix_attention=prefix_attention_ref,
        prefix_attention_into=None, gathers_decodes=True, gathers_chunks=True)


@dataclass
class StepMetadata:
    """Where each token of a step goes and what it attends to (built once per step)."""

    slot_mapping: torch.Tensor  # [T] int64, cache slot of each new token
    page_table: torch.Tensor  # [B, max_pages] int32
    cu_q: torch.Tensor  # [B+1] int32, query rows of sequence b
    context_lens: torch.Tensor  # [B] int32, tokens in the cache after the step
    kv_start: torch.Tensor  # [B] int32, first position of the own part
    # Cascade groups: query rows [0, cascade_rows) belong to groups, contiguous per group.
    cascade_rows: int = 0
    prefix_pages: torch.Tensor | None = None  # [G, max_prefix_pages] int32
    prefix_lens: torch.Tensor | None = None  # [G] int32
    cu_prefix_q: torch.Tensor | None = None  # [G+1] int32
    # The CUDA path's decode tile (ModelOps.tiles_decodes): the one-query sequences, and the
    # longest context of the step (a host int: split-KV is chosen from it without a sync).
    decode_seqs: torch.Tensor | None = None  # [n] int32
    max_context: int = 0


class PagedAttention:
    """Owns the paged KV cache of all layers; `store` and `attend` are called by each layer."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        ops: ModelOps | None = None,
        *,
        kv_dtype: torch.dtype | None = None,
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """`ops`: the model's (DecoderModel.ops); None picks them for this device, dtype and heads,
        the same way. `kv_dtype`: the cache's (None: the model's `dtype`); float8_e4m3fn makes
        an FP8 cache, scaled by `kv_scales` (k, v: [num_layers, Hkv] float32; None: 1.0)."""
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        kv_dtype = dtype if kv_dtype is None else kv_dtype
        # torch.empty: pages are touched (and so resident on the CPU) only once used.
        self.k_cache = torch.empty(shape, dtype=kv_dtype, device=device)
        self.v_cache = torch.empty(shape, dtype=kv_dtype, device=device)
        self.scale = head_dim**-0.5
        self.ops = ops if ops is not None else pick_ops(device, dtype, num_heads, head_dim)
        self.k_scale = self.v_scale = None  # [num_layers, Hkv] fp32, an FP8 cache's
        if kv_dtype == FP8:
            self.ops = fp8_cache_ops(self.ops)
            ones = torch.ones(num_layers, num_kv_heads, dtype=torch.float32, device=device)
            k, v = kv_scales if kv_scales is not None else (ones, ones)
            for name, t in (("k", k), ("v", v)):
                if tuple(t.shape) != (num_layers, num_kv_heads):
                    raise ValueError(f"{name} scales must be [{num_layers}, {num_kv_heads}], got "
                                     f"{tuple(t.shape)}")
            self.k_scale = k.to(device, torch.float32).contiguous()
            self.v_scale = v.to(device, torch.float32).contiguous()
        elif kv_scales is not None:
            raise ValueError(f"kv_scales are for an FP8 cache, not a {kv_dtype} one")
        self.meta: StepMetadata | None = None
        # For which meta: {window: (kv_start, gather index)}, built at the first layer that
        # needs them and reused by the others (window 0: meta.kv_start).
        self._parts: tuple[StepMetadata, dict[int, tuple[torch.Tensor, StepIndex | None]]] | None
        self._parts = None

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Copy whole pages (all layers): a shared prefix's partial last page into a request's own."""
        if not src:
            return
        s = torch.tensor(src, device=self.k_cache.device)
        d = torch.tensor(dst, device=self.k_cache.device)
        for cache in (self.k_cache, self.v_cache):
            raw = cache.view(torch.uint8) if cache.dtype == FP8 else cache  # bytes as they are
            raw[:, d] = raw[:, s]

    def scales(self, layer: int) -> dict[str, torch.Tensor]:
        """The keyword arguments an FP8 cache's ops take for `layer` (k_scale, v_scale [Hkv]);
        none for another cache."""
        if self.k_scale is None:
            return {}
        return {"k_scale": self.k_scale[layer], "v_scale": self.v_scale[layer]}

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [T, Hkv, D], written at the step's slot mapping."""
        self.ops.store_kv(k, v, self.k_cache[layer], self.v_cache[layer], self.meta.slot_mapping,
                          **self.scales(layer))

    def rope_store(self, layer: int, qkv: torch.Tensor, positions: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor, num_heads: int) -> None:
        """qkv [T, (Hq+2Hkv)*D]: q and k heads rotated in place (positions [T], cos, sin
        [P, D]), k and v written at the step's slot mapping; one pass on the CUDA path."""
        self.ops.rope_store(qkv, positions, cos, sin, num_heads, self.k_cache[layer],
                            self.v_cache[layer], self.meta.slot_mapping, **self.scales(layer))

    def attend(self, layer: int, q: torch.Tensor, scale: float | None = None, window: int = 0,
               softcap: float = 0.0) -> torch.Tensor:
        """q: [T, Hq, D] -> o: [T, Hq, D]. scale (None: head_dim**-0.5), sliding window (0:
        none) and soft-capping of the scores (0: none) are the model's, per layer."""
        m = self.meta
        scale = self.scale if scale is None else scale
        kc, vc = self.k_cache[layer], self.v_cache[layer]
        kv_start, index = self._part(m, window)
        scales = self.scales(layer)
        extra = {"step": index, **scales} if self.ops.indexes_steps else dict(scales)
        if self.ops.tiles_decodes and m.decode_seqs is not None:
            extra.update(decode_seqs=m.decode_seqs, max_context=m.max_context)
        if window:  # the whole page table, no cascade (module docstring)
            extra["window"] = window
        o, lse = self.ops.paged_attention(
            q, kc, vc, m.page_table, m.cu_q, m.context_lens, kv_start, scale, softcap=softcap,
            **extra
        )
        if window or not m.cascade_rows:
            return o
        n = m.cascade_rows
        if self.ops.prefix_attention_into is not None:
            self.ops.prefix_attention_into(q[:n], kc, vc, m.prefix_pages, m.prefix_lens,
                                           m.cu_prefix_q, scale, o[:n], lse[:n], softcap=softcap,
                                           **scales)
        else:
            qc = q[:n]
            o_pre, lse_pre = self.ops.prefix_attention(
                qc, kc, vc, m.prefix_pages, m.prefix_lens, m.cu_prefix_q, scale, softcap=softcap,
                **scales)
            merged, _ = self.ops.merge_states(o_pre, lse_pre, o[:n], lse[:n])
            o[:n] = merged
        return o

    def own_part(self, window: int = 0) -> tuple[torch.Tensor, StepIndex | None]:
        """This step's (kv_start, step index) for layers of `window` (0: global), as attend
        takes them: built at the first layer that asks, shared by the others."""
        return self._part(self.meta, window)

    def _part(self, m: StepMetadata, window: int) -> tuple[torch.Tensor, StepIndex | None]:
        """The own part's first key per sequence and the step's gather index for it (None when
        the ops take none): meta.kv_start for global layers; for a window W, from the first key
        the sequence's first query sees, max(0, context_len - q_len - W + 1)."""
        if self._parts is None or self._parts[0] is not m:
            self._parts = (m, {})
        parts = self._parts[1]
        if window not in parts:
            start = m.kv_start
            if window:
                q_len = m.cu_q[1:] - m.cu_q[:-1]
                start = (m.context_lens - q_len - window + 1).clamp_(min=0).to(torch.int32)
            index = None
            if self.ops.indexes_steps:
                _, _, page_size, hkv, _ = self.k_cache.shape
                index = index_step(m.page_table, m.cu_q, m.context_lens, start, page_size, hkv,
                                   gather_decodes=self.ops.gathers_decodes,
                                   gather_chunks=self.ops.gathers_chunks)
            parts[window] = (start, index)
        return parts[window]
