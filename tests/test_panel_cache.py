"""The panel file (batchllm/model/panel_cache.py, panel_file.py): a warm load maps it and lays
out nothing (no packing); what it serves is what a build without it makes, bit for bit; a
changed weight file, a changed layout, a truncated or damaged file, a header whose entries do
not place its tensors are never served: everything is laid out again, the file rewritten, and the model's logits
still equal transformers'."""

from __future__ import annotations

import json
import os
import shutil
import zlib
from pathlib import Path

import pytest
import torch
from hf_reference import tiny_model_folder
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from batchllm.model import panel_cache, panel_file
from batchllm.model.attention import PagedAttention, StepMetadata
from batchllm.model.linear import Linear
from batchllm.model.loader import LoadedModel, load_model
from batchllm_kernels.cpu import linear as cpu_linear

pytestmark = pytest.mark.skipif(cpu_linear.load() is None,
                                reason="the C projection kernel cannot be built here")
PAGE = 8


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private copy of the tiny Llama (its weights may be changed), with its own cache root."""
    source = tiny_model_folder("llama")  # before the cache root moves: it converts SmolLM2
    monkeypatch.setenv("BATCHLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("BATCHLLM_PANEL_CACHE", raising=False)
    copy = tmp_path / "llama"
    shutil.copytree(source, copy)
    return copy


def _counted(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """One entry per call of cpu_linear's `name` from now on."""
    calls: list[int] = []
    function = getattr(cpu_linear, name)

    def counted(*args):
        calls.append(1)
        return function(*args)

    monkeypatch.setattr(cpu_linear, name, counted)
    return calls


