"""The Python API: `LLM(model, ...).generate(prompts, SamplingParams(...))`, as vLLM users know it.

Whatever the entry point (generate, chat, a job file), the whole list is planned at once with the
prefix tree and run by the same runtime (batchllm/engine/runtime.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from batchllm.config import InputConfig, SamplingConfig
from batchllm.engine.runtime import EngineSettings, Runtime
from batchllm.rows.build import build_rows
from batchllm.rows.prompts import render_chats, tokenize
from batchllm.rows.reader import InputRows
from batchllm.rows.record import Row, TokenLogprob
from batchllm.rows.samples import SAMPLE_FIELDS, extra_fields
from batchllm.rows.writer import output_schema, part_row
from batchllm.sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    """One sample of a prompt (vLLM's CompletionOutput). index: the sample, 0..n-1;
    logprobs: per generated token (token_id, logprob, top), when SamplingParams.logprobs > 0."""

    index: int
    text: str | None
    token_ids: list[int]
    finish_reason: str
    cached_tokens: int
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None

    @classmethod
    def of(cls, row: Row) -> CompletionOutput:
        return cls(row.sample, row.completion, row.token_ids, row.finish_reason,
                   row.cached_tokens, row.error, row.logprobs)


@dataclass
class RequestOutput:
    """One prompt's result. finish_reason: stop, length or error (then `error` says why).

    The fields are the first sample's; `outputs` holds all SamplingParams.n samples in order
    (outputs[0] is the first), as vLLM's RequestOutput.outputs does."""

    text: str | None
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)

    @classmethod
    def of(cls, samples: list[Row]) -> RequestOutput:
        """The output of one prompt from its sample records, in sample order."""
        first = samples[0]
        return cls(first.completion, first.token_ids, first.finish_reason, first.prompt_tokens,
                   first.cached_tokens, first.error, first.logprobs,
                   [CompletionOutput.of(r) for r in samples])


