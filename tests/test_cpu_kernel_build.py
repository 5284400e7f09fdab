"""Building the C kernels of the CPU path (kernels/cpu/build.py): built once into
$BATCHLLM_CACHE/kernels and reused; without a compiler or with BATCHLLM_CPU_KERNEL=0 the model's
ops record (batchllm/model/ops.py) falls back to the torch twins (their results are checked
against SDPA in test_reference_attention.py and against transformers in test_cpu_ops.py)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from batchllm.model.attention import PagedAttention
from batchllm.model.linear import Linear
from batchllm_kernels.cpu import attention as cpu_attention
from batchllm_kernels.cpu import build as cpu_build
from batchllm_kernels.cpu import decode as cpu_decode
from batchllm_kernels.cpu import linear as cpu_linear
from batchllm_kernels.cpu import ops as cpu_ops
from batchllm_kernels.cpu import prefill as cpu_prefill
from batchllm_kernels.reference.pointwise import TORCH_OPS

LOADERS = (cpu_decode.load, cpu_prefill.load, cpu_ops.load, cpu_linear.load)


@pytest.fixture
def fresh_load(monkeypatch, tmp_path):
    monkeypatch.setenv("BATCHLLM_CACHE", str(tmp_path))
    for load in LOADERS:
        load.cache_clear()
    yield tmp_path
    for load in LOADERS:
        load.cache_clear()
    cpu_build._said.clear()


def cache() -> PagedAttention:
    """A 2-layer cache of 8 pages of 16 tokens, 9 query and 3 KV heads of 64."""
    return PagedAttention(2, 8, 16, 9, 3, 64, torch.float32, torch.device("cpu"))


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler here")
@pytest.mark.slow  # builds the C kernels afresh (a compiler run)
def test_built_once_into_the_cache_and_used(fresh_load):
    assert all(load() is not None for load in LOADERS)
    built = sorted((fresh_load / "kernels").glob("cpu_*.so"))
    assert [p.name.rsplit("-", 1)[0] for p in built] == ["cpu_decode", "cpu_linear", "cpu_ops",
                                                             "cpu_prefill"]
    stamps = [p.stat().st_mtime_ns for p in built]
    for load in LOADERS:
        load.cache_clear()
    assert all(load() is not None for load in LOADERS)
    assert [p.stat().st_mtime_ns for p in built] == stamps  # reused, not rebuilt
    attention = cache()
    assert attention.ops.paged_attention is cpu_attention.paged_attention_cpu
    assert not attention.ops.gathers_decodes and not attention.ops.gathers_chunks
    assert attention.ops.store_kv is cpu_ops.store_kv_c
    assert attention.ops.pointwise is cpu_ops.C_OPS
    assert Linear(torch.randn(8, 4), None, attention.ops.projection).panels is not None


def test_without_a_compiler_the_twins_run(fresh_load, monkeypatch, capsys):
    monkeypatch.setenv("CC", "no-such-compiler-here")
    assert all(load() is None for load in LOADERS)
    assert "could not be built" in capsys.readouterr().err
    attention = cache()
    assert attention.ops.gathers_decodes and attention.ops.gathers_chunks
    assert attention.ops.paged_attention.__name__ == "paged_attention_ref"
    assert attention.ops.store_kv.__name__ == "store_kv_ref"
    assert attention.ops.pointwise is TORCH_OPS
    # oneDNN's layout, or F.linear
    assert Linear(torch.randn(8, 4), None, attention.ops.projection).panels is None


def test_switched_off(fresh_load, monkeypatch):
    monkeypatch.setenv("BATCHLLM_CPU_KERNEL", "0")
    assert all(load() is None for load in LOADERS)
    assert cache().ops.gathers_decodes and cache().ops.gathers_chunks


@pytest.mark.slow  # builds the C kernels afresh (a compiler run)
def test_loading_the_kernels_keeps_subnormal_floats():
    """The C kernels are built with -ffast-math; loading them must not switch the process to
    flush-to-zero (GCC's crtfastmath.o did, for torch's and numpy's float ops too)."""
    code = (
        "import numpy as np, torch\n"
        "from batchllm_kernels.cpu import decode, linear, ops, prefill\n"
        "libs = [m.load() for m in (decode, linear, ops, prefill)]\n"
        "assert all(lib is not None for lib in libs), libs\n"
        "tiny = np.float32(1e-39)\n"
        "print(float(tiny * np.float32(0.5)) > 0, float(torch.tensor(1e-39) * 0.5) > 0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.split() == ["True", "True"]


# -- the cache holds code: private, checked before loading ---------------------------------------

_PLANTED = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(getenv("BATCHLLM_PLANTED"), "w");
    if (f) { fputs("ran", f); fclose(f); }
}
"""


def _plant(path: Path) -> None:
    """A library that, once loaded, writes the file $BATCHLLM_PLANTED (as a planted one would
    run its code as the job)."""
    source = path.with_name("planted.c")
    source.write_text(_PLANTED)
    subprocess.run(["cc", "-shared", "-fPIC", str(source), "-o", str(path)], check=True)
    source.unlink()
    os.chmod(path, 0o777)


def _reload() -> None:
    for load in LOADERS:
        load.cache_clear()
    cpu_build._said.clear()


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler here")
@pytest.mark.slow  # builds the C kernels afresh (a compiler run)
def test_a_planted_library_is_never_loaded(fresh_load, monkeypatch, capsys):
    """A library planted under the exact name a build would take: in a world-writable shared
    cache it is not loaded (nothing is: the torch path runs, said once for all libraries); in
    this user's own cache, writable by others, it is built over before loading."""
    assert cpu_ops.load() is not None  # a build in a private cache: the library's name
    own = fresh_load / "kernels"
    assert stat.S_IMODE(own.stat().st_mode) == 0o700
    name = next(own.glob("cpu_ops-*.so")).name
    marker = fresh_load / "planted-ran"
    monkeypatch.setenv("BATCHLLM_PLANTED", str(marker))
    shared = fresh_load / "shared"
    (shared / "kernels").mkdir(parents=True)
    for folder in (shared, shared / "kernels"):
        os.chmod(folder, 0o777)
    _plant(shared / "kernels" / name)
    monkeypatch.setenv("BATCHLLM_CACHE", str(shared))
    _reload()
    capsys.readouterr()
    assert cpu_ops.load() is None and cpu_decode.load() is None
    assert not marker.exists()
    err = capsys.readouterr().err
    assert err.count("the C kernels are not built or loaded") == 1, err
    assert "writable by others" in err and "torch path runs" in err
    # this user's private cache, a library in it made writable by others: built again over it
    monkeypatch.setenv("BATCHLLM_CACHE", str(fresh_load))
    _plant(own / name)
    _reload()
    assert cpu_ops.load() is not None and not marker.exists()
    assert stat.S_IMODE((own / name).stat().st_mode) == 0o700


def test_with_nowhere_safe_to_build_the_torch_path_runs(fresh_load, monkeypatch, capsys):
    monkeypatch.setenv("BATCHLLM_CACHE", "/proc/no-such-cache")  # cannot be created
    _reload()
    assert all(load() is None for load in LOADERS)
    err = capsys.readouterr().err
    assert err.count("batchllm: the C kernels are not built or loaded: no cache folder") == 1
    assert cache().ops.pointwise is TORCH_OPS


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler here")
@pytest.mark.slow  # builds the C kernels afresh (a compiler run)
def test_without_torchs_openmp_the_kernels_build_on_one_thread_and_say_so(
        fresh_load, monkeypatch, capsys):
    monkeypatch.setattr(cpu_build, "_torch_omp", lambda: None)
    _reload()
    assert cpu_ops.load() is not None and cpu_decode.load() is not None
    err = capsys.readouterr().err
    assert err.count("without OpenMP and run on one thread") == 1, err
