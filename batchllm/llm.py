"""The Python API: `LLM(model, ...).generate(prompts, SamplingParams(...))`, as vLLM users know it.

Whatever the entry point (generate, chat, a job file), the whole list is planned at once with the
prefix tree and run by the same engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import numpy as np

from batchllm.engine.cpu_allocator import keep_freed_memory
from batchllm.engine.engine import Engine, EngineRequest, EngineStats, RowResult
from batchllm.engine.kv_budget import kv_budget_bytes, num_kv_pages
from batchllm.engine.sampler import row_key
from batchllm.engine.scheduler import KVCacheTooSmall
from batchllm.model.loader import load_model
from batchllm.plan.planner import make_plan
from batchllm.rows.prompts import render_chats, tokenize
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


@dataclass(frozen=True)
class RowInput:
    """A row ready for the engine: its token ids, sampling, and the id its generator is keyed by."""

    prompt_ids: np.ndarray | None  # [P] int32; None when the row failed before tokenization
    sampling: SamplingParams
    row_id: object
    error: str | None = None


class LLM:
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
    ) -> None:
        """kv_cache_memory: a fraction of free memory, or a size in bytes."""
        keep_freed_memory()  # before loading starts threads: they would take arenas of their own
        self.loaded = load_model(model, dtype, device, max_model_len)
        self.tokenizer = self.loaded.tokenizer
        self.max_model_len = self.loaded.max_model_len
        self.prefix_sharing = prefix_sharing
        self.order = order
        shape = self.loaded.model.shape
        bytes_per_token = shape.kv_bytes_per_token(self.loaded.model.dtype)
        budget = kv_budget_bytes(kv_cache_memory, self.loaded.device)
        self.engine = Engine(
            self.loaded, num_kv_pages(budget, bytes_per_token, page_size), page_size,
            max_num_seqs, max_batched_tokens, prefix_sharing, self.max_model_len,
        )
        self.last_metrics: dict = {}

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
        rows = [RowInput(t, s, i) for i, (t, s) in enumerate(zip(ids, sps))]
        outputs: list[RequestOutput | None] = [None] * len(rows)

        def keep(i: int, out: RequestOutput) -> None:
            outputs[i] = out

        self.run(rows, keep)
        return outputs

    def check_row(self, row: RowInput) -> str | None:
        """Why a row cannot run, in words a user can act on; None when it can."""
        if row.error:
            return row.error
        problem = row.sampling.problem()
        if problem:
            return problem
        n = len(row.prompt_ids)
        if n == 0:
            return "the prompt is empty (0 tokens)"
        if n >= self.max_model_len:
            return (f"the prompt has {n} tokens; the model allows {self.max_model_len} in all "
                    f"(prompt and completion): shorten it or raise model.max_model_len")
        return None

    def run(
        self,
        rows: list[RowInput],
        on_output: Callable[[int, RequestOutput], None],
        on_step: Callable[[EngineStats], None] | None = None,
        skip: Collection[int] = (),
    ) -> dict:
        """Plan and run rows; each result goes to on_output(row index, output) as it finishes.
        Rows in `skip` (done by an earlier, interrupted run) are planned with the others, so
        that the plan is the same, but not run. Returns the run's metrics (also kept in
        `last_metrics`)."""
        start = time.perf_counter()
        good: list[int] = []
        for i, row in enumerate(rows):
            problem = self.check_row(row)
            if not problem:
                good.append(i)
            elif i not in skip:
                on_output(i, RequestOutput(None, [], "error", _len(row), 0, problem))
        requests = [
            EngineRequest(k, rows[i].prompt_ids, rows[i].sampling,
                          row_key(rows[i].sampling.seed, rows[i].row_id))
            for k, i in enumerate(good)
        ]
        self._check_memory(requests)  # all rows: the result must not depend on what is skipped
        plan = make_plan(
            [r.prompt_ids for r in requests],
            np.asarray([r.sampling.max_tokens for r in requests], dtype=np.int32),
            prefix_sharing=self.prefix_sharing,
            order=self.order,
        )
        if skip:
            keep = np.asarray([i not in skip for i in good], dtype=bool)
            plan = plan.restricted_to(keep)
            requests_run = [r for r, k in zip(requests, keep) if k]
        else:
            requests_run = requests
        cached = 0

        def done(res: RowResult) -> None:
            nonlocal cached
            cached += res.cached_tokens
            on_output(good[res.row], RequestOutput(
                res.text, res.token_ids, res.finish_reason, res.prompt_tokens, res.cached_tokens))

        stats = self.engine.run(requests, plan, done, on_step)
        wall = time.perf_counter() - start
        prompt_tokens = int(sum(len(r.prompt_ids) for r in requests_run))
        self.last_metrics = {
            "rows": len(rows) - len(skip),
            "prompt_tokens": prompt_tokens,
            "prefill_tokens": stats.prefill_tokens,
            "tree_tokens": int(plan.stats()["tree_tokens"]),
            "cached_tokens": cached,
            "completion_tokens": stats.completion_tokens,
            "wall_seconds": wall,
            "output_tokens_per_s": stats.completion_tokens / wall if wall else 0.0,
            "total_tokens_per_s": (prompt_tokens + stats.completion_tokens) / wall if wall else 0.0,
            "kv_pages_total": stats.kv_pages_total,
            "kv_pages_peak": stats.kv_pages_peak,
            "kv_pages_shared_peak": stats.kv_pages_shared_peak,
            "kv_bytes_per_token": stats.kv_bytes_per_token,
            "page_size": self.engine.page_size,
            "preemptions": stats.preemptions,
            "steps": stats.steps,
            "device": str(self.loaded.device),
            "dtype": str(self.loaded.model.dtype).removeprefix("torch."),
            "model": self.loaded.name,
        }
        return self.last_metrics


    def _check_memory(self, requests: list[EngineRequest]) -> None:
        """Before the run: the largest request (prompt + max_tokens, up to the model's limit)
        must fit in the pool by itself, plus one page for a shared prefix's partial page."""
        if not requests:
            return
        ps = self.engine.page_size
        longest = max(min(len(r.prompt_ids) + r.sampling.max_tokens, self.max_model_len)
                      for r in requests)
        need = -(-longest // ps) + 1
        if need > self.engine.num_pages:
            raise KVCacheTooSmall(
                f"engine.kv_cache_memory: the KV cache holds {self.engine.num_pages} pages of "
                f"{ps} tokens ({self.engine.bytes_per_token} bytes per token); the longest "
                f"request ({longest} tokens) needs {need} pages, i.e. at least "
                f"{need * ps * self.engine.bytes_per_token} bytes"
            )


def _len(row: RowInput) -> int:
    return 0 if row.prompt_ids is None else len(row.prompt_ids)
