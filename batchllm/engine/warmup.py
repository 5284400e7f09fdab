"""The memory a step needs beyond the weights, measured before the KV pool takes the rest.

As nano-vllm's warmup_model then allocate_kv_cache: run one forward at the largest step the
engine will run (max_batched_tokens tokens, the largest graph bucket), take the allocator's
peak, and size the pool from what remains (engine/kv_budget.kv_budget_bytes's `reserved`).
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import numpy as np
import torch

from batchllm.engine.engine import Engine
from batchllm.engine.metrics import EngineStats
from batchllm.model.loader import LoadedModel
from batchllm.plan.rows_plan import plan_rows
from batchllm.rows.record import Row
from batchllm.sampling_params import SamplingParams


def measured_peak_bytes(forward: Callable[[], object], device: torch.device) -> int:
    """Run `forward` once (untimed; its result dropped) and return the bytes it held at its
    peak above what was allocated before it: activations, logits, sampler buffers. On CUDA
    from the caching allocator's peak statistics; on the CPU 0 (no allocator statistics: the
    CPU budget is a capped fraction of available RAM instead)."""
    if device.type != "cuda":
        forward()
        return 0
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    forward()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    gc.collect()
    torch.cuda.empty_cache()
    return max(0, int(peak))


def warm_up_step(loaded: LoadedModel, tokens: int, page_size: int,
                 kv_cache_dtype: str = "auto") -> EngineStats:
    """One step of `tokens` prefill tokens (one row of that many token ids, max_tokens 1) on a
    throwaway engine whose pool holds just that row; returns its stats (one step, `tokens`
    prefill tokens).
    The largest step a run takes is max_batched_tokens tokens of prefill (decode steps carry at
    most max_num_seqs rows, fewer); graphs are captured later, from the pool's side of memory."""
    pages = -(-(tokens + 1) // page_size) + 1
    engine = Engine(loaded, pages, page_size, 1, tokens, False, loaded.max_model_len, False,
                    kv_cache_dtype)
    row = Row(0, 0, np.zeros(tokens, dtype=np.int32),
              SamplingParams(max_tokens=1, ignore_eos=True))
    planned = plan_rows([row], loaded.max_model_len, False, "input")
    return engine.generate(planned.rows, planned.plan, lambda _row: None)
