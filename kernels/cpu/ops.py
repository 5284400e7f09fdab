"""The model's pointwise steps (RMSNorm with its residual add, rotary embedding, SiLU-and-multiply)
and the KV store in C on the CPU (ops.c, built by build.py), each one pass over its rows. Their
torch twins are kernels/reference/pointwise.py and kernels/reference/store_kv.py.

Why C: torch runs each of these as a chain of elementwise ops, one pass over memory each (RMSNorm
six, the rotary embedding eight); over SmolLM2-135M's 30 layers they took ~6 s of a 77 s
benchmark run on this project's 2-core machine, ~1.7 s in C. The store: torch's index_copy_ from
the strided views of the qkv projection took 1.0 s of that run.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from batchllm_kernels.cpu.build import load_library
from batchllm_kernels.reference.pointwise import PointwiseOps


@functools.cache
def load() -> ctypes.CDLL | None:
    """The built kernels, or None where they cannot be built (a warning says why, once)."""
    lib = load_library("ops", "the CPU pointwise kernels")
    if lib is None:
        return None
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    lib.cpu_add_rms_norm.argtypes = [ptr, ptr, ptr, f32, i64, i64, ptr]
    lib.cpu_rope.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ptr, i64]
    lib.cpu_silu_mul.argtypes = [ptr, i64, i64, ptr]
    lib.cpu_store_kv.argtypes = [ptr, i64, ptr, i64, i64, i64, ptr, ptr, ptr]
    for f in (lib.cpu_add_rms_norm, lib.cpu_silu_mul, lib.cpu_store_kv):
        f.restype = None
    lib.cpu_rope.restype = ctypes.c_int
    return lib


def _rows(x: torch.Tensor) -> None:
    if x.dtype != torch.float32 or not x.is_contiguous():
        raise ValueError(f"cpu_ops: contiguous float32 rows expected, got {x.dtype} "
                         f"{tuple(x.shape)} strides {x.stride()}")


def add_rms_norm_c(h, delta, weight, eps):
    _rows(h)
    _rows(weight)
    if delta is not None:
        _rows(delta)
    out = torch.empty_like(h)
    load().cpu_add_rms_norm(h.data_ptr(), 0 if delta is None else delta.data_ptr(),
                            weight.data_ptr(), eps, h.shape[0], h.shape[1], out.data_ptr())
    return out


def rope_c(x, positions, cos, sin, heads):
    _rows(x)
    d = cos.shape[1]
    _rows(cos)
    _rows(sin)
    positions = positions.to(torch.int64).contiguous()
    if load().cpu_rope(x.data_ptr(), x.shape[0], x.stride(0), heads, d, positions.data_ptr(),
                       cos.data_ptr(), sin.data_ptr(), len(cos)):
        raise IndexError(f"rope_c: positions outside the table of {len(cos)}")


def silu_mul_c(gate_up):
    _rows(gate_up)
    t, width = gate_up.shape
    out = gate_up.new_empty(t, width // 2)
    load().cpu_silu_mul(gate_up.data_ptr(), t, width // 2, out.data_ptr())
    return out


def store_kv_c(
    k: torch.Tensor,  # [T, Hkv, D] fp32, heads contiguous (rows may be apart)
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D] fp32, contiguous
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    """store_kv_ref (kernels/reference/store_kv.py) in one parallel pass."""
    t, hkv, d = k.shape
    for x in (k, v):
        if x.dtype != torch.float32 or x.stride(2) != 1 or x.stride(1) != d:
            raise ValueError(f"store_kv_c: float32 rows of {hkv} x {d} expected, got {x.dtype} "
                             f"strides {x.stride()}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("store_kv_c: the caches must be contiguous")
    slots = slot_mapping.to(torch.int64).contiguous()
    load().cpu_store_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), t, hkv * d,
                        slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr())


C_OPS = PointwiseOps(add_rms_norm_c, rope_c, silu_mul_c)
