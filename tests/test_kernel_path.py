"""kernel_path (DESIGN's metrics key): the rule of batchllm/model/ops.kernel_path, each
branch forced here: the C kernels named by the CPU's own flags, the torch path when they are
switched off or the dtype is not float32, cuda-triton on CUDA."""

from __future__ import annotations

import platform

import pytest

from batchllm.model.ops import kernel_path
from batchllm_kernels.cpu import linear as cpu_linear


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
    assert kernel_path("cpu", "float32") == want  # the vector unit's name, whatever else the CPU has


def test_switched_off_the_torch_path_is_named(monkeypatch):
    monkeypatch.setenv("BATCHLLM_CPU_KERNEL", "0")
    assert kernel_path("cpu", "float32") == "cpu-torch"


def test_other_dtypes_and_cuda():
    assert kernel_path("cpu", "bfloat16") == "cpu-torch"
    assert kernel_path("cuda", "bfloat16") == "cuda-triton"


def test_the_avx2_build_is_forced_and_named(monkeypatch, tmp_path):
    """BATCHLLM_CPU_ISA=avx2 builds x86-64-v3 (no AVX-512) here too; its product is torch's
    float32 product within rounding, and the path says avx2."""
    import torch

    from batchllm_kernels.cpu import build as cpu_build

    if "avx2" not in _flags():
        pytest.skip("no AVX2 on this CPU")
    monkeypatch.setenv("BATCHLLM_CACHE", str(tmp_path))
    monkeypatch.setenv("BATCHLLM_CPU_ISA", "avx2")
    cpu_linear.load.cache_clear()
    try:
        if cpu_linear.load() is None:
            pytest.skip("the C kernels cannot be built here")
        assert kernel_path("cpu", "float32") == "cpu-c-avx2"
        assert any("cpu_linear-" in p.name for p in (tmp_path / "kernels").iterdir())
        g = torch.Generator().manual_seed(0)
        x, w = torch.randn(3, 96, generator=g), torch.randn(40, 96, generator=g)
        panels = cpu_linear.pack_panels(w)
        torch.testing.assert_close(cpu_linear.linear(x, panels, None, 40), x @ w.T)
    finally:
        cpu_linear.load.cache_clear()
        cpu_build._said.clear()


def test_on_arm_the_torch_ops_are_picked_named_and_said(monkeypatch, capsys):
    """The C kernels' vector code is AVX2 / AVX-512 only: on a CPU without AVX2 (an ARM one here,
    by its /proc/cpuinfo and platform name) they are neither built nor picked, the path is
    cpu-torch, and one note says why."""
    import torch

    from batchllm.model.ops import pick_ops
    from batchllm_kernels.cpu import build as cpu_build
    from batchllm_kernels.reference.paged_attention import paged_attention_ref
    from batchllm_kernels.reference.pointwise import TORCH_OPS

    arm = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm aes crc32\n"
    monkeypatch.setattr(cpu_build, "_cpu_id", lambda: arm)
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(cpu_build, "_said", set())
    assert kernel_path("cpu", "float32") == "cpu-torch"
    ops = pick_ops(torch.device("cpu"), torch.float32, 9, 64)
    assert ops.paged_attention is paged_attention_ref and ops.pointwise is TORCH_OPS
    assert ops.projection != "panels"
    assert cpu_build.load_library("ops", "the CPU ops") is None
    err = capsys.readouterr().err
    assert err.count("need AVX2 or AVX-512, not found on this CPU (aarch64)") == 1, err
