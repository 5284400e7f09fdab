"""Triton kernel: write a step's new K and V into their slots of the paged cache.

Also holds the input checks shared by the attention launchers (device, cache layout).
Twin: `kernels.reference.store_kv_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr,  # [T, Hkv, D]
    k_cache_ptr, v_cache_ptr,  # [num_pages * page_size, Hkv, D], contiguous
    slot_ptr,  # [T] int64
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_slot, stride_ch,
    HKV: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # a padding slot: nothing to write
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < HKV) & (offs_d[None, :] < D)
    dst = slot * stride_slot + offs_h[:, None] * stride_ch + offs_d[None, :]
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def pow2(n: int) -> int:
    """The smallest power of two >= n (triton.next_power_of_2, without its call overhead)."""
    return 1 << max(n - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_device(kernel: object, **tensors: torch.Tensor) -> torch.device:
    """All tensors on one device; CUDA, or the CPU when `kernel` runs in Triton's interpreter."""
    first = next(iter(tensors.values())).device
    if any(t.device != first for t in tensors.values()):
        devices = {name: str(t.device) for name, t in tensors.items()}
        raise ValueError(f"all tensors must be on one device, got {devices}")
    if first.type != "cuda" and not isinstance(kernel, InterpretedFunction):
        raise ValueError(
            f"Triton kernels need CUDA tensors (got {first}); set TRITON_INTERPRET=1 before "
            "importing kernels to run them on the CPU, or use the *_ref twins"
        )
    return first


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    """k_cache, v_cache: contiguous [num_pages, page_size, Hkv, D] -> (page_size, Hkv, D)."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_pages, page_size, Hkv, D], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"k_cache and v_cache must share a dtype in {FLOAT_DTYPES}, got "
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


def store_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    """Write each token's K and V into slot page * page_size + offset of the paged cache.

    K and V are cast to the cache dtype. A negative slot is skipped (a padding token).
    """
    _, hkv, d = check_cache(k_cache, v_cache)
    t = k.shape[0] if k.dim() == 3 else -1
    check_rows("k", k, (t, hkv, d))
    check_rows("v", v, (t, hkv, d))
    check_index("slot_mapping", slot_mapping, (t,), torch.int64)
    check_device(_store_kv_kernel, k=k, v=v, k_cache=k_cache, v_cache=v_cache,
                 slot_mapping=slot_mapping)
    if t == 0:
        return
    _store_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(1), k_cache.stride(2),
        HKV=hkv, D=d, BLOCK_H=pow2(hkv), BLOCK_D=pow2(d),
    )
