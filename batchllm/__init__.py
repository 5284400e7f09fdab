"""batchllm: offline batch LLM inference with a global prefix tree over a paged KV cache."""

from batchllm.job import run_job
from batchllm.llm import LLM, RequestOutput
from batchllm.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams", "run_job"]
