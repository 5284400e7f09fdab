"""The KV budget: RAM from a portable source (psutil, else os.sysconf, else physical pages as on
macOS), the measured peak set aside, bytes given as bytes; the warm-up's measured peak."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from batchllm.engine.kv_budget import CPU_DEFAULT_CAP, available_ram, kv_budget_bytes
from batchllm.engine.warmup import measured_peak_bytes

PAGE = 4096


def fake_sysconf(values: dict[str, int]):
    return lambda name: values[name]


def test_without_psutil_available_pages_come_from_sysconf(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "psutil", None)  # import psutil raises ImportError
    values = {"SC_AVPHYS_PAGES": 1000, "SC_PHYS_PAGES": 5000, "SC_PAGE_SIZE": PAGE}
    names = {"SC_AVPHYS_PAGES": 1, "SC_PHYS_PAGES": 2, "SC_PAGE_SIZE": 3}
    assert available_ram(fake_sysconf(values), names) == 1000 * PAGE


def test_the_non_linux_path_without_available_pages_takes_physical_pages(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "psutil", None)
    values = {"SC_PHYS_PAGES": 5000, "SC_PAGE_SIZE": PAGE}  # macOS: no SC_AVPHYS_PAGES
    names = {"SC_PHYS_PAGES": 2, "SC_PAGE_SIZE": 3}
    assert available_ram(fake_sysconf(values), names) == 5000 * PAGE


def test_psutil_and_sysconf_agree_on_this_machine_within_a_quarter() -> None:
    psutil = pytest.importorskip("psutil")
    if "SC_AVPHYS_PAGES" not in os.sysconf_names:
        pytest.skip("no SC_AVPHYS_PAGES here")
    ours = available_ram()
    free_pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert ours == pytest.approx(psutil.virtual_memory().available, rel=0.01)
    assert 0 < free_pages <= psutil.virtual_memory().total  # free <= available <= total
    assert ours >= free_pages * 0.75


def test_the_reserved_peak_comes_off_before_the_fraction() -> None:
    cpu = torch.device("cpu")
    whole = kv_budget_bytes(1e-6, cpu)
    reserved = available_ram() // 2
    assert kv_budget_bytes(1e-6, cpu, reserved) < whole
    assert kv_budget_bytes(1.0, cpu, 10 * available_ram()) == 0
    assert kv_budget_bytes(1.0, cpu) <= CPU_DEFAULT_CAP
    assert kv_budget_bytes(123_456, cpu, reserved) == 123_456  # bytes are bytes


def test_the_warm_up_runs_the_forward_once() -> None:
    calls = []
    assert measured_peak_bytes(lambda: calls.append(torch.ones(1000)), torch.device("cpu")) == 0
    assert len(calls) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: the allocator's peak")
def test_the_measured_peak_on_cuda_covers_the_forwards_tensors() -> None:
    device = torch.device("cuda")

    def forward():
        a = torch.empty(64 << 20, dtype=torch.uint8, device=device)
        b = torch.empty(32 << 20, dtype=torch.uint8, device=device)
        return a, b

    assert measured_peak_bytes(forward, device) >= 96 << 20


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_the_warm_up_step_runs_max_batched_tokens_of_prefill_in_one_step(
        backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The step Runtime.build measures on CUDA before sizing the pool: a prefill of the whole
    budget in one forward, on the CPU path and on the CUDA path's step loop (interpreted)."""
    from hf_reference import tiny_model_folder

    from batchllm.engine.warmup import warm_up_step
    from batchllm.model.loader import load_model

    monkeypatch.setenv("BATCHLLM_BACKEND", backend)
    if backend == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    loaded = load_model(str(tiny_model_folder("llama")), "float32", "cpu", 64)
    stats = warm_up_step(loaded, 40, 16)
    assert (stats.steps, stats.prefill_tokens, stats.completion_tokens) == (1, 40, 1)
