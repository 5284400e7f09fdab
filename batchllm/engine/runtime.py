"""The engine a job runs on: the model loaded once, the KV pool sized, the job's engine settings;
`run_rows(rows)` admits, plans and runs a list of rows and returns the run's metrics.

This is what jobs, Ray workers and the Python API (batchllm.LLM) all call, so that a row is
admitted, planned and run the same way whatever the entry point.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import numpy as np

from batchllm.config import JobConfig
from batchllm.engine import tensor_parallel
from batchllm.engine.cpu_allocator import keep_freed_memory
from batchllm.engine.engine import Engine
from batchllm.engine.kv_budget import kv_budget_bytes, num_kv_pages
from batchllm.engine.metrics import EngineStats, RunMetrics
from batchllm.engine.scheduler import KVCacheTooSmall
from batchllm.engine.warmup import measured_peak_bytes, warm_up_step
from batchllm.model.attention import kv_cache_dtype
from batchllm.model.loader import LoadedModel, load_model
from batchllm.plan.rows_plan import plan_rows
from batchllm.rows.record import Row
from batchllm.rows.table import RowTable


@dataclass(frozen=True)
class EngineSettings:
    """How a model is loaded and run, as the job file's model, engine and planner sections say
    (DESIGN.md); the keyword arguments of batchllm.LLM."""

    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    page_size: int = 16
    kv_cache_memory: float | int = 0.9  # a fraction (float) of free memory, or bytes (int)
    max_num_seqs: int = 256
    max_batched_tokens: int = 8192
    prefix_sharing: bool = True
    order: str = "prefix-tree"
    cuda_graphs: bool = True  # decode steps replayed as CUDA graphs (on CUDA only)
    revision: str | None = None  # hub ids: a branch, tag or commit
    quantization: str | None = None  # None (as the checkpoint is) | "fp8"
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype) | "fp8"
    tensor_parallel: int = 1
    overlap: str | bool = "auto"  # "auto" (on for CUDA) | True | False

    @classmethod
    def of(cls, cfg: JobConfig) -> EngineSettings:
        m, e = cfg.model, cfg.engine
        return cls(dtype=m.dtype, device=m.device, max_model_len=m.max_model_len,
                   page_size=e.page_size, kv_cache_memory=e.kv_cache_memory,
                   max_num_seqs=e.max_num_seqs, max_batched_tokens=e.max_batched_tokens,
                   prefix_sharing=e.prefix_sharing, order=cfg.planner.order,
                   cuda_graphs=e.cuda_graphs, revision=m.revision, quantization=m.quantization,
                   kv_cache_dtype=e.kv_cache_dtype, tensor_parallel=e.tensor_parallel,
                   overlap=e.overlap)


class Runtime:
    """A loaded model, its engine and the settings every run of it uses."""

    def __init__(self, loaded: LoadedModel, engine: Engine, settings: EngineSettings) -> None:
        self.loaded = loaded
        self.engine = engine
        self.settings = settings

    @classmethod
    def build(cls, model: str, settings: EngineSettings) -> Runtime:
        """Load `model` (a built-in alias or a Hugging Face folder) and size its KV pool."""
        s = settings
        keep_freed_memory()  # before loading starts threads: they would take arenas of their own
        group = None
        if s.tensor_parallel > 1:  # rank 0's shard here, the other ranks spawned
            loaded, group = tensor_parallel.start(model, s.tensor_parallel, {
                "dtype": s.dtype, "device": s.device, "max_model_len": s.max_model_len,
                "revision": s.revision, "quantization": s.quantization})
        else:
            loaded = load_model(model, s.dtype, s.device, s.max_model_len, s.revision,
                                s.quantization)
        kv_dtype = kv_cache_dtype(s.kv_cache_dtype, loaded.model.dtype)
        bytes_per_token = loaded.model.shape.kv_bytes_per_token(kv_dtype)  # a rank's heads
        reserved = 0  # a step's measured peak, on CUDA before the pool takes the rest
        if loaded.device.type == "cuda" and group is None and isinstance(s.kv_cache_memory,
                                                                          float):
            tokens = min(s.max_batched_tokens, loaded.max_model_len - 1)
            reserved = measured_peak_bytes(
                lambda: warm_up_step(loaded, tokens, s.page_size, s.kv_cache_dtype), loaded.device)
        budget = kv_budget_bytes(s.kv_cache_memory, loaded.device, reserved)
        pages = num_kv_pages(budget, bytes_per_token, s.page_size)
        overlap = loaded.device.type == "cuda" if s.overlap == "auto" else bool(s.overlap)
        engine = Engine(loaded, pages, s.page_size, s.max_num_seqs, s.max_batched_tokens,
                        s.prefix_sharing, loaded.max_model_len,
                        s.cuda_graphs and group is None, s.kv_cache_dtype, overlap)
        if group is not None:
            tensor_parallel.share_pool(group, pages, s.page_size, s.kv_cache_dtype)
            group.watch(engine.attention)
        return cls(loaded, engine, s)

    @classmethod
    def from_config(cls, cfg: JobConfig) -> Runtime:
        """The runtime of a job file: its model and its engine and planner settings."""
        return cls.build(cfg.model.path, EngineSettings.of(cfg))

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.loaded.max_model_len

    def run_rows(
        self,
        rows: RowTable | Sequence[Row],
        on_row: Callable[[Row], None],
        on_step: Callable[[EngineStats], None] | None = None,
        skip: Collection[int | tuple[int, int]] = (),
    ) -> RunMetrics:
        """Admit, plan and run `rows` (a RowTable, rows/table.py, or Rows, packed into one); each
        row goes to on_row once it has its result (rows that cannot run at once, with their
        error), a Row made for it then (RowTable[k]). A row with sampling.n > 1 runs as n
        records, one per sample (Row.samples: the same prompt n times, which the plan makes one
        prefix node with n children), each handed to on_row. Records listed in `skip` (done by an earlier,
        interrupted run: a row index for all its samples, or (index, sample)) are planned with
        the others, so that the plan is the same, but neither run nor handed out."""
        start = time.perf_counter()
        skip = skip if isinstance(skip, (set, frozenset)) else set(skip)
        records = (rows if isinstance(rows, RowTable) else RowTable.of(rows)).with_samples()
        self._check_grammars(records)
        planned = plan_rows(records, self.max_model_len, self.settings.prefix_sharing,
                            self.settings.order)
        for row in planned.failed:
            if not row.listed_in(skip):
                on_row(row)
        self._check_memory(planned.rows)  # all rows: the result must not depend on the skipped
        todo = planned.restricted_to(skip)
        planned_at = time.perf_counter()
        ran = _Ran(on_row)
        stats = self.engine.generate(todo.rows, todo.plan, ran, on_step)
        end = time.perf_counter()
        wall = end - start
        model = self.loaded
        return RunMetrics(
            rows=int(len(records) - records.listed(skip).sum()),
            prompt_tokens=ran.prompt_tokens,
            prefill_tokens=stats.prefill_tokens,
            tree_tokens=todo.plan.tree_tokens,
            cached_tokens=ran.cached_tokens,
            completion_tokens=stats.completion_tokens,
            wall_seconds=wall,
            kv_pages_total=stats.kv_pages_total,
            kv_pages_peak=stats.kv_pages_peak,
            kv_pages_shared_peak=stats.kv_pages_shared_peak,
            kv_bytes_per_token=stats.kv_bytes_per_token,
            page_size=self.engine.page_size,
            preemptions=stats.preemptions,
            prefix_evictions=stats.prefix_evictions,
            steps=stats.steps,
            steps_replayed=stats.steps_replayed,
            steps_overlapped=stats.steps_overlapped,
            step_host_seconds=stats.step_host_seconds,
            plan_seconds=planned_at - start,
            run_seconds=end - planned_at,
            device=str(model.device),
            dtype=str(model.model.dtype).removeprefix("torch."),
            model=model.name,
            kernel_path=model.model.kernel_path,
        )

    def _check_grammars(self, rows: RowTable) -> None:
        """Rows whose structured output does not compile become error rows with the compiler's
        message (each distinct spec compiled once); the others run."""
        grammars = self.engine.grammars
        bad = {}
        for k, sp in enumerate(rows.settings):
            if sp.constraint is not None and sp.problem() is None:
                why = grammars.problem(sp)
                if why is not None:
                    bad[k] = why
        for k in np.isin(rows.setting, list(bad)).nonzero()[0].tolist():
            rows.errors.setdefault(k, bad[int(rows.setting[k])])

    def _check_memory(self, rows: RowTable) -> None:
        """Before the run: the largest request (prompt + max_tokens, up to the model's limit)
        must fit in the pool by itself, plus one page for a shared prefix's partial page."""
        if not len(rows):
            return
        ps, engine = self.engine.page_size, self.engine
        longest = int(np.minimum(rows.prompt_tokens() + rows.max_tokens(),
                                 self.max_model_len).max())
        need = -(-longest // ps) + 1
        if need > engine.num_pages:
            raise KVCacheTooSmall(
                f"engine.kv_cache_memory: the KV cache holds {engine.num_pages} pages of "
                f"{ps} tokens ({engine.bytes_per_token} bytes per token); the longest "
                f"request ({longest} tokens) needs {need} pages, i.e. at least "
                f"{need * ps * engine.bytes_per_token} bytes"
            )


class _Ran:
    """on_row for the rows the engine runs, counting their prompt and cached tokens."""

    def __init__(self, on_row: Callable[[Row], None]) -> None:
        self.on_row = on_row
        self.prompt_tokens = self.cached_tokens = 0

    def __call__(self, row: Row) -> None:
        self.prompt_tokens += row.prompt_tokens
        self.cached_tokens += row.cached_tokens
        self.on_row(row)
