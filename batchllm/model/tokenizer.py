"""A model's tokenizer without importing transformers: its `tokenizers` backend as transformers
built it, cached (hf_cache.py), run the way transformers' fast tokenizer runs it.

AutoTokenizer builds the backend from tokenizer.json and tokenizer_config.json (added and
special tokens, the post-processor); a fast tokenizer's encode is then the backend's
encode_batch with split_special_tokens, its decode the backend's decode (the clean-up of
spaces it may add is skipped for BPE models). So the backend, serialized once after
transformers built it, and those few settings give the same ids and text: the first load of a
folder builds them through transformers, later loads read the cache (0.07 s instead of about
1 s of imports). Where transformers' tokenizer does more than its backend (a slow tokenizer, a
clean-up of decoded spaces), it is used itself. Chat templates: chat_template.py.

Anything else of transformers' tokenizer API is there too: Tokenizer passes it to the real
tokenizer, built on first use. Also here: transformers' own tokenizer (the tests' reference) and
the token ids that end a sequence.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
from pathlib import Path
from typing import Any

from batchllm.model import chat_template as templates
from batchllm.model import hf_cache
from batchllm.model.errors import ModelNotFoundError
from batchllm.model.resolve import resolve_model

_WEIGHTS = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".h5", ".msgpack", ".onnx")


class Tokenizer:
    """Encode, decode and chat template of a fast tokenizer, as transformers' does them."""

    is_fast = True

    def __init__(self, folder: Path, state: dict[str, Any], backend: Path) -> None:
        import tokenizers

        self.folder = folder
        self._backend = tokenizers.Tokenizer.from_file(str(backend))
        self._backend.no_padding()
        self._backend.no_truncation()
        self._backend.encode_special_tokens = state["split_special_tokens"]
        self.special_tokens_map: dict[str, Any] = state["special_tokens_map"]
        self.chat_template: str | None = state["chat_template"]
        self.eos_token_id: int | None = state["eos_token_id"]
        self.bos_token_id: int | None = state["bos_token_id"]
        self.pad_token_id: int | None = state["pad_token_id"]
        self._hf = None

    def __call__(self, text: str | list[str], add_special_tokens: bool = True) -> dict:
        """{"input_ids": ids} of one text, or a list of them of a list of texts."""
        texts = [text] if isinstance(text, str) else list(text)
        encoded = self._backend.encode_batch(texts, add_special_tokens=add_special_tokens)
        ids = [e.ids for e in encoded]
        return {"input_ids": ids[0] if isinstance(text, str) else ids}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self(text, add_special_tokens)["input_ids"]

    def decode(self, token_ids: int | list[int], skip_special_tokens: bool = False) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences: list[list[int]], skip_special_tokens: bool = False
                     ) -> list[str]:
        """decode() of each, in one call into the backend."""
        return self._backend.decode_batch(sequences, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, conversation: list, tokenize: bool = True,
                            add_generation_prompt: bool = False, **kwargs: Any):
        """Rendered text of one conversation or of a list of them; anything beyond that
        (tokenize=True, tools, ...) goes to transformers' own method."""
        batched = bool(conversation) and isinstance(conversation[0], (list, tuple))
        if tokenize or kwargs or self.chat_template is None or not conversation:
            return self.transformers.apply_chat_template(
                conversation, tokenize=tokenize, add_generation_prompt=add_generation_prompt,
                **kwargs)
        chats = conversation if batched else [conversation]
        rendered = templates.render(self.chat_template, chats, add_generation_prompt,
                                    self.special_tokens_map)
        return rendered if batched else rendered[0]

    @property
    def transformers(self):
        """transformers' own tokenizer of the folder (built on first use)."""
        if self._hf is None:
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(self.folder)
        return self._hf

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.transformers, name)


def _key(folder: Path) -> bytes:
    """The digest of every file in the folder but the weights and batchllm's own (by content:
    a copied folder, or a test's fresh one, finds the same entry; ~10 ms for SmolLM2's)."""
    h = hashlib.sha256()
    for f in sorted(folder.rglob("*")):
        if f.is_file() and not f.name.endswith(_WEIGHTS) and not f.name.startswith("batchllm_"):
            h.update(f"{f.relative_to(folder)}\0".encode())
            h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.digest()


def load(folder: Path):
    """The fast tokenizer a run uses: a Tokenizer from the cache, else transformers' (whose
    backend and settings are cached then, where its backend alone gives the same results)."""
    path = hf_cache.cache_file("tokenizer", _key(folder))
    backend = path.with_suffix(".backend.json")
    with contextlib.suppress(OSError, ValueError, KeyError):
        state = json.loads(path.read_text())
        if state["exact"] and backend.is_file():
            return Tokenizer(folder, state, backend)
    hf = load_tokenizer(folder)
    # the clean-up of decoded spaces is skipped for BPE models (transformers' _decode)
    exact = not (hf.clean_up_tokenization_spaces
                 and type(hf.backend_tokenizer.model).__name__ != "BPE")
    state = {"exact": exact}
    if exact:
        try:
            template = hf.get_chat_template()
        except ValueError:  # the tokenizer has none
            template = None
        state.update(split_special_tokens=bool(hf.split_special_tokens),
                     special_tokens_map=hf.special_tokens_map, chat_template=template,
                     eos_token_id=hf.eos_token_id, bos_token_id=hf.bos_token_id,
                     pad_token_id=hf.pad_token_id)
        hf_cache.write(backend, hf.backend_tokenizer.to_str())
    hf_cache.write(path, state)  # last: its presence says the backend file is complete
    return hf


