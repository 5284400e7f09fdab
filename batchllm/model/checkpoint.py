"""A checkpoint's tensors, each taken once by the layers that use it: a tensor the family needs
and the checkpoint lacks, or one the checkpoint has and the family never takes, is a ModelError
(exit 2) naming the tensor and the file."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from batchllm.model.errors import ModelError
from batchllm.model.shards import tensor_files, weight_files


class Tensors:
    """Takes tensors out of a state by their checkpoint names: a dict, or a weights.Checkpoint
    whose tensors are read as they are taken (one at a time, in the order the model is built)."""

    def __init__(self, state: Mapping[str, torch.Tensor], family: str,
                 folder: Path | None = None) -> None:
        self._state = state
        self._left = set(state)
        self._family = family
        self._folder = folder

    def __contains__(self, name: str) -> bool:
        return name in self._left

    def take(self, name: str) -> torch.Tensor:
        """The tensor `name`, removed from those left."""
        if name not in self._left:
            files = ", ".join(p.name for p in self._files()) or "the state dict"
            where = f"{self._folder}: " if self._folder else ""
            raise ModelError(f"model.path: {where}tensor {name!r} is missing from {files} "
                             f"(the {self._family} family needs it)")
        self._left.remove(name)
        return self._state[name]

    def take_all(self, names: list[str]) -> list[torch.Tensor]:
        return [self.take(n) for n in names]

    def check_all_taken(self) -> None:
        """Raise ModelError naming the first tensors no layer took, and their files."""
        if not self._left:
            return
        names = sorted(self._left)
        owner = self._owners(names[:5])
        listed = ", ".join(f"{n!r} in {owner.get(n, 'the state dict')}" for n in names[:5])
        more = f" and {len(names) - 5} more" if len(names) > 5 else ""
        raise ModelError(f"model.path: {self._folder or 'the checkpoint'}: unexpected tensor "
                         f"{listed}{more}: not part of a {self._family} model")

    def _files(self) -> list[Path]:
        return weight_files(self._folder) if self._folder else []

    def _owners(self, names: list[str]) -> dict[str, str]:
        """Which file holds each name (the index, or the safetensors headers only)."""
        owners = tensor_files(self._folder) if self._folder else {}
        return {n: owners[n].name for n in names if n in owners}
