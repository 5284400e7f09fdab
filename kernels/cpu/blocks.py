"""The CPU projection kernel on GGUF blocks (blocks.c), built and loaded by build.py: y = x W^T
+ b with W as a GGUF file's Q8_0, Q4_0 or Q4_1 blocks, rows of K / 32 blocks as the file holds
them; the same sums, bit for bit, as linear.py's product over the dequantized weights.

Why: a decode step of few rows is bound by the weights' stream (linear.py), and the blocks are
5/32 (Q4_1) to 17/64 (Q8_0) of the float32 panels' bytes. Without a compiler, or with
BATCHLLM_CPU_KERNEL=0, `load()` returns None.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from batchllm_kernels.cpu.build import load_library
from batchllm_kernels.cpu.checks import address
from batchllm_kernels.cpu.linear import PANEL

# GGML's type name -> (its type id, bytes a block of 32 weights)
TYPES: dict[str, tuple[int, int]] = {"Q4_0": (2, 18), "Q4_1": (3, 20), "Q8_0": (8, 34)}
BLOCK = 32  # weights a block


@functools.cache
def load() -> ctypes.CDLL | None:
    """The built kernel, or None where it cannot be built (a warning says why, once)."""
    lib = load_library("blocks", "the CPU block kernel")
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.cpu_blocks_linear.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, i64, ptr]
    lib.cpu_blocks_linear.restype = None
    lib.cpu_blocks_linear_argmax.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, i64, ptr]
    lib.cpu_blocks_linear_argmax.restype = None
    lib.cpu_blocks_dequantize.argtypes = [ptr, i64, i64, i64, ptr]
    lib.cpu_blocks_dequantize.restype = None
    return lib


def type_id(kind: str) -> int:
    """GGML's id of a block type the kernel takes (ValueError for any other)."""
    if kind not in TYPES:
        raise ValueError(f"cpu_blocks: {kind} blocks are not supported ({', '.join(TYPES)} are)")
    return TYPES[kind][0]


def check_blocks(blocks: torch.Tensor, kind: str, k: int) -> None:
    """ValueError unless `blocks` are contiguous uint8 [N, K / 32 * block bytes] of `kind`."""
    want = k // BLOCK * TYPES[kind][1] if kind in TYPES else type_id(kind)
    if (blocks.dtype != torch.uint8 or blocks.dim() != 2 or k % BLOCK
            or blocks.shape[1] != want or not blocks.is_contiguous()):
        raise ValueError(f"cpu_blocks: contiguous uint8 [N, {want}] {kind} blocks of K = {k} "
                         f"expected, got {blocks.dtype} {tuple(blocks.shape)}")


def _rows(x: torch.Tensor, blocks: torch.Tensor, kind: str) -> torch.Tensor:
    if x.dtype != torch.float32 or x.dim() != 2:
        raise ValueError(f"cpu_blocks: float32 [M, K] expected, got {x.dtype} {tuple(x.shape)}")
    check_blocks(blocks, kind, x.shape[1])
    return x if x.stride(-1) == 1 else x.contiguous()


def linear(
    x: torch.Tensor,  # [M, K] float32, rows contiguous (any row stride)
    blocks: torch.Tensor,  # [N, K / 32 * block bytes] uint8, the file's rows
    kind: str,  # Q8_0 | Q4_0 | Q4_1
    bias: torch.Tensor | None,  # [16 ceil(N / 16)] from linear.pack_bias, or None
) -> torch.Tensor:  # [M, N]
    """x W^T + b on the blocks."""
    x = _rows(x, blocks, kind)
    n = blocks.shape[0]
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    if x.shape[0]:
        load().cpu_blocks_linear(x.data_ptr(), x.shape[0], x.stride(0), x.shape[1],
                                 blocks.data_ptr(), type_id(kind), address(bias), n, y.data_ptr())
    return y


def linear_argmax(x: torch.Tensor, blocks: torch.Tensor, kind: str,
                  bias: torch.Tensor | None) -> torch.Tensor:  # [M] int64
    """linear(x, blocks, kind, bias).argmax(-1), the product never written (linear.py's
    linear_argmax on blocks)."""
    x = _rows(x, blocks, kind)
    ids = torch.empty(x.shape[0], dtype=torch.int64)
    if x.shape[0]:
        load().cpu_blocks_linear_argmax(x.data_ptr(), x.shape[0], x.stride(0), x.shape[1],
                                        blocks.data_ptr(), type_id(kind), address(bias),
                                        blocks.shape[0], ids.data_ptr())
    return ids


def dequantize(blocks: torch.Tensor, kind: str, k: int) -> torch.Tensor:  # [N, K] float32
    """The weight the products see: the kernel's own dequantization of every block."""
    check_blocks(blocks, kind, k)
    n = blocks.shape[0]
    count = -(-n // PANEL)
    panels = torch.empty(count, k, PANEL, dtype=torch.float32)
    load().cpu_blocks_dequantize(blocks.data_ptr(), type_id(kind), k, n, panels.data_ptr())
    return panels.transpose(1, 2).reshape(count * PANEL, k)[:n]
