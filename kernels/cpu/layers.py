"""A step's plain decoder layers in one C call (layers.c), built and loaded by build.py: the
records it takes, as ctypes structures, and the other libraries' kernels it calls.

The records mirror layers.c's field for field. `kernels()` fills the Kernels record from the
linear, ops, decode, prefill and blocks libraries (None where one of them is not built); the caller
(batchllm/model/cpu_layers.py) fills one Layer a layer at load and one Step a step.
"""

from __future__ import annotations

import ctypes
import functools

from batchllm_kernels.cpu import blocks, decode, linear, ops, prefill
from batchllm_kernels.cpu.build import load_library

_p, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class Kernels(ctypes.Structure):
    _fields_ = [(name, _p) for name in ("linear", "add_rms_norm", "rope", "silu_mul",
                                        "store_kv", "decode", "chunks", "prefix",
                                        "blocks")]


class Projection(ctypes.Structure):
    _fields_ = [("panels", _p), ("bias", _p), ("n", _i64), ("blocks", _p), ("type", _i64)]


class Layer(ctypes.Structure):
    _fields_ = [("norm_in", _p), ("norm_mlp", _p), ("qkv", Projection), ("o", Projection),
                ("gate_up", Projection), ("down", Projection), ("cos", _p), ("sin", _p),
                ("rotary_dim", _i64), ("max_position", _i64), ("k_cache", _p),
                ("v_cache", _p)]


class Shape(ctypes.Structure):
    _fields_ = [(name, _i64) for name in ("hidden", "hq", "hkv", "d", "intermediate",
                                          "page_size", "mlp_rows")] + [("eps", _f32),
                                                                       ("scale", _f32)]


class Step(ctypes.Structure):
    _fields_ = [("T", _i64), ("positions", _p), ("slots", _p), ("page_table", _p),
                ("max_pages", _i64), ("cu_q", _p), ("context_lens", _p), ("kv_start", _p),
                ("decode_seqs", _p), ("decode_rows", _p), ("decodes", _i64),
                ("chunk_seqs", _p), ("chunks", _i64), ("groups", _i64), ("prefix_pages", _p),
                ("max_prefix_pages", _i64), ("prefix_lens", _p), ("cu_prefix_q", _p)] + [
        (name, _p) for name in ("h", "x", "qkv", "o", "lse", "a", "gate_up", "act", "m")]


@functools.cache
def load() -> ctypes.CDLL | None:
    """The built driver, or None where it cannot be built (a warning says why, once)."""
    lib = load_library("layers", "the CPU layers driver")
    if lib is None:
        return None
    ptr = ctypes.POINTER
    lib.cpu_layers.argtypes = [ptr(Kernels), ptr(Shape), ptr(Layer), _i64, ptr(Step)]
    lib.cpu_layers.restype = _i64
    return lib


@functools.cache
def kernels() -> Kernels | None:
    """The Kernels record of the built libraries; None where any of them is not built (the
    block kernel's entry is NULL where it is not: then no projection holds blocks)."""
    libs = [m.load() for m in (linear, ops, decode, prefill)]
    if any(lib is None for lib in libs) or load() is None:
        return None
    lin, pointwise, dec, pre = libs
    fns = (lin.cpu_linear, pointwise.cpu_add_rms_norm, pointwise.cpu_rope,
           pointwise.cpu_silu_mul, pointwise.cpu_store_kv, dec.cpu_decode_attention,
           pre.cpu_prefill_attention, pre.cpu_prefix_attention)
    block_lib = blocks.load()
    fns += (block_lib.cpu_blocks_linear,) if block_lib is not None else ()
    return Kernels(*(ctypes.cast(f, _p).value for f in fns))


def run_layers(shape: Shape, layers: ctypes.Array, step: Step) -> int:
    """layers.c's cpu_layers over every layer of `layers`: -1, or the first layer whose rotary
    tables a position of the step lies outside of."""
    return load().cpu_layers(ctypes.byref(kernels()), ctypes.byref(shape), layers, len(layers),
                             ctypes.byref(step))
