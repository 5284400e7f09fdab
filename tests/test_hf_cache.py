"""The config and the tokenizer without transformers on a warm start (model/hf_cache.py,
model/tokenizer.py): what the cache serves equals what transformers gives — every config
attribute batchllm reads, for every family; token ids, decoded text and rendered chat templates
on the real SmolLM2 tokenizer (byte-level BPE), a tiny model's, one whose config adds tokens
that tokenizer.json lacks, a sentencepiece-style Unigram with Metaspace and a BOS post-processor
(Llama 2, Mistral, Gemma's kind) and a word-level one, all made offline; a tokenizer whose
decoding transformers cleans up is transformers' own — and a warm load that renders no chat
template imports no transformers."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hf_reference import FAMILY_KINDS, tiny_model_folder
from transformers import AutoConfig, AutoTokenizer

from batchllm.model import hf_cache, tokenizer
from batchllm.model.hf_cache import READS, ResolvedConfig, load_config

MODEL_CODE = ["families.py", "rotary.py", "decoder.py", "weights.py", "experts.py", "loader.py"]
TEXTS = ["Hello world", "", "  spaces  and\ttabs\n\nnewlines ", "naïve café — 東京 🙂",
         "<|im_start|>user\nHi<|im_end|>", "a <|tool|> b <|tool_start|>", "x" * 300,
         "The parties agree that the Provider shall"]
CHATS = [[{"role": "user", "content": "What is clause 4?"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
          {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "And?"}]]


def _json(value):
    return json.loads(json.dumps(value))  # what a JSON round trip makes of it (tuples: lists)


@pytest.mark.parametrize("kind", FAMILY_KINDS)
def test_cached_config_reads_as_transformers_config(kind: str) -> None:
    folder = tiny_model_folder(kind)
    load_config(folder)  # resolved by transformers, cached
    cached, real = load_config(folder), AutoConfig.from_pretrained(folder)
    if not isinstance(cached, ResolvedConfig):  # a scaled rope: transformers' config itself
        assert not hf_cache._default_rope(real.rope_parameters)
        return
    missing = object()
    for name in READS:
        assert _json(getattr(cached, name, None)) == _json(getattr(real, name, None)), name
        assert (getattr(cached, name, missing) is missing) == (
            getattr(real, name, missing) is missing), name


def test_smollm2_config_is_served_from_the_cache(smollm2_folder: Path) -> None:
    load_config(smollm2_folder)
    assert isinstance(load_config(smollm2_folder), ResolvedConfig)


def test_every_config_attribute_the_model_code_reads_is_cached() -> None:
    here = Path(hf_cache.__file__).parent
    read = set()
    for name in MODEL_CODE:
        text = (here / name).read_text()
        read |= set(re.findall(r"\b(?:c|config)\.([a-z_]+)\b", text))
        read |= set(re.findall(r"getattr\(\s*(?:c|config),\s*\"([a-z_]+)\"", text))
    not_attributes = {"json", "quantization_config"}  # "config.json"; the GGUF conversion's
    assert read - set(READS) - not_attributes == set()


def test_a_changed_config_is_resolved_again(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    shutil.copytree(tiny_model_folder("llama"), folder)
    load_config(folder)
    assert load_config(folder).rms_norm_eps == AutoConfig.from_pretrained(folder).rms_norm_eps
    raw = json.loads((folder / "config.json").read_text())
    raw["rms_norm_eps"] = 0.125
    (folder / "config.json").write_text(json.dumps(raw))
    assert load_config(folder).rms_norm_eps == 0.125


@pytest.fixture(scope="module")
def extra_tokens_folder(tmp_path_factory: pytest.TempPathFactory, smollm2_folder: Path) -> Path:
    """SmolLM2's tokenizer whose config names a special token tokenizer.json lacks and another
    BOS: transformers adds them to its backend, so the raw tokenizer.json encodes otherwise."""
    folder = tmp_path_factory.mktemp("extra-tokens")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(smollm2_folder / name, folder / name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(extra_special_tokens=["<|tool|>"], bos_token="<|tool_start|>")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


CORPUS = ["The parties agree that the Provider shall deliver the goods.",
          "Who pays the fees? The buyer pays, unless the seller is late.",
          "naïve café — 東京 🙂 notice must be given in writing", "x" * 40] * 20


def _trained_folder(folder: Path, kind: str) -> Path:
    """A tokenizer trained here on CORPUS (tokenizers' own trainers), saved by transformers."""
    from hf_reference import offline_tokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if kind == "wordlevel":
        hf = offline_tokenizer(64)
    else:
        tok = Tokenizer(models.Unigram())
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
        tok.train_from_iterator(CORPUS, trainers.UnigramTrainer(
            vocab_size=180, special_tokens=["<unk>", "<s>", "</s>"], unk_token="<unk>"))
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
        hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                     unk_token="<unk>")
    hf.chat_template = TEMPLATES["llama3"]
    hf.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def trained_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {kind: _trained_folder(tmp_path_factory.mktemp(kind), kind)
            for kind in ("unigram", "wordlevel")}


@pytest.fixture(params=["smollm2", "tiny", "extra", "unigram", "wordlevel"])
def tokenizer_folder(request, smollm2_folder: Path, extra_tokens_folder: Path,
                     trained_folders: dict[str, Path]) -> Path:
    return {"smollm2": smollm2_folder, "tiny": tiny_model_folder("llama"),
            "extra": extra_tokens_folder, **trained_folders}[request.param]


