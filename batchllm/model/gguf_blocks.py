"""A GGUF file's quantized projections as their blocks (Q8_0, Q4_0, Q4_1: kernels/cpu/blocks.c
says what a block holds), under the Hugging Face names transformers gives them, for the CPU
block kernel: the bytes as the file holds them, each weight's rows of K / 32 blocks.

Names: gguf's own table (gguf.get_tensor_name_map, what transformers' loader inverts) maps
each Hugging Face name of the converted folder to its GGUF tensor; `lm_head.weight` of a model
with tied embeddings is the file's `token_embd.weight`. Rows: llama.cpp's converter permutes
q_proj's and k_proj's rows of a llama model (the two halves of each head's rotary dims
interleaved); transformers un-permutes the dequantized weight (LlamaTensorProcessor:
[heads, D/2, 2, K] -> [heads, 2, D/2, K]), and since the permutation is over output rows it is
applied here to the rows of blocks, the same rows in the same order.

`take_blocks` puts them in a model's state in place of the converted folder's float32 weights
(whose pages are then never read), where the model runs on the CPU in float32 from a folder
batchllm converted from a .gguf file, when BATCHLLM_GGUF_BLOCKS=1. The blocks it read are kept
in that folder (a safetensors file named *.blocks), keyed by the .gguf's path, size and
modification time:
gguf's reader parses every metadata field, the tokenizer's vocabulary and merges included (2.4 s
for SmolLM2's file on a 2-core Xeon), where the kept file loads in milliseconds. Off by default:
steps of few rows are faster, whole jobs are not (README, GGUF: scripts/bench_blocks.py,
bench.py --weights both). The same bits either way (tests/test_gguf_engine.py).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, MutableMapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from batchllm.model.gguf import file_key, source_file
from batchllm_kernels.atomic_write import write_atomic
from batchllm_kernels.cpu.blocks import BLOCK, TYPES, check_blocks

# the weights read as blocks: a layer's attention and dense MLP projections, and the lm_head
PROJECTION = re.compile(r"^(model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|"
                        r"mlp\.(gate|up|down)_proj)|lm_head)\.weight$")
_UNPERMUTED = ("llama",)  # the architectures whose q/k rows transformers un-permutes


@dataclass
class BlockWeight:
    """A projection's weight [N, K] as GGUF blocks."""

    blocks: torch.Tensor  # [N, K / 32 * block bytes] uint8, rows as transformers' weight's
    kind: str  # Q8_0 | Q4_0 | Q4_1
    in_features: int  # K

    @property
    def shape(self) -> torch.Size:
        return torch.Size([self.blocks.shape[0], self.in_features])

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32 as gguf.quants.dequantize gives it (what transformers loads)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        values = dequantize(self.blocks.numpy(), GGMLQuantizationType[self.kind])
        return torch.from_numpy(values.astype(np.float32, copy=False))

    @staticmethod
    def cat(parts: list[BlockWeight]) -> BlockWeight:
        """Row blocks joined (q, k, v; gate, up) into one weight; one kind and K only."""
        if len({(p.kind, p.in_features) for p in parts}) != 1:
            raise ValueError("GGUF weights joined must share their block type and columns")
        if len(parts) == 1:
            return parts[0]
        return BlockWeight(torch.cat([p.blocks for p in parts]), parts[0].kind,
                           parts[0].in_features)


def holds_blocks(weight: object) -> bool:
    """Whether a projection's weight (a tensor, a record, or a list of row blocks) is blocks."""
    first = weight[0] if isinstance(weight, list) and weight else weight
    return isinstance(first, BlockWeight)


def _text(reader, key: str) -> str | None:
    field = reader.fields.get(key)
    return None if field is None else str(field.contents())


def _unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """transformers' _reverse_permute_weights over rows of blocks."""
    d = rows.shape[0] // heads // 2
    return rows.reshape(heads, d, 2, *rows.shape[1:]).swapaxes(2, 1).reshape(rows.shape)


