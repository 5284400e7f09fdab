"""The CPU path's decoder layers in one C call a step (kernels/cpu/layers.c), for the models
whose layers are all plain: what decoder.py's loop over layers.py's blocks does, the same kernels
in the same order with the same arguments, so the same values bit for bit, without ~330 ctypes
calls and their torch glue a step (~11 ms of a 36 ms decode step of SmolLM2-135M).

Plain: Llama's layer (Llama, Mistral without a window, Qwen2, SmolLM2...) on the CPU's C kernels
(float32, the panels, C attention for decodes, prefill chunks and shared prefixes). Anything
else (q/k norms, sandwich norms, clipping, experts, sliding windows, soft-capping, GELU, a kernel
that did not build) runs decoder.py's loop.

One forward, written twice: decoder.py's loop is the source of truth (it runs every family);
this path and layers.c are checked against it bit for bit, on every plain family and kind of
step (tests/test_cpu_layers.py), and whatever runs by default against transformers
(tests/test_families.py). A change to a plain layer is made in the loop first, then here.
"""

from __future__ import annotations

import ctypes
from typing import Any, Protocol

import torch

from batchllm.model.attention import PagedAttention
from batchllm.model.linear import Linear
from batchllm_kernels.cpu import attention as cpu_attention
from batchllm_kernels.cpu import blocks as cpu_blocks
from batchllm_kernels.cpu import layers as cpu_layers
from batchllm_kernels.cpu import ops as cpu_ops
from batchllm_kernels.cpu import prefill as cpu_prefill
from batchllm_kernels.cpu.checks import address, int32_indices


class LayeredModel(Protocol):
    """What CpuLayers reads of a model (decoder.py's DecoderModel is one): named here so that
    this module does not import decoder.py, which imports it."""

    shape: Any  # hidden_size, num_heads, num_kv_heads, head_dim
    family: Any  # the family's switches (norms, activation, windows, experts)
    ops: Any  # the model's kernels
    dtype: torch.dtype
    layers: Any  # the decoder layers (attn, mlp, norms)
    from batchllm.model.linear import Linear


def _projection(p: Linear) -> cpu_layers.Projection:
    """p's weight as cpu_linear takes it, or its GGUF blocks as cpu_blocks_linear does."""
    if p.blocks is not None:
        return cpu_layers.Projection(0, address(p.panel_bias), p.out_features,
                                     p.blocks.data_ptr(), cpu_blocks.type_id(p.kind))
    return cpu_layers.Projection(p.panels.data_ptr(), address(p.panel_bias), p.out_features)


def _float_rows(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.is_contiguous()


class CpuLayers:
    """A model's layers as layers.c's records: the weights' once (`of`), the cache's once per
    KV pool, the step's at each `forward`."""

    def __init__(self, model: LayeredModel) -> None:
        self.model = model
        s, first = model.shape, model.layers[0]
        self.width = first.mlp.width  # 2I: gate and up
        self.scale = first.attn.scale
        self.sizes = (s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim, self.width // 2)
        self._layers: tuple[int, ctypes.Array] | None = None  # (k_cache's address, records)

    @staticmethod
    def of(model: LayeredModel) -> CpuLayers | None:
        """The one-call layers where every layer of `model` is plain and every kernel built;
        None where decoder.py's loop must run."""
        f, ops = model.family, model.ops
        if (model.dtype != torch.float32 or ops.projection != "panels"
                or ops.pointwise is not cpu_ops.C_OPS or ops.store_kv is not cpu_ops.store_kv_c
                or ops.paged_attention is not cpu_attention.paged_attention_cpu
                or ops.prefix_attention_into is not cpu_prefill.prefix_attention_into
                or ops.gathers_decodes or ops.gathers_chunks or not ops.indexes_steps):
            return None
        if (f.sandwich_norms or f.qk_norm or f.clip_qkv or f.activation != "silu"
                or f.attn_softcap or any(f.windows)
                or (f.experts is not None and any(f.experts.sparse_layers))):
            return None
        first = model.layers[0].attn
        for layer in model.layers:
            a = layer.attn
            if (a.scale != first.scale or a.window or a.softcap or a.q_norm is not None
                    or layer.mlp.width != model.layers[0].mlp.width
                    or layer.norm_attn_out is not None or layer.norm_mlp_out is not None
                    or not (_float_rows(a.cos) and _float_rows(a.sin))
                    or not (_float_rows(layer.norm_in) and _float_rows(layer.norm_mlp))
                    or any(p.panels is None and p.blocks is None
                           for p in (a.qkv, a.o, layer.mlp.gate_up, layer.mlp.down))):
                return None
        if cpu_layers.kernels() is None:
            return None
        return CpuLayers(model)

    def _records(self, attention: PagedAttention) -> ctypes.Array:
        """The layers' records, made once for attention's cache."""
        kc, vc = attention.k_cache, attention.v_cache
        if self._layers is not None and self._layers[0] == kc.data_ptr():
            return self._layers[1]
        records = (cpu_layers.Layer * len(self.model.layers))()
        for i, (layer, r) in enumerate(zip(self.model.layers, records)):
            a, mlp = layer.attn, layer.mlp
            r.norm_in, r.norm_mlp = layer.norm_in.data_ptr(), layer.norm_mlp.data_ptr()
            r.qkv, r.o = _projection(a.qkv), _projection(a.o)
            r.gate_up, r.down = _projection(mlp.gate_up), _projection(mlp.down)
            r.cos, r.sin = a.cos.data_ptr(), a.sin.data_ptr()
            r.rotary_dim, r.max_position = a.cos.shape[1], a.cos.shape[0]
            r.k_cache, r.v_cache = kc[i].data_ptr(), vc[i].data_ptr()
        self._layers = (kc.data_ptr(), records)
        return records

    def forward(self, h: torch.Tensor, positions: torch.Tensor, attention: PagedAttention,
                mlp_rows: int) -> None:
        """Every layer over the step that `attention.meta` describes; h [T, H] float32
        contiguous, the residual stream, in and out; positions [T] int64; the MLP in blocks of
        mlp_rows rows (decoder.py's)."""
        if not (_float_rows(h) and attention.k_cache.is_contiguous()
                and attention.v_cache.is_contiguous()):
            raise ValueError("cpu_layers: h and the caches must be contiguous float32")
        m, (t, hidden) = attention.meta, h.shape
        _, hq, hkv, d, inter = self.sizes
        kv_start, index = attention.own_part()
        block = max(1, min(t, mlp_rows))
        scale = attention.scale if self.scale is None else self.scale
        shape = cpu_layers.Shape(hidden, hq, hkv, d, inter, attention.k_cache.shape[2], block,
                                 self.model.eps, scale)
        # x, qkv, o, lse, a, gate_up, act, m: Step's buffers, in its order
        buffers = [torch.empty(rows, cols, dtype=torch.float32) for rows, cols in (
            (t, hidden), (t, (hq + 2 * hkv) * d), (t, hq * d), (t, hq), (t, hidden),
            (block, self.width), (block, inter), (block, hidden))]
        pos = positions.to(torch.int64).contiguous()
        slots = m.slot_mapping.to(torch.int64).contiguous()
        table, cu, ctx, start, dec_seqs, dec_rows, chunk_seqs = int32_indices(
            "cpu_layers", (m.page_table, m.cu_q, m.context_lens, kv_start, index.decode_seqs,
                           index.decode_rows, index.chunk_seqs))
        groups = m.prefix_lens.shape[0] if m.cascade_rows else 0
        pages, lens, cu_prefix = (int32_indices("cpu_layers", (m.prefix_pages, m.prefix_lens,
                                                              m.cu_prefix_q))
                                  if groups else (None, None, None))
        step = cpu_layers.Step(
            t, pos.data_ptr(), slots.data_ptr(), table.data_ptr(), table.shape[1], cu.data_ptr(),
            ctx.data_ptr(), start.data_ptr(), dec_seqs.data_ptr(), dec_rows.data_ptr(),
            len(dec_seqs), chunk_seqs.data_ptr(), len(chunk_seqs), groups, address(pages),
            pages.shape[1] if groups else 0, address(lens), address(cu_prefix), h.data_ptr(),
            *(b.data_ptr() for b in buffers))
        failed = cpu_layers.run_layers(shape, self._records(attention), step)
        if failed >= 0:
            table_len = self.model.layers[failed].attn.cos.shape[0]
            raise IndexError(f"rope_c: positions outside the table of {table_len}")
