"""Keep freed memory in the process (glibc), so that each step's tensors on the CPU reuse it.

Every step allocates tensors of the same few sizes (gathered keys, activations) and frees them.
glibc serves blocks above its mmap threshold with fresh mappings and hands freed memory at the
top of the heap back to the OS, so the next step page-faults it all in again (24 rows of the
contract workload without sharing: 2.0 M page faults before, 1.6 M after; with the MLP in
row blocks under the threshold, model/decoder.py, 0.4 M). PyTorch's CPU guides preload jemalloc or
tcmalloc for this; batchllm sets glibc's thresholds instead, which needs nothing installed, and
one arena for all threads (the compute threads' own arenas give memory back on their own terms).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed on 64-bit: blocks below come from the heap
TRIM_THRESHOLD = 1 << 30  # free heap top kept up to this much


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds, one arena; False where the libc is not glibc or
    the environment sets BATCHLLM_KEEP_FREED_MEMORY=0."""
    if not sys.platform.startswith("linux") or os.environ.get("BATCHLLM_KEEP_FREED_MEMORY") == "0":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok_mmap = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    ok_trim = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    ok_arena = mallopt(_M_ARENA_MAX, 1) == 1
    return ok_mmap and ok_trim and ok_arena
