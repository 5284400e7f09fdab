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

On a CPU with AMX-BF16 (`uses_amx()`), the products run on the tile unit when the caller passes
the weight's `split_parts` (amx.h: float32 split exactly into three bfloat16 parts, two where the
third is zero throughout, as in a dequantized checkpoint, one where the value is bfloat16, as in
a bfloat16 checkpoint; 1.4-2x the FMA tiles on SmolLM2's shapes from 32 rows, 460-500 GFLOP/s
at 512 rows and more). Given its `argmax_bounds` too, `linear_argmax` ranks the columns by W's
high part first and computes exactly only the panels that can hold a row's maximum
(amx_argmax.h: the same index, SmolLM2's lm_head 2.7x faster on small steps). Where the
weight's values are Q4_1's (SmolLM2's layers), `pack_q4` finds its 4-bit blocks, which products
of up to BLOCK_ROWS rows stream in place of the parts (amx_q4.h: the same sums; 1 row 22.5 ->
17.0 ms a step of the model's projections and lm_head).
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Sequence

import torch

from kernels.cpu.build import load_library
from kernels.cpu.checks import address

PANEL = 16  # columns of W per panel (the kernel's NR)


@functools.cache
def load() -> ctypes.CDLL | None:
    """The built kernel, or None where it cannot be built (a warning says why, once)."""
    lib = load_library("linear", "the CPU projection kernel")
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.cpu_linear.argtypes = [ptr, i64, i64, i64, ptr, ptr, i64, ptr, ptr, i64, ptr]
    lib.cpu_linear.restype = None
    lib.cpu_linear_argmax.argtypes = [ptr, i64, i64, i64, ptr, ptr, i64, ptr, ptr, i64, ptr]
    lib.cpu_linear_argmax.restype = None
    lib.cpu_linear_use_amx.argtypes = [ctypes.c_int]
    lib.cpu_linear_use_amx.restype = None
    lib.cpu_linear_amx.argtypes = []
    lib.cpu_linear_amx.restype = ctypes.c_int
    lib.cpu_linear_q4_pack.argtypes = [ptr, i64, i64, ptr]
    lib.cpu_linear_q4_pack.restype = ctypes.c_int
    lib.cpu_linear_split.argtypes = [ptr, i64, i64, ptr, i64]
    lib.cpu_linear_split.restype = ctypes.c_int
    lib.cpu_linear_bounds.argtypes = [ptr, i64, i64, ptr]
    lib.cpu_linear_bounds.restype = ctypes.c_int
    lib.cpu_linear_argmax_exact_panels.argtypes = []
    lib.cpu_linear_argmax_exact_panels.restype = i64
    lib.cpu_linear_use_amx(int(os.environ.get("BATCHLLM_CPU_AMX", "1") != "0"))
    return lib


def uses_amx() -> bool:
    """Whether products given their weight's parts run on the tile unit (AMX-BF16, split to
    float32's exactness: amx.h); False without the kernel, on a CPU without AMX-BF16, where Linux
    refuses the tiles, or with BATCHLLM_CPU_AMX=0."""
    lib = load()
    return lib is not None and bool(lib.cpu_linear_amx())


def split_parts(panels: torch.Tensor) -> torch.Tensor:  # [P, K, 16] -> [P, 1-3, Kp / 2, 32]
    """The tile unit's copy of a packed weight: each float32 value as three bfloat16 (h + m + l,
    exactly), pair-interleaved, K padded to Kp (a multiple of 32) with zeros; 1.5x the panels'
    bytes. Where every l is zero (values of at most 16 significant bits: a checkpoint
    dequantized from 4 or 8 bits, as SmolLM2's Q4_1 layers, or from float16) only h and m are
    kept, the panels' bytes; where every m is zero too (values that are bfloat16: a bfloat16
    checkpoint's) only h, half of them. The kernel skips the products the dropped parts would
    add: the same sums, bit for bit."""
    count, k, _ = panels.shape
    kp = -(-k // 32) * 32
    for planes in (2, 3):  # two first: the third only where some l is nonzero
        parts = torch.empty(count, planes, kp // 2, 2 * PANEL, dtype=torch.int16)
        nonzero = load().cpu_linear_split(panels.data_ptr(), count, k, parts.data_ptr(), planes)
        if nonzero < 0:
            raise RuntimeError("cpu_linear: split_parts needs a build with the tile unit "
                               "(uses_amx())")
        if not nonzero & 2:  # l only +-0: the product hl would add zeros
            return parts if nonzero & 1 else parts[:, :1].contiguous()  # m too: hm, mm
    return parts


Q4_BYTES = 320  # bytes of a panel's block of 32 k: 16 x 32 nibbles, then 16 float16 d and m
BLOCK_ROWS = 48  # rows up to which a product given the blocks takes them (amx_q4.h's Q4_ROWS)


def pack_q4(panels: torch.Tensor) -> torch.Tensor | None:  # [P, K, 16] -> [P, K / 32, 320]
    """The weight as 4-bit blocks (q4_blocks.h: w = d q + m, q in 0..15, float16 d and m a
    column and 32 of K), found again in its float32 values, where every value is of that form
    and two parts hold it (a checkpoint dequantized from llama.cpp's Q4_1, as SmolLM2's layers):
    0.625 bytes a weight, which products of up to BLOCK_ROWS rows stream instead of the 4 of
    split_parts (amx_q4.h), with the same sums, bit for bit; larger products keep the parts.
    None where some value is not of that form, where K is not a multiple of 32, where every m
    part is zero (bfloat16 values: their one part skips the products that the blocks' two would
    add) or where the build has no tile unit."""
    count, k, _ = panels.shape
    if k % 32 or load() is None:
        return None
    blocks = torch.empty(count, k // 32, Q4_BYTES, dtype=torch.uint8)
    found = load().cpu_linear_q4_pack(panels.data_ptr(), count, k, blocks.data_ptr())
    return blocks if found == 1 else None


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
    parts: torch.Tensor | None = None,  # split_parts(panels): on the tile unit where uses_amx()
    blocks: torch.Tensor | None = None,  # pack_q4(panels): taken up to BLOCK_ROWS rows
) -> torch.Tensor:  # [M, N]
    """x W^T + b on the packed weight."""
    x = _rows(x, panels)
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    if x.shape[0]:
        blocks = checked_blocks(blocks, panels, parts)
        load().cpu_linear(x.data_ptr(), x.shape[0], x.stride(0), x.shape[1], panels.data_ptr(),
                          address(parts), part_count(parts, panels), address(blocks),
                          address(bias), n, y.data_ptr())
    return y


def argmax_bounds(panels: torch.Tensor) -> torch.Tensor | None:  # [P, K, 16] -> [2, 16 P]
    """What linear_argmax needs to take the tile unit's pruned pass (amx.h's sibling
    amx_argmax.h): each column's ||w - bf16(w)|| and ||w||, rounded up; None where the build has
    no tile unit."""
    count, k, _ = panels.shape
    bounds = torch.empty(2, count * PANEL, dtype=torch.float32)
    if not load().cpu_linear_bounds(panels.data_ptr(), count, k, bounds.data_ptr()):
        return None
    return bounds


def linear_argmax(
    x: torch.Tensor,  # [M, K] float32, as linear()
    panels: torch.Tensor,
    bias: torch.Tensor | None,
    n: int,
    parts: torch.Tensor | None = None,
    bounds: torch.Tensor | None = None,  # argmax_bounds(panels), with parts and no bias
) -> torch.Tensor:  # [M] int64
    """linear(x, panels, bias, n, parts).argmax(-1) without the [M, N] product ever written (a
    greedy row's lm_head: 49,152 logits a row): the same values, so the same index, the first
    maximum on ties and the first NaN where there is one, as torch.argmax. Given bounds, the
    tile unit first takes W's high part alone and the exact product only of the panels whose
    columns its bound leaves in the running (the same index, ~a third of the bytes)."""
    x = _rows(x, panels)
    ids = torch.empty(x.shape[0], dtype=torch.int64)
    if bounds is not None and (bounds.dtype != torch.float32 or not bounds.is_contiguous()
                               or tuple(bounds.shape) != (2, panels.shape[0] * PANEL)):
        raise ValueError(f"cpu_linear: bounds [2, {panels.shape[0] * PANEL}] float32 expected "
                         f"from argmax_bounds, got {bounds.dtype} {tuple(bounds.shape)}")
    if x.shape[0]:
        load().cpu_linear_argmax(x.data_ptr(), x.shape[0], x.stride(0), x.shape[1],
                                 panels.data_ptr(), address(parts), part_count(parts, panels),
                                 address(bias), address(bounds), n, ids.data_ptr())
    return ids


def argmax_exact_panels() -> int:
    """How many (16-row tile, panel) pairs the process's last linear_argmax computed exactly
    after its first pass on W's high parts; -1 where it took the whole product (for tests)."""
    return load().cpu_linear_argmax_exact_panels()


def checked_blocks(blocks: torch.Tensor | None, panels: torch.Tensor,
                   parts: torch.Tensor | None) -> torch.Tensor | None:
    """blocks, where they are pack_q4's of panels and come with its two parts (else
    ValueError: larger products take the parts, and must take the same sums)."""
    if blocks is None:
        return None
    count, k, _ = panels.shape
    if (blocks.dtype != torch.uint8 or not blocks.is_contiguous()
            or tuple(blocks.shape) != (count, k // 32, Q4_BYTES)):
        raise ValueError(f"cpu_linear: blocks of panels {tuple(panels.shape)} expected from "
                         f"pack_q4, got {blocks.dtype} {tuple(blocks.shape)}")
    if parts is None or parts.shape[1] != 2:
        raise ValueError("cpu_linear: blocks are taken only beside the weight's two parts "
                         "(split_parts)")
    return blocks


def part_count(parts: torch.Tensor | None, panels: torch.Tensor) -> int:
    """How many parts of each weight split_parts kept (3, 2 without l, 1 without m and l); 0
    without parts."""
    if parts is None:
        return 0
    count, k, _ = panels.shape
    if (parts.dtype != torch.int16 or not parts.is_contiguous() or parts.dim() != 4
            or parts.shape[1] not in (1, 2, 3)
            or (parts.shape[0], parts.shape[2:]) != (count, (-(-k // 32) * 16, 2 * PANEL))):
        raise ValueError(f"cpu_linear: parts of panels {tuple(panels.shape)} expected from "
                         f"split_parts, got {parts.dtype} {tuple(parts.shape)}")
    return parts.shape[1]
