"""A GGUF file's projections read as their blocks (batchllm/model/gguf_blocks.py): under the
Hugging Face names, q/k rows un-permuted as transformers does, their values gguf's dequantized
ones; on a file written here and on the default model's own Q4_1 file, against the float32
folder transformers converted from it."""

import json
import os

import numpy as np
import pytest
import torch

from batchllm.model.gguf_blocks import BlockWeight, holds_blocks, read_blocks
from tests.gguf_files import dequantized, random_weight, write_gguf


def unpermuted(w: np.ndarray, heads: int) -> np.ndarray:
    """transformers' LlamaTensorProcessor._reverse_permute_weights, on a dequantized weight."""
    d = w.shape[0] // heads // 2
    return w.reshape(heads, d, 2, w.shape[1]).swapaxes(2, 1).reshape(w.shape)


def test_blocks_of_a_written_file_under_their_hf_names(tmp_path):
    gen = np.random.default_rng(1)
    hq, hkv, d, h = 4, 2, 16, 64
    tensors = {"blk.0.attn_q.weight": (random_weight(gen, hq * d, h), "Q4_1"),
               "blk.0.attn_k.weight": (random_weight(gen, hkv * d, h), "Q8_0"),
               "blk.0.attn_v.weight": (random_weight(gen, hkv * d, h), "Q4_0"),
               "blk.0.ffn_down.weight": (random_weight(gen, h, 96), "Q4_1"),
               "blk.0.ffn_up.weight": (random_weight(gen, 96, h), "F32"),
               "token_embd.weight": (random_weight(gen, 50, h), "Q8_0")}
    path = write_gguf(tmp_path / "m.gguf", tensors, heads=(hq, hkv))
    values = dequantized(path)
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
             "model.layers.0.self_attn.v_proj.weight", "model.layers.0.mlp.down_proj.weight",
             "model.layers.0.mlp.up_proj.weight", "model.layers.0.input_layernorm.weight",
             "model.embed_tokens.weight", "lm_head.weight"]
    got = read_blocks(path, names, tied=True)
    # F32, norms and the embedding (looked up, not multiplied) stay the folder's
    assert sorted(got) == sorted(names[:4] + ["lm_head.weight"])
    want = {names[0]: unpermuted(values["blk.0.attn_q.weight"], hq),
            names[1]: unpermuted(values["blk.0.attn_k.weight"], hkv),
            names[2]: values["blk.0.attn_v.weight"], names[3]: values["blk.0.ffn_down.weight"],
            "lm_head.weight": values["token_embd.weight"]}
    for name, w in want.items():
        assert got[name].shape == w.shape and torch.equal(got[name].dequantize(),
                                                          torch.from_numpy(w)), name
    assert got[names[0]].kind == "Q4_1" and got[names[1]].kind == "Q8_0"
    assert read_blocks(path, ["lm_head.weight"], tied=False) == {}  # untied: no output.weight
    joined = BlockWeight.cat([got[names[3]], got[names[3]]])
    assert joined.shape == (2 * h, 96) and torch.equal(joined.blocks[h:], got[names[3]].blocks)
    assert holds_blocks([joined]) and not holds_blocks(torch.zeros(1))
    with pytest.raises(ValueError, match="share"):
        BlockWeight.cat([got[names[0]], got[names[1]]])