def read_blocks(path: Path, names: Iterable[str], tied: bool) -> dict[str, BlockWeight]:
    """The projections among `names` (Hugging Face names) that the GGUF file at `path` holds
    as Q8_0, Q4_0 or Q4_1 blocks, each as a BlockWeight; the others are left out (they stay
    the converted folder's float32). tied: lm_head.weight is the embedding's."""
    from gguf import MODEL_ARCH_NAMES, GGUFReader, get_tensor_name_map

    reader = GGUFReader(path)
    arch = _text(reader, "general.architecture")
    by_name = {v: k for k, v in MODEL_ARCH_NAMES.items()}
    if arch not in by_name:
        return {}
    layers = int(reader.fields[f"{arch}.block_count"].contents())
    table = get_tensor_name_map(by_name[arch], layers)
    tensors = {t.name: t for t in reader.tensors}
    heads = {"q": reader.fields.get(f"{arch}.attention.head_count"),
             "k": reader.fields.get(f"{arch}.attention.head_count_kv")}
    out = {}
    for name in names:
        if not PROJECTION.match(name):
            continue
        base = table.get_name(name.removesuffix(".weight"))
        tensor = tensors.get(f"{base}.weight") if base else None
        if tensor is None and tied and name == "lm_head.weight":
            tensor = tensors.get("token_embd.weight")
        if tensor is None or tensor.tensor_type.name not in TYPES:
            continue
        k = int(tensor.shape[0])  # GGUF lists the dimensions innermost first
        rows = np.asarray(tensor.data).reshape(-1, k // BLOCK * TYPES[tensor.tensor_type.name][1])
        which = re.search(r"\.self_attn\.(q|k)_proj\.", name)
        if arch in _UNPERMUTED and which and heads[which.group(1)] is not None:
            rows = _unpermute(rows, int(heads[which.group(1)].contents()))
        out[name] = BlockWeight(torch.from_numpy(np.array(rows)), tensor.tensor_type.name, k)
    return out


def take_blocks(folder: Path, state: MutableMapping, tied: bool,
                attention: bool = True) -> int:
    """In place: each projection of `state` the GGUF file behind `folder` holds as blocks
    becomes its BlockWeight (attention False: the attention's stay float32, as for models
    whose heads are permuted at load); returns how many. Nothing for any other folder."""
    path = source_file(folder)
    if path is None or os.environ.get("BATCHLLM_GGUF_BLOCKS", "0") != "1":
        return 0
    names = [n for n in state if attention or ".self_attn." not in n]
    if tied and "lm_head.weight" not in state:
        names.append("lm_head.weight")
    found = _kept_blocks(Path(folder), path, names, tied)
    for name, weight in found.items():
        state[name] = weight
    return len(found)


def _kept_blocks(folder: Path, path: Path, names: list[str], tied: bool) -> dict[str, BlockWeight]:
    """read_blocks(path, names, tied), through the file the folder keeps them in: read from it
    when it is there and whole, else read from the .gguf and written (a folder that cannot be
    written to is only read). The file is a safetensors file named gguf-blocks-<the .gguf's
    key>-<the names' key>.blocks: not *.safetensors, which the folder's weights, a job's
    resume fingerprint and the panel cache's key are (a first run with blocks would change
    them); the kept files of the .gguf as it was before a change are removed."""
    from safetensors.torch import save

    source = file_key(path)[:12]
    wanted = file_key(path, str(tied), *sorted(names))[:12]
    kept = folder / f"gguf-blocks-{source}-{wanted}.blocks"
    found = _read_kept(kept) if kept.is_file() else None
    if found is not None:
        return found
    found = read_blocks(path, names, tied)
    data = save({name: w.blocks for name, w in found.items()}, metadata={"blocks": json.dumps(
        {name: [w.kind, w.in_features] for name, w in found.items()})})
    try:
        write_atomic(kept, lambda f: f.write(data))
        for old in folder.glob("gguf-blocks-*"):
            if not old.name.startswith(f"gguf-blocks-{source}-") or old.suffix != ".blocks":
                old.unlink(missing_ok=True)  # of the .gguf as it was, or named as before
    except OSError:  # a shared cache folder of another user's: read from the .gguf each time
        pass
    return found


def _read_kept(kept: Path) -> dict[str, BlockWeight] | None:
    """The blocks a kept file holds, or None when it is damaged (its header unreadable, its
    list of blocks missing, a tensor of the wrong type or width): a miss, as the panel cache
    treats a damaged panel file. Bytes changed inside a block are not found here, as there."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(kept, "pt") as f:
            listed = json.loads((f.metadata() or {})["blocks"])  # name -> [kind, in_features]
            found = {name: BlockWeight(f.get_tensor(name), kind, int(k))
                     for name, (kind, k) in listed.items()}
        for w in found.values():
            check_blocks(w.blocks, w.kind, w.in_features)  # ValueError: a type or width off
    except (SafetensorError, OSError, KeyError, TypeError, ValueError):
        return None
    return found
