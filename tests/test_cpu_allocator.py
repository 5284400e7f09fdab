"""glibc's thresholds are set where batchllm runs on Linux (engine/cpu_allocator.py)."""

from __future__ import annotations

import platform

import pytest

from batchllm.engine.cpu_allocator import keep_freed_memory


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_glibc_accepts_the_thresholds():
    assert keep_freed_memory() is True
