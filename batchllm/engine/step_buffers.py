"""A step's index arrays on the device, at fixed addresses, filled by one pinned, non-blocking
host-to-device copy per dtype.

Fields are named regions of one int64 and one int32 device buffer, sized once for the largest
step. Each step the host writes the leading values of the fields it uses into a pinned staging
buffer (from torch's caching host allocator, which does not hand a block out again until its
copy has run) and copies it over in one go; no step waits for its copy. The device side never
moves, which is what CUDA graphs captured over these buffers need (cuda_graphs.py).
"""

from __future__ import annotations

import numpy as np
import torch


class StepBuffers:
    def __init__(self, fields: dict[str, tuple[torch.dtype, int]],
                 device: torch.device) -> None:
        """fields: name -> (torch.int64 or torch.int32, capacity)."""
        self._layout: dict[str, tuple[torch.dtype, int, int]] = {}  # name -> (dtype, start, cap)
        sizes = {torch.int64: 0, torch.int32: 0}
        for name, (dtype, cap) in fields.items():
            self._layout[name] = (dtype, sizes[dtype], cap)
            sizes[dtype] += cap
        self.device = device
        self._pinned = device.type == "cuda"
        self._sizes = sizes
        self._device = {dt: torch.zeros(n, dtype=dt, device=device) for dt, n in sizes.items()}
        self.dev = {name: self._device[dt][start : start + cap]
                    for name, (dt, start, cap) in self._layout.items()}

    def capacity(self, name: str) -> int:
        return self._layout[name][2]

    def stage(self, values: dict[str, np.ndarray | list[int]]) -> None:
        """Write each field's leading values and copy them to the device, one non-blocking copy
        per dtype. Only the values written this step are defined on the device: the copy spans
        the fields in between too, with whatever the staging block held."""
        used = {dt: 0 for dt in self._sizes}
        for name, vals in values.items():
            dt, start, _ = self._layout[name]
            used[dt] = max(used[dt], start + len(vals))
        for dt, end in used.items():
            if not end:
                continue
            host = torch.empty(end, dtype=dt, pin_memory=self._pinned)
            flat = host.numpy()
            for name, vals in values.items():
                fdt, start, cap = self._layout[name]
                if fdt is dt:
                    if len(vals) > cap:
                        raise ValueError(f"StepBuffers: {len(vals)} values for {name}, room "
                                         f"for {cap}")
                    flat[start : start + len(vals)] = vals
            self._device[dt][:end].copy_(host, non_blocking=self._pinned)
