"""kernel_path (DESIGN's metrics key): the rule of batchllm/model/cpu_layers.kernel_path, each
branch forced here: the C kernels named by the CPU's own flags, the torch path when they are
switched off or the dtype is not float32, cuda-triton on CUDA."""

from __future__ import annotations

import platform

import pytest

from batchllm.model.cpu_layers import kernel_path
from kernels.cpu import linear as cpu_linear


def _flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return {w for line in f if line.startswith("flags")
                    for w in line.split(":", 1)[1].split()}
    except OSError:
        return set()


def test_the_c_path_is_named_by_the_cpus_widest_vector_unit():
    flags = _flags()
    if platform.machine().lower() not in ("x86_64", "amd64") or "avx2" not in flags:
        assert kernel_path("cpu", "float32") == "cpu-torch"
        return
    if cpu_linear.load() is None:
        pytest.skip("the C kernels cannot be built here (no compiler or no safe folder)")
    want = "cpu-c-avx512" if "avx512f" in flags else "cpu-c-avx2"
    assert kernel_path("cpu", "float32") == want  # never an AMX name, AMX or not


def test_switched_off_the_torch_path_is_named(monkeypatch):
    monkeypatch.setenv("BATCHLLM_CPU_KERNEL", "0")
    assert kernel_path("cpu", "float32") == "cpu-torch"


def test_other_dtypes_and_cuda():
    assert kernel_path("cpu", "bfloat16") == "cpu-torch"
    assert kernel_path("cuda", "bfloat16") == "cuda-triton"
