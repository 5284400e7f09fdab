"""The memory a step needs beyond the weights, measured before the KV pool takes the rest.

As nano-vllm's warmup_model then allocate_kv_cache: run one forward at the largest step the
engine will run (max_batched_tokens tokens, the largest graph bucket), take the allocator's
peak, and size the pool from what remains (engine/kv_budget.kv_budget_bytes's `reserved`).
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch


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
