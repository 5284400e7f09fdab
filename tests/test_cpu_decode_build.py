"""Building the C decode kernel (kernels/cpu_decode.py): built once into $BATCHLLM_CACHE/kernels
and reused; without a compiler or with BATCHLLM_CPU_KERNEL=0 the engine's CPU path falls back to
the torch twin (its results are checked against SDPA in test_reference_attention.py)."""

from __future__ import annotations

import shutil

import pytest
import torch

from batchllm.model.attention import PagedAttention
from kernels import cpu_decode


@pytest.fixture
def fresh_load(monkeypatch, tmp_path):
    monkeypatch.setenv("BATCHLLM_CACHE", str(tmp_path))
    cpu_decode.load.cache_clear()
    yield tmp_path
    cpu_decode.load.cache_clear()


def cache() -> PagedAttention:
    """A 2-layer cache of 8 pages of 16 tokens, 9 query and 3 KV heads of 64."""
    return PagedAttention(2, 8, 16, 9, 3, 64, torch.float32, torch.device("cpu"))


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler here")
def test_built_once_into_the_cache_and_used(fresh_load):
    assert cpu_decode.load() is not None
    built = list((fresh_load / "kernels").glob("cpu_decode-*.so"))
    assert len(built) == 1
    cpu_decode.load.cache_clear()
    stamp = built[0].stat().st_mtime_ns
    assert cpu_decode.load() is not None and built[0].stat().st_mtime_ns == stamp  # reused
    attention = cache()
    assert attention.ops.paged_attention is cpu_decode.paged_attention_cpu
    assert not attention.ops.gathers_decodes


def test_without_a_compiler_the_twin_decodes(fresh_load, monkeypatch, capsys):
    monkeypatch.setenv("CC", "no-such-compiler-here")
    assert cpu_decode.load() is None
    assert "could not be built" in capsys.readouterr().err
    attention = cache()
    assert attention.ops.gathers_decodes and attention.ops.paged_attention.__name__ == (
        "paged_attention_ref")


def test_switched_off(fresh_load, monkeypatch):
    monkeypatch.setenv("BATCHLLM_CPU_KERNEL", "0")
    assert cpu_decode.load() is None and cache().ops.gathers_decodes
