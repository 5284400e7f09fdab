"""How many KV pages fit in the memory budget."""

from __future__ import annotations

import gc
import os

import torch

CPU_DEFAULT_CAP = 8 << 30  # a fraction on the CPU applies to available RAM, up to this much


def available_ram(sysconf=os.sysconf, names=os.sysconf_names) -> int:
    """Bytes of RAM available now, from a portable source: psutil where installed, else
    os.sysconf's available pages (Linux, the BSDs), else its physical pages (macOS has no
    SC_AVPHYS_PAGES: all of RAM, which the CPU cap then bounds)."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        return int(psutil.virtual_memory().available)
    pages = "SC_AVPHYS_PAGES" if "SC_AVPHYS_PAGES" in names else "SC_PHYS_PAGES"
    return int(sysconf(pages)) * int(sysconf("SC_PAGE_SIZE"))


def kv_budget_bytes(kv_cache_memory: float, device: torch.device, reserved: int = 0) -> int:
    """A float in (0, 1] is a fraction of free accelerator memory once the model is loaded, the
    allocator's cache emptied and `reserved` bytes (a step's measured peak, engine/warmup.py)
    set aside (of available RAM on the CPU, capped at 8 GiB); an int is a size in bytes."""
    if isinstance(kv_cache_memory, int) and not isinstance(kv_cache_memory, bool):
        return kv_cache_memory
    if device.type == "cuda":
        # What loading left behind (the unfused q/k/v and gate/up weights, copies on the way to
        # the device) back to the driver first: free memory then is what the pool can have.
        gc.collect()
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(device)
        return int(max(0, free - reserved) * kv_cache_memory)
    return min(int(max(0, available_ram() - reserved) * kv_cache_memory), CPU_DEFAULT_CAP)


def num_kv_pages(budget_bytes: int, bytes_per_token: int, page_size: int) -> int:
    """Pages of page_size tokens, each token costing 2*L*H*A*bytes."""
    return budget_bytes // (bytes_per_token * page_size)
