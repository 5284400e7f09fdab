"""The argument checks the C kernels' ctypes wrappers share (decode.py, prefill.py, linear.py;
batchllm/model/cpu_layers.py)."""

from __future__ import annotations

import torch


def attention_args(what: str, q, dense, indices):
    """The attention kernels' arguments made ready for C: q with its heads contiguous (its rows
    may be apart: a view of the qkv projection), the caches and outputs (`dense`) contiguous, the
    page tables, lengths and indices contiguous int32. Returns (q, indices)."""
    if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
        q = q.contiguous()
    if not all(t.is_contiguous() for t in dense):
        raise ValueError(f"{what}: caches and outputs must be contiguous")
    return q, int32_indices(what, indices)


def int32_indices(what: str, indices):
    """Page tables, lengths and indices made contiguous; TypeError unless all are int32."""
    indices = [t.contiguous() for t in indices]
    if any(t.dtype != torch.int32 for t in indices):
        raise TypeError(f"{what}: page tables, lengths and indices are int32")
    return indices


def address(t: torch.Tensor | None) -> int:
    """t's data pointer for C, 0 for None (an optional argument)."""
    return 0 if t is None else t.data_ptr()
