"""glibc's thresholds keep freed memory in the process (engine/cpu_allocator.py): a step that
allocates and frees the same buffers again does not page-fault them in again.

Measured in a fresh process each time, so this test process's own allocator is left as it is.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BUFFERS, MIB, ROUNDS = 3, 8, 20  # 24 MiB live per round, as a step's gathered keys and activations

# Each round mallocs BUFFERS blocks of MIB MiB, writes every page, frees them all. With glibc's
# defaults the first free raises the mmap threshold to 8 MiB and the trim threshold to 16 MiB,
# so the 24 MiB freed at the top of the heap go back to the OS and the next round faults them in
# again; with keep_freed_memory() the trim threshold is 1 GiB and they stay.
_CHILD = """
import ctypes, ctypes.util, json, resource, sys
from batchllm.engine.cpu_allocator import keep_freed_memory

kept = keep_freed_memory()
buffers, size, rounds = int(sys.argv[1]), int(sys.argv[2]) << 20, int(sys.argv[3])
libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def one_round():
    blocks = [libc.malloc(size) for _ in range(buffers)]
    for b in blocks:
        ctypes.memset(b, 1, size)
    for b in blocks:
        libc.free(b)

one_round()  # the first touch of the pages faults in any case
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(rounds):
    one_round()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"kept": kept, "faults_per_round": faults / rounds}))
"""


def faults_per_round(keep: str | None) -> tuple[bool, float]:
    """(keep_freed_memory()'s result, minor page faults per round) in a fresh process."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("BATCHLLM_KEEP_FREED_MEMORY", None)
    if keep is not None:
        env["BATCHLLM_KEEP_FREED_MEMORY"] = keep
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(BUFFERS), str(MIB), str(ROUNDS)],
        env=env, capture_output=True, text=True, timeout=300, check=True,
    )
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return out["kept"], out["faults_per_round"]


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_freed_buffers_are_not_faulted_in_again():
    pages = BUFFERS * (MIB << 20) // os.sysconf("SC_PAGE_SIZE")
    kept, faults = faults_per_round(None)
    assert kept is True
    assert faults < pages / 20, f"{faults:.0f} faults per round of {pages} pages"
    # without the thresholds the same rounds fault (nearly) every page in again: the measure
    # above can tell the two apart
    kept, faults = faults_per_round("0")
    assert kept is False
    assert faults > pages / 2, f"only {faults:.0f} faults per round of {pages} pages"
