"""The argument check the attention kernels' ctypes wrappers share (decode.py, prefill.py)."""

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
    indices = [t.contiguous() for t in indices]
    if any(t.dtype != torch.int32 for t in indices):
        raise TypeError(f"{what}: page tables, lengths and indices are int32")
    return q, indices
