"""Shared fixtures: the real SmolLM2 folder and tiny random HF model folders (see hf_reference.py).

Tests import the helpers directly: `from hf_reference import hf_greedy_reference, ...`
(pytest puts this folder on sys.path).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

# Without CUDA the Triton kernels run under the interpreter; set before anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import triton_rounding  # noqa: F401 - under the interpreter, bfloat16 rounded as on a GPU
from hf_reference import TINY_KINDS, tiny_model_folder
from hf_reference import smollm2_folder as _smollm2_folder


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray instance for a test module (tests/test_scale.py, test_scale_tp.py): 4
    logical CPUs (2 cores here) for two workers of half-CPU actors or ranks and Ray's own
    tasks; authentication off, as for any local test instance."""
    ray = pytest.importorskip("ray")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_AUTH_MODE", "disabled")
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
        yield
        ray.shutdown()


@pytest.fixture(scope="session")
def smollm2_folder() -> Path:
    """resolve_model("smollm2-135m-instruct"): converted once from the GGUF, then cached."""
    return _smollm2_folder()


@pytest.fixture(scope="session")
def tiny_llama() -> Path:
    """Tiny random Llama (GQA, tied embeddings) with SmolLM2's tokenizer."""
    return tiny_model_folder("llama")


@pytest.fixture(scope="session")
def tiny_qwen2() -> Path:
    """Tiny random Qwen2 (q/k/v biases, separate lm_head) with SmolLM2's tokenizer."""
    return tiny_model_folder("qwen2")


@pytest.fixture(scope="session")
def tiny_mistral() -> Path:
    """Tiny random Mistral-style model (MQA, head_dim 32 != hidden/heads) with SmolLM2's tokenizer."""
    return tiny_model_folder("mistral")


@pytest.fixture(scope="session", params=TINY_KINDS)
def tiny_model(request: pytest.FixtureRequest) -> Path:
    """Each tiny model folder in turn (parametrized: llama, qwen2, mistral)."""
    return tiny_model_folder(request.param)