def test_cached_tokenizer_equals_transformers(tokenizer_folder: Path) -> None:
    tokenizer.load(tokenizer_folder)  # transformers', its backend cached
    ours, hf = tokenizer.load(tokenizer_folder), AutoTokenizer.from_pretrained(tokenizer_folder)
    assert isinstance(ours, tokenizer.Tokenizer)
    for special in (True, False):
        assert ours(TEXTS, add_special_tokens=special)["input_ids"] == hf(
            TEXTS, add_special_tokens=special)["input_ids"]
        assert ours(TEXTS[0], add_special_tokens=special)["input_ids"] == hf(
            TEXTS[0], add_special_tokens=special)["input_ids"]
    for ids in hf(TEXTS, add_special_tokens=True)["input_ids"] + [[2, 1, 49152, 49153, 0]]:
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip)
    assert ours.apply_chat_template(CHATS, tokenize=False, add_generation_prompt=True) == (
        hf.apply_chat_template(CHATS, tokenize=False, add_generation_prompt=True))
    assert ours.apply_chat_template(CHATS[1], tokenize=False) == hf.apply_chat_template(
        CHATS[1], tokenize=False)
    assert (ours.eos_token_id, ours.bos_token_id) == (hf.eos_token_id, hf.bos_token_id)
    assert ours.convert_ids_to_tokens([5, 6]) == hf.convert_ids_to_tokens([5, 6])  # passed on


def test_the_extra_tokens_are_transformers_not_the_raw_file(extra_tokens_folder: Path) -> None:
    import tokenizers

    raw = tokenizers.Tokenizer.from_file(str(extra_tokens_folder / "tokenizer.json"))
    tokenizer.load(extra_tokens_folder)
    ours = tokenizer.load(extra_tokens_folder)
    assert ours("a <|tool|>")["input_ids"] != raw.encode("a <|tool|>").ids


def test_a_tokenizer_transformers_cleans_up_is_transformers(tmp_path: Path) -> None:
    """WordPiece with clean_up_tokenization_spaces: transformers' decode does more than its
    backend's, so the run uses transformers' tokenizer itself, warm or cold."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=120,
                                                              special_tokens=["[UNK]"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]",
                            clean_up_tokenization_spaces=True).save_pretrained(tmp_path)
    for _ in range(2):
        loaded = tokenizer.load(tmp_path)
        assert not isinstance(loaded, tokenizer.Tokenizer)
        ids = loaded("Who pays ? The buyer .")["input_ids"]
        assert loaded.decode(ids) == AutoTokenizer.from_pretrained(tmp_path).decode(ids)


@pytest.mark.slow
def test_a_warm_load_imports_no_transformers(tmp_path: Path) -> None:
    """Loading, encoding and decoding; a chat template is transformers' to render
    (model/chat_template.py says why), so rendering one imports it."""
    folder = tmp_path / "m"
    shutil.copytree(tiny_model_folder("llama"), folder)
    script = (
        "import sys; from batchllm.model.loader import load_model\n"
        f"m = load_model({str(folder)!r}, 'float32', 'cpu')\n"
        "m.tokenizer.decode(m.tokenizer(['some text'], add_special_tokens=True)['input_ids'][0])\n"
        "def imported(): return sorted({n.split('.')[0] for n in sys.modules\n"
        "                               if n.startswith('transformers')})\n"
        "before = imported()\n"
        "m.tokenizer.apply_chat_template([[{'role': 'user', 'content': 'x'}]], tokenize=False,\n"
        "                                add_generation_prompt=True)\n"
        "print(type(m.tokenizer).__name__, before, imported())\n")
    env = {**os.environ, "BATCHLLM_CACHE": str(tmp_path / "cache")}
    run = [sys.executable, "-c", script]
    cold = subprocess.run(run, env=env, capture_output=True, text=True, check=True).stdout
    warm = subprocess.run(run, env=env, capture_output=True, text=True, check=True).stdout
    assert "transformers" in cold
    assert warm.split() == ["Tokenizer", "[]", "['transformers']"]


TEMPLATES = {
    "llama3": (
        "{{ bos_token }}{% set ns = namespace(sys='') %}{% for m in messages %}"
        "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
        "{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
        "{% if m['role'] == 'system' %}{% set ns.sys = m['content'] %}{% continue %}{% endif %}"
        "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}"
        "<|eot_id|>{% if loop.last and ns.sys %}[{{ ns.sys }}]{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
        "{% endif %}"),
    "blocks": (
        "{%- for m in messages %}\n  {%- if loop.index > 3 %}{% break %}{% endif %}\n"
        "  {{- m | tojson }}\n  {{ dict(a=1, b=m['role']) | tojson(indent=2) }}\n"
        "{%- endfor %}\n{{ eos_token }}{{ tools is none }}{{ documents is none }}"),
}


@pytest.mark.parametrize("name", ["smollm2", *TEMPLATES])
def test_templates_render_as_transformers_renders_them(name: str, smollm2_folder: Path) -> None:
    from batchllm.model import chat_template

    hf = AutoTokenizer.from_pretrained(smollm2_folder)
    template = hf.get_chat_template() if name == "smollm2" else TEMPLATES[name]
    chats = [*CHATS, [{"role": "user", "content": "ünïcode <b>&</b> \"quotes\"", "name": None}]]
    for gen in (True, False):
        expected = hf.apply_chat_template(chats, chat_template=template, tokenize=False,
                                          add_generation_prompt=gen)
        assert chat_template.render(template, chats, gen, hf.special_tokens_map) == expected


def test_a_template_error_is_raised_as_transformers_raises_it() -> None:
    import jinja2

    from batchllm.model import chat_template

    with pytest.raises(jinja2.exceptions.TemplateError, match="bad role tool"):
        chat_template.render(TEMPLATES["llama3"], [[{"role": "tool", "content": "x"}]], True,
                             {"bos_token": "<s>"})