@pytest.mark.slow  # reads the real SmolLM2 model
def test_the_default_models_blocks_are_its_converted_weights():
    """SmolLM2's Q4_1 file: every projection of two layers and the tied lm_head (Q8_0), read
    as blocks and dequantized, equal the folder transformers converted, bit for bit."""
    from safetensors import safe_open

    from batchllm.model.gguf import ALIASES, alias_folder, source_file

    folder = alias_folder("smollm2-135m-instruct")
    gguf_path = source_file(folder)
    assert gguf_path is not None and gguf_path.name == ALIASES["smollm2-135m-instruct"][2]
    projections = [f"model.layers.{i}.{p}.weight" for i in (0, 29) for p in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    got = read_blocks(gguf_path, [*projections, "lm_head.weight"], tied=True)
    assert {w.kind for n, w in got.items() if n != "lm_head.weight"} == {"Q4_1"}
    assert got["lm_head.weight"].kind == "Q8_0"
    with safe_open(folder / "model.safetensors", "pt") as f:
        for name in projections:
            assert torch.equal(got[name].dequantize(), f.get_tensor(name)), name
        assert torch.equal(got["lm_head.weight"].dequantize(),
                           f.get_tensor("model.embed_tokens.weight"))


def converted(tmp_path, monkeypatch, tensors: dict) -> tuple:
    """(a .gguf of `tensors` written here, a converted folder of it), blocks on."""
    from batchllm.model.gguf import MARKER

    path = write_gguf(tmp_path / "m.gguf", tensors, heads=(4, 2))
    folder = tmp_path / "converted"
    folder.mkdir()
    (folder / MARKER).write_text(json.dumps({"gguf": str(path)}))
    monkeypatch.setenv("BATCHLLM_GGUF_BLOCKS", "1")
    return path, folder


def test_the_blocks_read_are_kept_and_read_again_only_when_the_file_changes(tmp_path, monkeypatch):
    """take_blocks reads a .gguf's blocks once: a later load of the same converted folder takes
    them from the file kept there (gguf's reader, which parses the whole vocabulary, is not
    called), the same blocks; once the .gguf's modification time changes it is read again."""
    import gguf

    from batchllm.model.gguf_blocks import take_blocks
    from batchllm.rows.fingerprint import model_files

    gen = np.random.default_rng(2)
    path, folder = converted(tmp_path, monkeypatch, {
        "blk.0.attn_q.weight": (random_weight(gen, 64, 64), "Q4_1"),
        "blk.0.attn_k.weight": (random_weight(gen, 32, 64), "Q8_0"),
        "blk.0.ffn_down.weight": (random_weight(gen, 64, 96), "Q4_0"),
        "token_embd.weight": (random_weight(gen, 50, 64), "Q8_0")})
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
             "model.layers.0.mlp.down_proj.weight", "model.layers.0.input_layernorm.weight"]
    first = dict.fromkeys(names)
    legacy = folder / "gguf-blocks-0123456789abcdef.safetensors"  # as 935f5ff named them
    legacy.write_bytes(b"old")
    weights = model_files(folder)  # what a resume's fingerprint and the panel cache key read
    assert take_blocks(folder, first, tied=True) == 4  # three projections and the lm_head
    assert len(list(folder.glob("gguf-blocks-*.blocks"))) == 1
    assert not legacy.exists() and model_files(folder) == weights[:-1]  # the legacy one went
    other = dict.fromkeys(names[:1])  # another set of names: a file beside, both kept
    assert take_blocks(folder, other, tied=False) == 1
    assert len(list(folder.glob("gguf-blocks-*.blocks"))) == 2

    def read_again(*args, **kwargs):
        raise AssertionError("the .gguf was read again")

    monkeypatch.setattr(gguf, "GGUFReader", read_again)
    again = dict.fromkeys(names)
    assert take_blocks(folder, again, tied=True) == 4
    assert again.keys() == first.keys() and again[names[3]] is None
    for name, w in first.items():
        if w is not None:
            kept = again[name]
            assert (kept.kind, kept.in_features) == (w.kind, w.in_features), name
            assert torch.equal(kept.blocks, w.blocks), name
    mtime = path.stat().st_mtime_ns
    os.utime(path, ns=(mtime, mtime + 10**9))
    with pytest.raises(AssertionError, match="read again"):
        take_blocks(folder, dict.fromkeys(names), tied=True)
    monkeypatch.undo()
    monkeypatch.setenv("BATCHLLM_GGUF_BLOCKS", "1")
    assert take_blocks(folder, dict.fromkeys(names), tied=True) == 4
    assert len(list(folder.glob("gguf-blocks-*.blocks"))) == 1  # the old ones removed


@pytest.mark.parametrize("damage", ["cut", "garbage", "no list", "wrong width"])
def test_a_damaged_kept_file_is_a_miss_read_again_and_written_whole(tmp_path, monkeypatch,
                                                                    damage):
    """A kept blocks file that cannot be read whole (cut, overwritten, without its list of
    blocks, a tensor narrower than its kind and width say) is a miss, as the panel cache's: the
    .gguf is read again, the same blocks, and a whole file written in its place."""
    from safetensors.torch import save

    from batchllm.model.gguf_blocks import take_blocks

    gen = np.random.default_rng(3)
    _, folder = converted(tmp_path, monkeypatch, {
        "blk.0.attn_q.weight": (random_weight(gen, 64, 64), "Q4_1"),
        "blk.0.ffn_down.weight": (random_weight(gen, 64, 96), "Q8_0"),
        "token_embd.weight": (random_weight(gen, 50, 64), "Q4_0")})
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"]
    first = dict.fromkeys(names)
    assert take_blocks(folder, first, tied=True) == 3
    (kept,) = folder.glob("gguf-blocks-*.blocks")
    whole = kept.read_bytes()
    if damage == "cut":
        kept.write_bytes(whole[: len(whole) // 2])
    elif damage == "garbage":
        kept.write_bytes(b"\xff" * len(whole))
    else:
        narrow = {n: w.blocks[:, :-1].contiguous() for n, w in first.items() if w is not None}
        listed = {n: [w.kind, w.in_features] for n, w in first.items() if w is not None}
        kept.write_bytes(save(narrow, metadata=None if damage == "no list"
                              else {"blocks": json.dumps(listed)}))
    again = dict.fromkeys(names)
    assert take_blocks(folder, again, tied=True) == 3
    for name, w in first.items():
        if w is not None:
            assert (again[name].kind, again[name].in_features) == (w.kind, w.in_features)
            assert torch.equal(again[name].blocks, w.blocks), name
    assert kept.read_bytes() == whole
