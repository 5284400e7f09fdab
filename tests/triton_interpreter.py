"""Triton's kernels for the tests: compiled on CUDA, else in Triton's interpreter on CPU
tensors (TRITON_INTERPRET=1, set here before triton is imported)."""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from batchllm_kernels.triton import _interpret_triton_library  # after TRITON_INTERPRET is set

_loaded: dict[str, object] = {}


def load(name: str):
    """The launcher module, re-executed once if it was imported before the interpreter was on
    (its @triton.jit functions are made at import)."""
    if name not in _loaded:
        if not CUDA and name in sys.modules:
            _loaded[name] = importlib.reload(sys.modules[name])
        else:
            _loaded[name] = importlib.import_module(name)
    return _loaded[name]


if not CUDA:
    _interpret_triton_library()
load("batchllm_kernels.triton.tiles")  # first: the jitted pieces the other kernels import