def load_tokenizer(folder: Path):
    """The folder's fast tokenizer, transformers' own (AutoTokenizer)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    if not tokenizer.is_fast:
        raise ModelNotFoundError(f"model.path: {folder}: no fast tokenizer (tokenizer.json)")
    return tokenizer


def lazy_token_pieces(path: str, revision: str | None = None):
    """`piece(token_id, first=False) -> (text, bytes)` for the model at `path` (an alias, folder,
    file or hub id): token_pieces of its tokenizer, loaded at the first call, so a caller that
    never asks loads none."""
    piece = None

    def lazy(token_id: int, first: bool = False) -> tuple[str, bytes]:
        nonlocal piece
        if piece is None:
            piece = token_pieces(load(resolve_model(path, revision)))
        return piece(token_id, first)

    return lazy


def _byte_level_alphabet() -> dict[str, int]:
    """The byte each character of a byte-level BPE vocabulary stands for (GPT-2's table, which
    the tokenizers library's ByteLevel uses): printable bytes as themselves, the others shifted
    past 255 in order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: b for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = 256 + n
    return {chr(c): b for b, c in chars.items()}


# the decoders of a SentencePiece-style vocabulary (Llama 2, Mistral, Gemma): "▁" for a space
# (Replace or Metaspace), byte-fallback tokens <0xHH> (ByteFallback), the start's space stripped
# (Strip, Metaspace); a decoder of these alone is read as one
_SENTENCEPIECE = {"Replace", "Metaspace", "ByteFallback", "Fuse", "Strip"}


def _fallback_byte(raw: str) -> int | None:
    """The byte of a byte-fallback token ("<0xE3>"), as the ByteFallback decoder reads it."""
    if len(raw) == 6 and raw.startswith("<0x") and raw.endswith(">"):
        with contextlib.suppress(ValueError):
            return int(raw[3:5], 16)
    return None


def token_pieces(tokenizer):
    """`piece(token_id, first=False) -> (text, bytes)`: the token's text and its bytes (OpenAI's
    `bytes` of a log-probability), such that the bytes of a sequence's tokens joined are its
    decoded text's UTF-8 (where they are UTF-8: the decode writes U+FFFD for bytes that are
    not). The tokenizer's kind is read from its backend (its decoders):

    - byte-level BPE (GPT-2, Llama 3, Qwen): the text decoded alone, the bytes the token holds
      (one that splits a character decodes alone to U+FFFD; its bytes are its share of it);
    - SentencePiece-style (decoders Replace "▁" / Metaspace, ByteFallback, Fuse, Strip: Llama 2,
      Mistral, Gemma): a byte-fallback token <0xHH> of a byte past ASCII (part of a character)
      decodes alone to U+FFFD and its bytes are that one byte; any other token: its text as it
      reads after another token ("▁Hello": " Hello") and that text's UTF-8. `first`: the token
      as it reads first in a sequence, where a Strip or Metaspace decoder drops the leading
      space (decoded alone: "Hello"), as the decode of a completion does with its first token;
    - other tokenizers, and added tokens: the text decoded alone and its UTF-8."""
    backend = getattr(tokenizer, "_backend", None) or getattr(tokenizer, "backend_tokenizer", None)
    decoder = (json.loads(backend.to_str()).get("decoder") or {}) if backend else {}
    kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
    alphabet = _byte_level_alphabet() if "ByteLevel" in kinds else None
    spm = alphabet is None and kinds <= _SENTENCEPIECE  # (no decoder: kinds is {None})
    added = set(backend.get_added_tokens_decoder()) if alphabet or spm else set()

    anchor = backend.decoder.decode(["a"]) if spm else ""  # another token, decoded alone

    def after_another(raw: str) -> str | None:
        """The token's text decoded after another token's (no start to strip), by the
        backend's own decoder; None where that other token's text does not stay in front."""
        both = backend.decoder.decode(["a", raw])
        return both[len(anchor):] if both.startswith(anchor) else None

    @functools.cache  # a results file asks for the same ids over and over (every top-k)
    def piece(token_id: int, first: bool = False) -> tuple[str, bytes]:
        text = tokenizer.decode([token_id])
        kept = (alphabet or spm) and token_id not in added
        raw = backend.id_to_token(token_id) if kept else None
        if raw is not None and spm:
            byte = _fallback_byte(raw) if "ByteFallback" in kinds else None
            if byte is not None and byte >= 0x80:
                return text, bytes([byte])
            if not first:
                text = after_another(raw) or text
            return text, text.encode()
        if not alphabet or raw is None or any(c not in alphabet for c in raw):
            return text, text.encode()
        return text, bytes(alphabet[c] for c in raw)

    return piece


def eos_token_ids(folder: Path, config: Any, tokenizer: Any) -> set[int]:
    """Token ids that end a sequence: generation_config.json's eos_token_id (int or list; the
    model config's when that file has none) plus the tokenizer's eos token.

    The HF reference in the tests passes this same set to `generate`.
    """
    ids: set[int] = set()
    gen_file = Path(folder) / "generation_config.json"
    gen_eos = None
    if gen_file.is_file():
        gen_eos = json.loads(gen_file.read_text()).get("eos_token_id")
    if gen_eos is None:
        gen_eos = getattr(config, "eos_token_id", None)
    if isinstance(gen_eos, int):
        ids.add(gen_eos)
    elif gen_eos is not None:
        ids.update(int(i) for i in gen_eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids
