"""Paged attention of a step on the CPU: the one-query sequences by the C decode kernel
(decode.c), the prefill chunks by the C prefill kernel (prefill.c); a part whose kernel is
missing runs the torch twin (kernels/reference/paged_attention.py). The step index says which:
a part it was built with gather rows for (index_step's gather_decodes / gather_chunks) runs in
torch. Which parts have a kernel is decided once per model (batchllm/model/ops.py)."""

from __future__ import annotations

import torch

from batchllm_kernels.cpu import decode, prefill
from batchllm_kernels.reference.paged_attention import attend_chunks, attend_decodes
from batchllm_kernels.reference.step_index import StepIndex


def paged_attention_cpu(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,
    page_table: torch.Tensor,  # [B, max_pages] int32
    cu_q: torch.Tensor,  # [B+1] int32
    context_lens: torch.Tensor,  # [B] int32
    kv_start: torch.Tensor,  # [B] int32
    scale: float,
    step: StepIndex,
    *,
    window: int = 0,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:  # o [T, Hq, D], lse [T, Hq] fp32
    """paged_attention_ref with its parts in C: same arguments, same results (to rounding)."""
    t, hq, d = q.shape
    o = q.new_zeros(t, hq, d)
    lse = torch.full((t, hq), float("-inf"), dtype=torch.float32)
    if step.decodes or not len(step.decode_seqs):
        attend_decodes(q, k_cache, v_cache, step, scale, o, lse, window, softcap)
    else:
        decode.decode_attention(q, k_cache, v_cache, page_table, context_lens, kv_start,
                                step.decode_seqs, step.decode_rows, scale, o, lse, window,
                                softcap)
    if step.chunks or not len(step.chunk_seqs):
        attend_chunks(q, k_cache, v_cache, step, scale, o, lse, window, softcap)
    else:
        prefill.prefill_attention(q, k_cache, v_cache, page_table, cu_q, context_lens,
                                  kv_start, step.chunk_seqs, scale, o, lse, window, softcap)
    return o, lse
