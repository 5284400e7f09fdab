"""The CPU projection kernel (linear.c), built and loaded by build.py: y = x W^T + b
in float32 on a weight laid out once in 16-column panels; its twin is F.linear.

Why C: a decode step multiplies each weight by only as many rows as sequences run (<= 64 on the
contract workload), where the libraries' products fall well short of the machine's peak. On this
project's 2-core machine (AVX2 FMA peak ~200 GFLOP/s, two cores), over 30 layers of
SmolLM2-135M's four projections with the weights streamed from memory, oneDNN on its own
reordered weight -> this: 16 rows 80-103 -> 141 GFLOP/s, 39 rows 105-119 -> 167, 64 rows 105-129
-> 160-179, 512 rows 128-146 -> 168-188, 8,192 rows 151 -> 168 (the machine's phases move both;
in a whole run, decode steps of 48-64 rows reach 171-178). Without a compiler, or with
BATCHLLM_CPU_KERNEL=0, `load()` returns None.

Small steps are bound by the weights' stream: 538 MB a step against ~14.5 GB/s for one core and
~25-27.5 GB/s for two (scripts/bench_linear.py), a floor of ~20 ms a step whatever its rows. The
AVX-512 tiles of up to 24 rows read each panel once and ask for it 8 KB ahead into L2; on one
thread (the other core busy with niced work) a whole step of the model's projections took, for
1 / 8 / 16 / 24 / 32 rows, 35.6 / 55.8 / 75.3 / 92.0 / 112.6 ms with 6-row AVX2 tiles and
37.1 / 43.0 / 54.2 / 63.6 / 81.6 ms with these (floor ~36). `linear_argmax` is the greedy rows'
lm_head: the same product folded into each row's argmax, the [M, 49,152] logits never written.

"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

import torch

from batchllm_kernels.cpu.build import load_library
from batchllm_kernels.cpu.checks import address

PANEL = 16  # columns of W per panel (the kernel's NR)


@functools.cache
def load() -> ctypes.CDLL | None:
    """The built kernel, or None where it cannot be built (a warning says why, once)."""
    lib = load_library("linear", "the CPU projection kernel")
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.cpu_linear.argtypes = [ptr, i64, i64, i64, ptr, ptr, i64, ptr]
    lib.cpu_linear.restype = None
    lib.cpu_linear_argmax.argtypes = [ptr, i64, i64, i64, ptr, ptr, i64, ptr]
    lib.cpu_linear_argmax.restype = None
    return lib


def rows(weight: torch.Tensor | Sequence[torch.Tensor]) -> int:
    """N of a weight [N, K] given whole or as its row blocks."""
    return weight.shape[0] if isinstance(weight, torch.Tensor) else sum(w.shape[0] for w in weight)


def pack_panels(weight: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """weight [N, K] (or its row blocks [N_i, K], in order) -> [ceil(N / 16), K, 16] float32,
    the last panel padded with zeros. Blocks are copied in place, not joined first."""
    parts = [weight] if isinstance(weight, torch.Tensor) else list(weight)
    n, k = rows(parts), parts[0].shape[1]
    count = -(-n // PANEL)
    padded = torch.empty(count * PANEL, k, dtype=torch.float32)
    padded[n:] = 0
    lo = 0
    for part in parts:
        padded[lo : lo + part.shape[0]] = part
        lo += part.shape[0]
    panels = padded.view(count, PANEL, k).transpose(1, 2).contiguous()
    if panels.data_ptr() % 32:
        raise RuntimeError("cpu_linear: panels must be 32-byte aligned")
    return panels


def pack_bias(bias: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """bias [N] -> [16 ceil(N / 16)] float32, zero padded (None stays None)."""
    if bias is None:
        return None
    padded = torch.zeros(-(-n // PANEL) * PANEL, dtype=torch.float32)
    padded[:n] = bias
    return padded


def _rows(x: torch.Tensor, panels: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != panels.shape[1]:
        raise ValueError(f"cpu_linear: float32 [M, {panels.shape[1]}] expected, got {x.dtype} "
                         f"{tuple(x.shape)}")
    return x if x.stride(-1) == 1 else x.contiguous()


def linear(
    x: torch.Tensor,  # [M, K] float32, rows contiguous (any row stride)
    panels: torch.Tensor,  # [ceil(N / 16), K, 16] from pack_panels
    bias: torch.Tensor | None,  # [16 ceil(N / 16)] from pack_bias, or None
    n: int,
) -> torch.Tensor:  # [M, N]
    """x W^T + b on the packed weight."""
    x = _rows(x, panels)
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    if x.shape[0]:
        load().cpu_linear(x.data_ptr(), x.shape[0], x.stride(0), x.shape[1], panels.data_ptr(),
                          address(bias), n, y.data_ptr())
    return y


def linear_argmax(
    x: torch.Tensor,  # [M, K] float32, as linear()
    panels: torch.Tensor,
    bias: torch.Tensor | None,
    n: int,
) -> torch.Tensor:  # [M] int64
    """linear(x, panels, bias, n).argmax(-1) without the [M, N] product ever written (a
    greedy row's lm_head: 49,152 logits a row): the same values, so the same index, the first
    maximum on ties and the first NaN where there is one, as torch.argmax."""
    x = _rows(x, panels)
    ids = torch.empty(x.shape[0], dtype=torch.int64)
    if x.shape[0]:
        load().cpu_linear_argmax(x.data_ptr(), x.shape[0], x.stride(0), x.shape[1],
                                 panels.data_ptr(), address(bias), n, ids.data_ptr())
    return ids

