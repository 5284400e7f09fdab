"""A checkpoint's tensors streamed from its safetensors files: each read when asked for, from a
mapping of its file made for it alone, cast to the run's dtype and placed on the run's device,
so that a load holds one tensor beyond what the model keeps.

Why one mapping a tensor: a safetensors file is memory-mapped whole, and the pages a read
touches stay in the process's resident set while any tensor of that mapping lives (measured:
a 300 MB file read through one safe_open whose first tensor the model keeps: 300 MB more RSS
after the load than the model's own bytes). A tensor opened on its own takes its mapping with it
when the layer that packed it lets it go. Where neither dtype nor device changes (float32 on
the CPU) the tensor is the mapped file itself, read only when a layer reads it: a model whose
projections come from its panel file (panel_cache.py) never reads their pages.

On the CPU the load's copies (a cast, the packing's temporaries) are freed as each layer is
built, and glibc keeps their pages as holes between the packed weights (never trimmed under
engine/cpu_allocator.py's thresholds): ~140 MB of a 1 GB model's load here. Every TRIM_BYTES
placed, and once the load is done (loader.py), malloc_trim hands them back (~1-7 ms a call).

`read(name, part=...)` reads one of `count` equal slices along a dimension (safe_open's
get_slice): what a tensor-parallel rank will read of its share.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Iterator, MutableMapping
from pathlib import Path

import torch
from safetensors import safe_open

from batchllm.model.errors import ModelNotFoundError
from batchllm.model.fp8_checkpoint import keeps_dtype
from batchllm.model.hf_cache import load_config
from batchllm.model.shards import tensor_files

Part = tuple[int, int, int]  # (dim, index, count): slice `index` of `count` equal ones along dim
TRIM_BYTES = 32 << 20  # the most the freed holes grow to between two trims (plus one layer)


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None (another C library, another OS)."""
    if not sys.platform.startswith("linux"):
        return None
    return getattr(ctypes.CDLL(None), "malloc_trim", None)


def give_back_freed_heap() -> None:
    """The pages of freed memory inside the C heap, back to the OS (glibc's malloc_trim)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


class Checkpoint(MutableMapping[str, object]):
    """The tensors of a model folder by their Hugging Face names; `checkpoint[name]` reads one.

    Floating tensors come in `dtype`, all on `device`. Left out: buffers old checkpoints saved
    (rotary_emb.inv_freq, recomputed from the config) and `lm_head.weight` where the config
    ties it to the embedding (as transformers does). An entry may be replaced (an FP8 weight by
    its record: fp8_checkpoint.py) or taken out (its scales): the file is then not read for it."""

    def __init__(self, folder: Path, dtype: torch.dtype, device: torch.device | str,
                 tied: bool = False) -> None:
        self.folder = Path(folder)
        self.dtype, self.device = dtype, torch.device(device)
        files = tensor_files(self.folder)
        if not files:
            raise ModelNotFoundError(f"model.path: {folder}: no *.safetensors weights")
        skip = {"lm_head.weight"} if tied else set()
        self.files = {n: f for n, f in files.items()
                      if n not in skip and not n.endswith("rotary_emb.inv_freq")}
        self._replaced: dict[str, object] = {}
        self._untrimmed = 0  # bytes read since the heap was last trimmed (on the CPU)
        self._dtypes: dict[Path, dict[str, str]] = {}  # file -> its tensors' stored dtypes

    def __getitem__(self, name: str) -> object:
        if name in self._replaced:
            return self._replaced[name]
        return self.read(name)

    def __setitem__(self, name: str, value: object) -> None:
        self._replaced[name] = value

    def __delitem__(self, name: str) -> None:
        if name not in self._replaced and name not in self.files:
            raise KeyError(name)
        self._replaced.pop(name, None)
        self.files.pop(name, None)

    def __iter__(self) -> Iterator[str]:
        yield from self.files
        yield from (n for n in self._replaced if n not in self.files)

    def __len__(self) -> int:
        return len(self.files) + sum(1 for n in self._replaced if n not in self.files)

    def stored_dtype(self, name: str) -> str:
        """The dtype `name` has in its file, safetensors' name for it ("BF16", "F8_E4M3", ...),
        from the file's header alone (each file's read once: opening it for every tensor was
        0.09 s of SmolLM2's load)."""
        file = self.files[name]
        if file not in self._dtypes:
            with safe_open(file, "pt") as f:
                self._dtypes[file] = {n: f.get_slice(n).get_dtype() for n in f.keys()}
        return self._dtypes[file][name]

    def read(self, name: str, part: Part | None = None) -> torch.Tensor:
        """The tensor `name` (or its `part`) in the checkpoint's dtype and device."""
        with safe_open(self.files[name], "pt") as f:  # its own mapping, see the module's note
            if part is None:
                tensor = f.get_tensor(name)
            else:
                dim, index, count = part
                block = f.get_slice(name)
                size = block.get_shape()[dim]
                if size % count:
                    raise ValueError(f"{name}: {size} rows along dim {dim} do not split in "
                                     f"{count} equal parts")
                step = size // count
                where = [slice(None)] * dim + [slice(index * step, (index + 1) * step)]
                tensor = block[tuple(where)]
        tensor = self._placed(name, tensor)
        if self.device.type == "cpu":
            self._untrimmed += tensor.nbytes
            if self._untrimmed >= TRIM_BYTES:
                give_back_freed_heap()  # what the layers built so far freed
                self._untrimmed = 0
        return tensor

    def _placed(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """On the device first, then cast (on a GPU the cast is the device's work and the host
        holds no cast copy); on the CPU the cast is the one copy. FP8 weights and the scales of
        FP8 weights and KV caches keep their stored dtype (fp8_checkpoint.keeps_dtype)."""
        if self.device.type != "cpu":
            tensor = tensor.to(self.device)
        if (tensor.is_floating_point() and tensor.dtype != self.dtype
                and not keeps_dtype(name, tensor)):
            tensor = tensor.to(self.dtype)
        return tensor


def load_weights(folder: Path, dtype: torch.dtype, device: torch.device | str):
    """(config, the folder's Checkpoint): its tensors by name, each read when asked. A config
    with untied embeddings whose checkpoint has no lm_head.weight is a ModelNotFoundError."""
    config = load_config(folder)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    checkpoint = Checkpoint(folder, dtype, device, tied)
    if not tied and "lm_head.weight" not in checkpoint:
        raise ModelNotFoundError(
            f"model.path: {folder}: lm_head.weight missing and tie_word_embeddings is false"
        )
    return config, checkpoint
