"""The Python API: `LLM(model, ...).generate(prompts, SamplingParams(...))`, as vLLM users know it.

Whatever the entry point (generate, chat, a job file), the whole list is planned at once with the
prefix tree and run by the same runtime (batchllm/engine/runtime.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from batchllm.engine.runtime import Runtime
from batchllm.rows.prompts import render_chats, tokenize
from batchllm.rows.record import Row
from batchllm.sampling_params import SamplingParams


@dataclass
class RequestOutput:
    """One prompt's result. finish_reason: stop, length or error (then `error` says why)."""

    text: str | None
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    error: str | None = None

    @classmethod
    def of(cls, row: Row) -> RequestOutput:
        return cls(row.completion, row.token_ids, row.finish_reason, row.prompt_tokens,
                   row.cached_tokens, row.error)


class LLM:
    """The engine without a job file: a model loaded once, any number of generate calls."""

    def __init__(
        self,
        model: str = "smollm2-135m-instruct",
        *,
        dtype: str = "auto",
        device: str = "auto",
        max_model_len: int | None = None,
        page_size: int = 16,
        kv_cache_memory: float = 0.9,
        max_num_seqs: int = 256,
        max_batched_tokens: int = 8192,
        prefix_sharing: bool = True,
        order: str = "prefix-tree",
        cuda_graphs: bool = True,
    ) -> None:
        """kv_cache_memory: a fraction of free memory, or a size in bytes; cuda_graphs: decode
        steps as CUDA graphs (on CUDA)."""
        self.runtime = Runtime.build(
            model, dtype=dtype, device=device, max_model_len=max_model_len,
            page_size=page_size, kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs,
            max_batched_tokens=max_batched_tokens, prefix_sharing=prefix_sharing, order=order,
            cuda_graphs=cuda_graphs)
        self.tokenizer = self.runtime.tokenizer
        self.max_model_len = self.runtime.max_model_len
        self.last_metrics: dict = {}  # the metrics of the last generate or chat call

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Prompts as they are (text, tokenized with the tokenizer's special tokens, or token id
        lists), no chat template. Returns one output per prompt, in input order."""
        if isinstance(prompts, str):
            prompts = [prompts]
        texts = [i for i, p in enumerate(prompts) if isinstance(p, str)]
        ids: list = [None if isinstance(p, str) else np.asarray(p, np.int32) for p in prompts]
        for i, toks in zip(texts, tokenize(self.tokenizer, [prompts[i] for i in texts], True)):
            ids[i] = toks
        return self._generate(ids, sampling_params)

    def chat(
        self,
        conversations: Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Conversations (lists of {role, content}) through the model's chat template."""
        texts = render_chats(self.tokenizer, conversations)
        return self._generate(tokenize(self.tokenizer, texts, False), sampling_params)

    def _generate(self, ids: list[np.ndarray], sampling_params) -> list[RequestOutput]:
        sp = sampling_params or SamplingParams()
        sps = [sp] * len(ids) if isinstance(sp, SamplingParams) else list(sp)
        rows = [Row(i, i, t, s) for i, (t, s) in enumerate(zip(ids, sps))]
        self.last_metrics = self.runtime.run(rows, lambda row: None).to_dict()
        return [RequestOutput.of(r) for r in rows]