@pytest.fixture
def packs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many weights were packed: one entry per call of the packing function."""
    return _counted(monkeypatch, "pack_panels")


def load(folder: Path) -> LoadedModel:
    return load_model(str(folder), "float32", "cpu")


def assert_logits_equal_transformers(loaded: LoadedModel, folder: Path) -> None:
    """One prefill step of 20 tokens: our logits against transformers' forward."""
    model, s = loaded.model, loaded.model.shape
    ids = torch.randint(5, 4000, (20,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(folder)(ids[None]).logits[0].float()
    pages = -(-len(ids) // PAGE)
    attention = PagedAttention(s.num_layers, pages, PAGE, s.num_heads, s.num_kv_heads,
                               s.head_dim, model.dtype, torch.device("cpu"), model.ops)
    i32 = torch.int32
    attention.meta = StepMetadata(
        slot_mapping=torch.arange(len(ids)), page_table=torch.arange(pages, dtype=i32)[None],
        cu_q=torch.tensor([0, len(ids)], dtype=i32),
        context_lens=torch.tensor([len(ids)], dtype=i32), kv_start=torch.zeros(1, dtype=i32))
    logits = model.forward(ids, torch.arange(len(ids)), attention, torch.arange(len(ids)))
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-3)


def the_file(folder: Path) -> Path:
    (path,) = [p for p in panel_cache.cache_paths(folder) if p.is_file()]
    return path


def test_warm_load_maps_the_file_and_packs_nothing(folder: Path, packs: list[int]) -> None:
    cold = load(folder)
    assert cold.panel_cache == "written" and len(packs) > 0
    path = the_file(folder)
    assert path.parent.name == "panels"  # a user's folder is not written into
    assert not [p for p in path.parent.iterdir() if ".tmp-" in p.name]  # renamed into place
    packs.clear()
    warm = load(folder)
    assert warm.panel_cache == "hit" and packs == []
    assert_logits_equal_transformers(warm, folder)


def projections(loaded: LoadedModel) -> list[Linear]:
    """The model's projections in the order it builds them (the file's entries): the lm_head,
    then each layer's."""
    model = loaded.model
    layers = [p for layer in model.layers
              for p in (layer.attn.qkv, layer.attn.o, layer.mlp.gate_up, layer.mlp.down)]
    return [model.lm_head, *layers]


_LAID = ("panels", "panel_bias")


def assert_laid_out_alike(served: LoadedModel, made_here: LoadedModel, rows=(1, 64)) -> None:
    """Every projection's panels and bias bit for bit, and its products of `rows` rows."""
    gen = torch.Generator().manual_seed(2)
    pairs = list(zip(projections(served), projections(made_here), strict=True))
    for s, m in pairs:
        for name in _LAID:
            a, b = getattr(s, name), getattr(m, name)
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), name
    for s, m in pairs[:5]:  # the lm_head, a layer's
        x = torch.randn(max(rows), s.in_features, generator=gen)
        for r in rows:
            assert torch.equal(s(x[:r]), m(x[:r])), f"{r} rows"


@pytest.mark.slow  # loads the real SmolLM2 model
def test_real_checkpoint_served_bit_for_bit(smollm2_folder: Path, tmp_path: Path,
                                            packs: list[int],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """SmolLM2-135M's float32 conversion (its GGUF blocks otherwise run: no panels): its
    panels come from the file as they were made."""
    monkeypatch.setenv("BATCHLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("BATCHLLM_GGUF_BLOCKS", "0")
    cold = load(smollm2_folder)
    assert cold.panel_cache == "written"
    packs.clear()
    warm = load(smollm2_folder)
    assert warm.panel_cache == "hit" and packs == []
    assert_laid_out_alike(warm, cold, rows=(1, 20, 64))


def _edit_header(path: Path, edit) -> None:
    """Change the header as `edit` does, its crc32 made to agree (the data stay in place)."""
    with open(path, "rb") as f:
        _, length, _ = panel_file._PREFIX.unpack(f.read(panel_file._PREFIX.size))
        header = json.loads(f.read(length))
    edit(header)
    text = json.dumps(header).encode()
    assert panel_file._PREFIX.size + len(text) <= header["entries"][0]["panels"]
    with open(path, "r+b") as f:
        f.write(panel_file._PREFIX.pack(panel_file.MAGIC, len(text), zlib.crc32(text)) + text)


# The entries of the tiny Llama: the lm_head's, then each layer's qkv, o, gate_up, down (no
# biases).
def _second_bias_added(header: dict) -> None:
    header["entries"][1]["bias"] = header["entries"][1]["panels"]


def _last_panels_dropped(header: dict) -> None:
    header["entries"][-1]["panels"] = None  # only the length can tell


def _last_shape_wider(header: dict) -> None:
    header["entries"][-1]["shape"][1] += 16


def _old_fields(header: dict) -> None:
    header["entries"][0].update(parts=None, planes=None, blocks=None)  # format 2's entries


# the fast lane (README: Run the tests) keeps the first case of each kind of damage
@pytest.mark.parametrize("edit", [_second_bias_added, *(pytest.param(e, marks=pytest.mark.slow)
                                  for e in (_last_panels_dropped, _last_shape_wider, _old_fields))])
def test_recorded_entries_that_do_not_place_the_data_are_rebuilt(
        folder: Path, packs: list[int], edit) -> None:
    assert load(folder).panel_cache == "written"
    _edit_header(the_file(folder), edit)
    _assert_refused_and_rebuilt(folder, packs)


@pytest.mark.parametrize("header_agrees", [False, True])
def test_a_file_cut_inside_the_panels_is_rebuilt(folder: Path, packs: list[int],
                                                 header_agrees: bool) -> None:
    """Cut in the last entry's panels (all before them whole); also with the header's length
    made to say so (the placement still wants the rest)."""
    assert load(folder).panel_cache == "written"
    path = the_file(folder)
    cut = panel_file.read_header(path)["entries"][-1]["panels"] + 1000
    with open(path, "r+b") as f:
        f.truncate(cut)
    if header_agrees:
        _edit_header(path, lambda header: header.update(file_bytes=cut))
    _assert_refused_and_rebuilt(folder, packs)


def _assert_refused_and_rebuilt(folder: Path, packs: list[int]) -> None:
    """The folder's panel file is refused; the next load lays everything out again (every
    weight packed), writes the file and matches transformers; the one after is a hit."""
    assert panel_file.read_header(the_file(folder)) is None
    _assert_rebuilt(folder, packs, every_weight=True)


def _assert_rebuilt(folder: Path, packs: list[int], every_weight: bool = False) -> None:
    """The next load packs weights again (every one of them with every_weight), writes the file
    and matches transformers; the one after is a hit."""
    packs.clear()
    rebuilt = load(folder)
    assert rebuilt.panel_cache == "written" and len(packs) > 0
    if every_weight:
        assert len(packs) == len(projections(rebuilt))
    assert_logits_equal_transformers(rebuilt, folder)
    assert load(folder).panel_cache == "hit"


def test_changed_weight_file_is_rebuilt(folder: Path, packs: list[int]) -> None:
    assert load(folder).panel_cache == "written"
    weights = folder / "model.safetensors"
    state = load_file(weights)
    state["model.layers.0.mlp.down_proj.weight"] *= -2  # same size: only the contents differ
    save_file(state, weights, metadata={"format": "pt"})
    _assert_rebuilt(folder, packs)


def test_touched_weight_file_is_rebuilt(folder: Path) -> None:
    assert load(folder).panel_cache == "written"
    weights = folder / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert load(folder).panel_cache == "written"


def test_changed_layout_is_rebuilt(folder: Path, packs: list[int],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    assert load(folder).panel_cache == "written"
    monkeypatch.setattr(panel_cache, "LAYOUT_VERSION", panel_cache.LAYOUT_VERSION + 1)
    packs.clear()
    rebuilt = load(folder)
    assert rebuilt.panel_cache == "written" and len(packs) > 0
    assert_logits_equal_transformers(rebuilt, folder)


@pytest.mark.parametrize("name", ["linear.py", "linear.c"])
def test_changed_packing_code_is_a_new_key(folder: Path, tmp_path: Path, name: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The panels' packer and the C kernel that reads them."""
    before = panel_cache.source_key(folder)
    source = Path(cpu_linear.__file__).with_name(name)
    edited = tmp_path / name
    edited.write_text(source.read_text() + "\n// changed\n")
    code = [edited if p == source else p for p in panel_cache._CODE]
    monkeypatch.setattr(panel_cache, "_CODE", code)
    assert panel_cache.source_key(folder) != before


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 100)


def _flip_header(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(40)  # inside the header's JSON
        byte = f.read(1)
        f.seek(40)
        f.write(bytes([byte[0] ^ 0x20]))


def _flip_magic(path: Path) -> None:
    with open(path, "r+b") as f:
        f.write(b"XX")


def _empty(path: Path) -> None:
    path.write_bytes(b"")


@pytest.mark.parametrize("damage", [_truncate, *(pytest.param(d, marks=pytest.mark.slow)
                                    for d in (_flip_header, _flip_magic, _empty))])
def test_damaged_file_is_rebuilt_not_trusted(folder: Path, packs: list[int], damage) -> None:
    assert load(folder).panel_cache == "written"
    damage(the_file(folder))
    assert panel_cache.read_header(the_file(folder)) is None
    _assert_rebuilt(folder, packs)


def test_a_converted_folder_keeps_its_file_inside_else_the_cache_dir(folder: Path) -> None:
    converted = Path(os.environ["BATCHLLM_CACHE"]) / "models" / "tiny"
    shutil.copytree(folder, converted)
    assert load(converted).panel_cache == "written"
    assert (converted / panel_cache.FILE_NAME).is_file()
    (converted / panel_cache.FILE_NAME).unlink()
    (converted / panel_cache.FILE_NAME).mkdir()  # that place cannot take the file
    assert load(converted).panel_cache == "written"
    assert the_file(converted).parent.name == "panels"
    assert load(converted).panel_cache == "hit"


def test_files_of_removed_folders_are_swept(folder: Path, tmp_path: Path) -> None:
    gone = tmp_path / "gone"
    shutil.copytree(folder, gone)
    assert load(gone).panel_cache == "written"
    stale = the_file(gone)
    shutil.rmtree(gone)
    assert load(folder).panel_cache == "written"
    assert not stale.exists() and the_file(folder).is_file()


def test_other_layouts_keep_no_file(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_linear, "load", lambda: None)  # no C kernel: oneDNN's layout
    assert load(folder).panel_cache == "off"
    assert not [p for p in panel_cache.cache_paths(folder) if p.exists()]


def test_switched_off(folder: Path, packs: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHLLM_PANEL_CACHE", "0")
    assert load(folder).panel_cache == "off" and len(packs) > 0
    assert not [p for p in panel_cache.cache_paths(folder) if p.exists()]
