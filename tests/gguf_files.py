"""Real .gguf files for the tests, written by the gguf package (GGUFWriter) with weights
quantized by gguf.quants.quantize: the format as llama.cpp's tools write it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize

KINDS = ("Q8_0", "Q4_0", "Q4_1")


def random_weight(gen: np.random.Generator, n: int, k: int) -> np.ndarray:
    """[N, K] float32 with rows of different scales and offsets (Q4_1's m matters)."""
    scale = gen.uniform(0.01, 2.0, size=(n, 1))
    return (gen.standard_normal((n, k)) * scale + gen.normal(0, 0.5, size=(n, 1))).astype(
        np.float32)


def write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, str]],
               heads: tuple[int, int] | None = None, layers: int = 1) -> Path:
    """A llama-architecture .gguf holding each name's float32 weight quantized as its kind
    (F32: as it is); heads: (head_count, head_count_kv) in the metadata."""
    writer = GGUFWriter(path, "llama")
    writer.add_block_count(layers)
    if heads is not None:
        writer.add_head_count(heads[0])
        writer.add_head_count_kv(heads[1])
    for name, (weight, kind) in tensors.items():
        qtype = GGMLQuantizationType[kind]
        if kind == "F32":
            writer.add_tensor(name, weight)
        else:
            writer.add_tensor(name, quantize(weight, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def dequantized(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of the file at `path` as gguf.quants.dequantize gives it, [N, K] float32."""
    out = {}
    for t in GGUFReader(path).tensors:
        out[t.name] = dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)
    return out
