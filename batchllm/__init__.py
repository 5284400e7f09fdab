"""batchllm: offline batch LLM inference with a global prefix tree over a paged KV cache."""

from __future__ import annotations

__all__ = ["LLM", "RequestOutput", "SamplingParams", "run_job"]


def __getattr__(name: str):
    # Lazy, so that the torch-free parts (config, plan) import without loading torch.
    if name == "run_job":
        from batchllm.job import run_job

        return run_job
    if name in ("LLM", "RequestOutput"):
        from batchllm import llm

        return getattr(llm, name)
    if name == "SamplingParams":
        from batchllm.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'batchllm' has no attribute {name!r}")
