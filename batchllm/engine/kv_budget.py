"""How many KV pages fit in the memory budget."""

from __future__ import annotations

import gc

import torch

CPU_DEFAULT_CAP = 8 << 30  # a fraction on the CPU applies to available RAM, up to this much


def _available_ram() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("MemAvailable not found in /proc/meminfo")


def kv_budget_bytes(kv_cache_memory: float, device: torch.device) -> int:
    """A float in (0, 1] is a fraction of free accelerator memory once the model is loaded and
    the allocator's cache emptied (of available RAM on the CPU, capped at 8 GiB); an int is a
    size in bytes."""
    if isinstance(kv_cache_memory, int) and not isinstance(kv_cache_memory, bool):
        return kv_cache_memory
    if device.type == "cuda":
        # What loading left behind (the unfused q/k/v and gate/up weights, copies on the way to
        # the device) back to the driver first: free memory then is what the pool can have.
        gc.collect()
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * kv_cache_memory)
    return min(int(_available_ram() * kv_cache_memory), CPU_DEFAULT_CAP)


def num_kv_pages(budget_bytes: int, bytes_per_token: int, page_size: int) -> int:
    """Pages of page_size tokens, each token costing 2*L*H*A*bytes."""
    return budget_bytes // (bytes_per_token * page_size)