class LLM:
    """The engine without a job file: a model loaded once, any number of generate calls."""

    def __init__(self, model: str = "smollm2-135m-instruct", **settings) -> None:
        """model: a built-in alias or a Hugging Face folder. settings: the fields of
        batchllm.engine.runtime.EngineSettings as keywords: dtype, device, max_model_len,
        page_size, kv_cache_memory (a fraction of free memory, or a size in bytes),
        max_num_seqs, max_batched_tokens, prefix_sharing, order, cuda_graphs."""
        self.runtime = Runtime.build(model, EngineSettings(**settings))
        self.tokenizer = self.runtime.tokenizer
        self.max_model_len = self.runtime.max_model_len
        self.last_metrics: dict = {}  # the metrics of the last generate or chat call

    def generate(
        self,
        prompts: str | dict | Sequence[str | dict | Sequence[int] | None],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Prompts as they are, no chat template: text (tokenized with the tokenizer's special
        tokens), token id lists, or vLLM's prompt dicts ({"prompt": text} or
        {"prompt_token_ids": ids}). Returns one output per prompt, in input order; a prompt that
        cannot run (None, ids outside the model's vocabulary) is an error output, as an empty
        one is."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = [_unwrapped(p) for p in prompts]
        texts = [i for i, p in enumerate(prompts) if isinstance(p, str)]
        vocab = self.runtime.loaded.model.shape.vocab_size
        ids: list = [None] * len(prompts)
        errors: dict[int, str] = {}
        for i, p in enumerate(prompts):
            if not isinstance(p, str):
                ids[i], why = _token_ids(p, vocab)
                if why:
                    errors[i] = why
        for i, toks in zip(texts, tokenize(self.tokenizer, [prompts[i] for i in texts], True)):
            ids[i] = toks
        return self._generate(ids, sampling_params, errors)

    def chat(
        self,
        conversations: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Conversations (lists of {role, content}) through the model's chat template; one
        conversation alone is taken too (one output), as vLLM's LLM.chat takes it."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        texts = render_chats(self.tokenizer, conversations)
        return self._generate(tokenize(self.tokenizer, texts, False), sampling_params)

    def generate_frame(
        self,
        df,
        *,
        prompt: str | None = None,
        messages: str | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat_template: bool = False,
        system_prompt: str | None = None,
    ):
        """A polars DataFrame in, the same frame out with the output columns added (completion,
        finish_reason, prompt_tokens, completion_tokens, cached_tokens, error: as in a job's
        output file), row for row; with SamplingParams.n > 1 each row once per sample, with a
        `sample` column, and with logprobs > 0 a `logprobs` column (as in a job's output).

        prompt="column": text prompts as `generate` takes them (chat_template=True: each one
        user message through the model's template, as a job's prompt_column). messages="column":
        conversations (lists of {role, content}) as `chat` takes them. A null or empty cell
        becomes an error row, as in a job; the other rows run."""
        import polars as pl

        if (prompt is None) == (messages is None):
            raise ValueError("generate_frame: give one of prompt= or messages=")
        column = prompt or messages
        if column not in df.columns:
            raise ValueError(f"generate_frame: no column {column!r}; columns are: "
                             f"{', '.join(df.columns)}")
        schema = output_schema(pa.int64())
        clash = [f.name for f in schema if f.name != "id" and f.name in df.columns]
        if clash:
            raise ValueError(f"generate_frame: the frame has output column(s) already: "
                             f"{', '.join(clash)}")
        values = df.get_column(column).to_list()
        cfg = InputConfig(path="<frame>", prompt_column=prompt or "prompt",
                          messages_column=messages, system_prompt=system_prompt,
                          chat_template=chat_template or messages is not None)
        source = InputRows(ids=pa.array(range(len(values)), pa.int64()),
                           prompts=values if prompt else None,
                           messages=values if messages else None, overrides={},
                           num_rows=len(values))
        # the job's defaults are replaced row by row with the sampling given here
        rows = build_rows(self.tokenizer, cfg, SamplingConfig(max_tokens=1), source)
        sps = self._sampling(sampling_params, len(rows))
        for row, sp in zip(rows, sps):
            row.sampling = sp
        added_too = [name for name, on in (("sample", any(r.num_samples > 1 for r in rows)),
                                           ("logprobs", any(r.wants_logprobs for r in rows)))
                     if on and name in df.columns]  # before the model runs, not after
        if added_too:
            raise ValueError(f"generate_frame: the frame has output column(s) already: "
                             f"{', '.join(added_too)}")
        records = [r for got in self._run(rows) for r in got]
        lines = [part_row(r) for r in records]
        fields = [f for f in [*schema, *SAMPLE_FIELDS] if f.name != "id"]
        added = pa.table({f.name: pa.array([x[f.name] for x in lines], f.type) for f in fields})
        keep = [f.name for f in schema if f.name != "id"] + [f.name for f in extra_fields(added)]
        if len(records) != len(rows):  # n > 1: each input row repeated once per sample
            df = df.select(pl.all().gather([r.index for r in records]))
        return df.hstack(pl.from_arrow(added.select(keep)).get_columns())

    @staticmethod
    def _sampling(sampling_params, n: int) -> list[SamplingParams]:
        """One SamplingParams per prompt: the one given for all, or a list of exactly n."""
        sp = sampling_params or SamplingParams()
        if isinstance(sp, SamplingParams):
            return [sp] * n
        sps = list(sp)
        if len(sps) != n:
            raise ValueError(f"{len(sps)} sampling params for {n} prompts: give one for all, "
                             f"or one per prompt")
        return sps

    def _generate(self, ids: list[np.ndarray | None], sampling_params,
                  errors: dict[int, str] | None = None) -> list[RequestOutput]:
        """errors: the prompts (by position) that cannot run, and why."""
        sps = self._sampling(sampling_params, len(ids))
        errors = errors or {}
        rows = [Row(i, i, t, s, error=errors.get(i)) for i, (t, s) in enumerate(zip(ids, sps))]
        return [RequestOutput.of(got) for got in self._run(rows)]

    def _run(self, rows: list[Row]) -> list[list[Row]]:
        """Run rows (row i has index i); per row its sample records, in sample order. Every
        record, the ones Runtime.run_rows makes for samples 1..n-1 included, comes back via
        on_row."""
        got: list[list[Row]] = [[] for _ in rows]
        self.last_metrics = self.runtime.run_rows(rows, lambda r: got[r.index].append(r)).to_dict()
        return [sorted(g, key=lambda r: r.sample) for g in got]


def _unwrapped(prompt: object) -> object:
    """vLLM's prompt dicts as the prompt they hold: {"prompt": text}, {"prompt_token_ids": ids}
    (a dict with neither is left as it is, and fails as a prompt)."""
    if isinstance(prompt, dict):
        for key in ("prompt_token_ids", "prompt"):
            if key in prompt:
                return prompt[key]
    return prompt


def _token_ids(prompt: object, vocab: int) -> tuple[np.ndarray | None, str | None]:
    """A prompt given as token ids: ([P] int32, None), or (None, why it cannot run)."""
    if prompt is None:
        return None, "the prompt is None"
    try:
        ids = np.asarray(prompt)
    except (TypeError, ValueError) as e:
        return None, f"the prompt is neither text nor a list of token ids: {e}"
    if ids.ndim != 1 or not (ids.size == 0 or np.issubdtype(ids.dtype, np.integer)):
        return None, (f"the prompt is neither text nor a list of token ids "
                      f"({type(prompt).__name__} of {ids.dtype} {tuple(ids.shape)})")
    outside = ids[(ids < 0) | (ids >= vocab)]
    if len(outside):
        return None, (f"the prompt's token id {int(outside[0])} is outside the model's "
                      f"vocabulary (0..{vocab - 1})")
    return ids.astype(np.int32), None
