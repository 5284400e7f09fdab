"""What the Triton launchers share: their input checks (device, cache layout, index and row
tensors, the attention's query against its cache) and the integer helpers of their grids.

Each launcher checks dtype, shape, stride and contiguity here before it computes its grid, so
a bad argument is a ValueError naming it, never a wrong read on the GPU.
"""

from __future__ import annotations

import torch
from triton.runtime.interpreter import InterpretedFunction

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP8 = torch.float8_e4m3fn  # an FP8 KV cache: e4m3, scaled per KV head (kernels/reference/kv_fp8.py)
CACHE_DTYPES = (*FLOAT_DTYPES, FP8)


def pow2(n: int) -> int:
    """The smallest power of two >= n (triton.next_power_of_2, without its call overhead)."""
    return 1 << max(n - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_device(kernel: object, **tensors: torch.Tensor) -> torch.device:
    """All tensors on one device; CUDA, or the CPU when `kernel` runs in Triton's interpreter, or
    "meta": a plan that is only compiled (scripts/compile_check.py), never launched."""
    first = next(iter(tensors.values())).device
    if any(t.device != first for t in tensors.values()):
        devices = {name: str(t.device) for name, t in tensors.items()}
        raise ValueError(f"all tensors must be on one device, got {devices}")
    if first.type not in ("cuda", "meta") and not isinstance(kernel, InterpretedFunction):
        raise ValueError(
            f"Triton kernels need CUDA tensors (got {first}); set TRITON_INTERPRET=1 before "
            "importing batchllm_kernels.triton to run them on the CPU, or use the twins in "
            "batchllm_kernels.reference"
        )
    return first


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    """k_cache, v_cache: contiguous [num_pages, page_size, Hkv, D] -> (page_size, Hkv, D)."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_pages, page_size, Hkv, D], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in CACHE_DTYPES:
        raise ValueError(
            f"k_cache and v_cache must share a dtype in {CACHE_DTYPES}, got "
            f"{k_cache.dtype} and {v_cache.dtype}"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    return k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]


def check_index(name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """An index tensor of the given shape and dtype whose last dimension has stride 1."""
    if tuple(t.shape) != shape or t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype} of shape {shape}, got {t.dtype} {tuple(t.shape)}")
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{name} must have stride 1 in its last dimension, got {t.stride()}")


def check_rows(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    """A [T, H, D] float tensor of the given shape, contiguous in D (T and H may be strided)."""
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be one of {FLOAT_DTYPES}, got {t.dtype}")
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got {t.stride()}")


def check_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> tuple[int, int, int, int, int]:
    """q [T, Hq, D] against the cache -> (T, Hq, Hkv, D, page_size)."""
    page_size, hkv, d = check_cache(k_cache, v_cache)
    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hq, D], got shape {tuple(q.shape)}")
    t, hq = q.shape[0], q.shape[1]
    check_rows("q", q, (t, hq, d))
    if q.dtype != k_cache.dtype and k_cache.dtype != FP8:
        raise ValueError(f"q ({q.dtype}) and the cache ({k_cache.dtype}) must share a dtype")
    if hq % hkv:
        raise ValueError(f"Hq={hq} query heads must be a multiple of Hkv={hkv} KV heads")
    return t, hq, hkv, d, page_size


def kv_operands(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
                v_scale: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """(k_cache, v_cache, k_scale, v_scale) as a kernel takes them, and whether they are FP8.
    An FP8 cache goes as its uint8 view (kernels/triton/fp8.py says why) with its scales,
    float32 [Hkv] each, which it needs; a cache of another dtype takes none, and the kernel
    gets the cache in their place (never read)."""
    hkv = k_cache.shape[2]
    if k_cache.dtype != FP8:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale and v_scale are for an FP8 cache, not {k_cache.dtype}")
        return k_cache, v_cache, k_cache, v_cache, False
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None:
            raise ValueError(f"an FP8 cache needs {name} (float32 [Hkv]), got None")
        if tuple(scale.shape) != (hkv,) or scale.dtype != torch.float32 or scale.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous float32 of shape ({hkv},), got "
                             f"{scale.dtype} {tuple(scale.shape)}")
        if scale.device != k_cache.device:
            raise ValueError(f"{name} is on {scale.device}, the cache on {k_cache.device}")
    return k_cache.view(torch.uint8), v_cache.view(torch.uint8), k_scale, v_scale, True
