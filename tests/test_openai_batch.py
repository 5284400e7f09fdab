"""OpenAI Batch files: requests in (input.format: openai-batch), results out (output.format:
openai-batch); invalid lines become error rows naming the line and the field."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pyarrow as pa
import pytest
from hf_reference import tiny_model_folder
from job_files import run_in_process

from batchllm.config import SAMPLING_FIELDS, InputConfig, SamplingConfig
from batchllm.model.loader import job_model
from batchllm.rows.build import build_rows
from batchllm.rows.openai_batch import parse_batch
from batchllm.rows.openai_results import write_results
from batchllm.rows.reader import read_input

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
SCHEMA = {"type": "object", "properties": {"label": {"enum": ["yes", "no"]}},
          "required": ["label"]}


def _line(custom_id: str, url: str, **body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _batch_file() -> list[str]:
    """20 lines: 10 chat, 7 completions, one chat with response_format, two invalid."""
    lines = []
    for i in range(10):
        msgs = [{"role": "user", "content": f"Does clause {i} allow termination?"}]
        if i % 3 == 0:
            msgs.insert(0, {"role": "system", "content": "Answer in one word."})
        if i % 3 == 1:
            msgs[-1]["content"] = [{"type": "text", "text": f"Clause {i}:"},
                                   {"type": "text", "text": "who pays?"}]
        lines.append(_line(f"chat-{i}", CHAT, model="gpt-4o-mini", messages=msgs,
                           max_completion_tokens=3 + i % 3, temperature=0.7, seed=i))
    for i in range(7):
        lines.append(_line(f"cmpl-{i}", COMPLETIONS, model="x", max_tokens=4,
                           prompt=f"Clause {i}. The tenant shall" if i % 2 else
                           [f"Section {i} says"], stop=["\n\n"]))
    response_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    lines.insert(12, _line("structured", CHAT, messages=[{"role": "user", "content": "Yes?"}],
                           max_tokens=5, response_format=response_format))
    lines.insert(5, '{"custom_id": "broken", "method": "POST", "url": ')  # line 6
    lines.insert(15, _line("hot", CHAT, messages=[{"role": "user", "content": "Hi"}],
                           temperature="hot"))  # line 16
    assert len(lines) == 20
    return lines


def test_lines_map_onto_rows_and_sampling():
    b = parse_batch([("batch.jsonl", _batch_file())], SAMPLING_FIELDS)
    assert len(b.ids) == 20 and b.ids[5] == "line-6" and b.ids[15] == "hot"
    assert b.errors[5].startswith("line 6: not valid JSON")
    assert b.errors[15] == "line 16: body.temperature: expected a number in 0..2, got 'hot'"
    assert b.messages[0] == [{"role": "system", "content": "Answer in one word."},
                             {"role": "user", "content": "Does clause 0 allow termination?"}]
    assert b.messages[1] == [{"role": "user", "content": "Clause 1:\nwho pays?"}]
    assert b.prompts[0] is None and b.prompts[11] == "Section 0 says"  # a list of one prompt
    assert b.overrides["max_tokens"][:3] == [3, 4, 5] and b.overrides["seed"][2] == 2
    assert b.overrides["temperature"][0] == 0.7 and b.overrides["stop"][11] == ("\n\n",)
    structured = b.ids.index("structured")
    if "json_schema" in SAMPLING_FIELDS:
        assert json.loads(b.overrides["json_schema"][structured]) == SCHEMA
    else:  # the hook: an error until sampling.json_schema exists
        assert "sampling.json_schema is not supported by this batchllm yet" in b.errors[
            structured]


@pytest.mark.parametrize("line, error", [
    ({"custom_id": "a", "method": "GET", "url": CHAT, "body": {}}, "method: expected POST"),
    ({"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {}}, "url: expected"),
    ({"custom_id": "a", "method": "POST", "url": CHAT, "body": {"messages": []}},
     "body.messages: expected a non-empty list"),
    ({"custom_id": "a", "method": "POST", "url": CHAT,
      "body": {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}},
     "body.messages[0].content[0]: only text parts are supported"),
    ({"custom_id": "a", "method": "POST", "url": COMPLETIONS, "body": {"prompt": [1, 2]}},
     "body.prompt: expected a string"),
    ({"custom_id": "a", "method": "POST", "url": CHAT,
      "body": {"messages": [{"role": "user", "content": "x"}], "tools": []}},
     "body.tools: not supported by batchllm"),
    ({"custom_id": "a", "method": "POST", "url": COMPLETIONS,
      "body": {"prompt": "x", "max_tokens": 0}}, "body.max_tokens: expected an integer in 1..2147483647"),
    ({"custom_id": "", "method": "POST", "url": COMPLETIONS, "body": {"prompt": "x"}},
     "custom_id: expected a non-empty string"),
    ([1, 2], "line: expected a JSON object"),
])
def test_invalid_lines_name_line_and_field(line, error):
    ok = _line("first", COMPLETIONS, prompt="fine")
    b = parse_batch([("f", [ok, "", json.dumps(line)])], SAMPLING_FIELDS)
    assert list(b.errors) == [1] and b.errors[1].startswith(f"line 3: {error}")
    assert b.ids[0] == "first" and 0 not in b.errors


def test_duplicate_custom_id_is_an_error_row():
    b = parse_batch([("f", [_line("a", COMPLETIONS, prompt="x")] * 2)], SAMPLING_FIELDS)
    assert b.ids == ["a", "line-2"] and b.errors == {
        1: "line 2: custom_id: 'a' is used by an earlier line"}


def test_build_rows_templates_chat_rows_only(tmp_path):
    path = tmp_path / "batch.jsonl"
    path.write_text("\n".join(_batch_file()) + "\n")
    cfg = InputConfig(path=str(path), format="openai-batch")
    source = read_input(cfg)
    assert source.ids.type == pa.string() and source.num_rows == 20
    tokenizer, _ = job_model(str(tiny_model_folder("llama")), None)
    rows = build_rows(tokenizer, cfg, SamplingConfig(max_tokens=9), source)
    chat, cmpl = rows[0], rows[11]
    assert chat.prompt.startswith("<|im_start|>system\nAnswer in one word.")
    assert cmpl.prompt == "Section 0 says"  # sent as it is, no template
    assert cmpl.prompt_ids.tolist() == tokenizer("Section 0 says")["input_ids"]
    assert chat.sampling.max_tokens == 3 and chat.sampling.temperature == 0.7
    assert cmpl.sampling.max_tokens == 4 and cmpl.sampling.stop == ("\n\n",)
    assert rows[5].error.startswith("line 6: not valid JSON") and rows[5].finish_reason == "error"


def test_results_lines_have_openai_shape():
    table = pa.table({"id": ["a", "b"], "completion": ["Yes.", None],
                      "finish_reason": ["stop", "error"], "prompt_tokens": [7, 3],
                      "completion_tokens": [2, 0], "cached_tokens": [4, 0],
                      "error": [None, "line 2: body.prompt: expected a string"]})
    buf = io.BytesIO()
    write_results(table, buf, ["chat", "completion"], "tiny", 1700000000)
    ok, bad = [json.loads(x) for x in buf.getvalue().decode().splitlines()]
    assert ok["custom_id"] == "a" and ok["error"] is None and ok["id"].startswith("batch_req_")
    body = ok["response"]["body"]
    assert ok["response"]["status_code"] == 200 and body["object"] == "chat.completion"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Yes."},
                                "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9,
                             "prompt_tokens_details": {"cached_tokens": 4}}
    assert bad == {"id": bad["id"], "custom_id": "b", "response": None, "error": {
        "code": "request_failed", "message": "line 2: body.prompt: expected a string"}}


def test_results_carry_logprobs_in_openai_shape(smollm2_folder):
    """The `logprobs` column as OpenAI writes it: chat content entries with the token's text and
    bytes; completions' tokens / token_logprobs / top_logprobs."""
    from batchllm.model.tokenizer import load_tokenizer, token_pieces

    tokenizer = load_tokenizer(smollm2_folder)
    hello, world = tokenizer.encode("Hello world", add_special_tokens=False)[:2]
    values = [{"token_id": hello, "logprob": -0.5, "top": [{"token_id": world, "logprob": -1.5}]}]
    table = pa.table({"id": ["a", "b"], "completion": ["Hello", "Hello"],
                      "finish_reason": ["length", "length"], "prompt_tokens": [3, 3],
                      "completion_tokens": [1, 1], "cached_tokens": [0, 0], "error": [None, None],
                      "logprobs": [values, values]})
    buf = io.BytesIO()
    write_results(table, buf, ["chat", "completion"], "m", 1, token_pieces(tokenizer))
    chat, cmpl = [json.loads(x)["response"]["body"]["choices"][0]["logprobs"]
                  for x in buf.getvalue().decode().splitlines()]
    word = tokenizer.decode([world])
    assert chat == {"content": [{"token": "Hello", "logprob": -0.5, "bytes": list(b"Hello"),
                                 "top_logprobs": [{"token": word, "logprob": -1.5,
                                                   "bytes": list(word.encode())}]}]}
    assert cmpl == {"tokens": ["Hello"], "token_logprobs": [-0.5],
                    "top_logprobs": [{word: -1.5}]}


def test_a_tokens_bytes_are_its_share_of_a_character_it_splits():
    """OpenAI's `bytes` of a log-probability: a byte-level token that splits a character
    decodes alone to U+FFFD, and its bytes are what it holds, so the tokens' bytes joined are
    the text's UTF-8 (the text's own encoding of each token alone gave U+FFFD's bytes)."""
    from batchllm.model.tokenizer import load, token_pieces

    tokenizer = load(tiny_model_folder("llama"))
    piece = token_pieces(tokenizer)
    for text in ("はい、日本語です。", "Ünïcödé naïve café", "plain ascii", "emoji 🙂 too"):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        pieces = [piece(i) for i in ids]
        assert b"".join(raw for _, raw in pieces) == tokenizer.decode(ids).encode(), text
        assert [t for t, _ in pieces] == [tokenizer.decode([i]) for i in ids]
    split = [piece(i) for i in tokenizer("はい", add_special_tokens=False)["input_ids"]]
    assert any(t == "\ufffd" for t, _ in split)  # a token the old bytes got wrong
    eos = tokenizer.eos_token_id  # an added token: its text's bytes
    assert piece(eos) == (tokenizer.decode([eos]), tokenizer.decode([eos]).encode())


def _sentencepiece_tokenizer(style: str):
    """A Llama-2-style tokenizer made offline: BPE with byte fallback over a small vocabulary
    (<unk> <s> </s>, the 256 tokens <0x00>..<0xFF>, a few "▁" words), no Japanese or emoji, so
    those fall back to bytes. style: "llama2" (Llama 2's tokenizer.json: Prepend and Replace
    normalizer, decoders Replace "▁", ByteFallback, Fuse, Strip), "llama2-metaspace" (what
    transformers 5's LlamaTokenizer builds: a Metaspace pre-tokenizer, the same decoders),
    "gemma" (Replace normalizer, no Strip: a first token keeps its space), "metaspace" (the
    Metaspace decoder, then ByteFallback and Fuse)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    merges = [("▁", "H"), ("▁H", "e"), ("l", "l"), ("ll", "o"), ("▁He", "llo"), ("▁", "w"),
              ("o", "r"), ("or", "ld"), ("▁w", "orld"), ("▁", "t"), ("▁t", "o")]
    for token in ["▁", "H", "e", "l", "o", "w", "r", "d", "t", "ld", *map("".join, merges)]:
        vocab.setdefault(token, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>",
                               byte_fallback=True, fuse_unk=True))
    llama = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
             decoders.Strip(" ", 1, 0)]
    if style == "llama2":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                               normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence(llama)
    elif style == "llama2-metaspace":
        tok.pre_tokenizer = pre_tokenizers.Metaspace("▁", prepend_scheme="first", split=False)
        tok.decoder = decoders.Sequence(llama)
    elif style == "gemma":
        tok.normalizer = normalizers.Replace(" ", "▁")
        tok.decoder = decoders.Sequence(llama[:3])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace("▁", prepend_scheme="first", split=False)
        tok.decoder = decoders.Sequence([decoders.Metaspace("▁", prepend_scheme="first",
                                                            split=False), *llama[1:3]])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


@pytest.mark.parametrize("style", ["llama2", "llama2-metaspace", "gemma", "metaspace"])
def test_a_byte_fallback_tokens_bytes_are_its_byte(style: str, tmp_path: Path):
    """SentencePiece-style tokenizers: a byte-fallback token (<0xE3>, part of a character
    outside the vocabulary) decodes alone to U+FFFD, and its bytes are its one byte; a "▁" word
    reads with its space ("▁Hello": " Hello"), but first in a sequence as the completion's
    decode gives it (a Strip or Metaspace decoder drops that space). So the tokens' bytes joined
    are the decoded text's UTF-8, through transformers' tokenizer and through load()'s own."""
    from batchllm.model.tokenizer import load, token_pieces

    hf = _sentencepiece_tokenizer(style)
    hf.save_pretrained(tmp_path)
    load(tmp_path)  # transformers' tokenizer, and its backend cached
    for tokenizer in (hf, load(tmp_path)):
        piece = token_pieces(tokenizer)
        for text in ("Hello world", "はい、日本語です。", "Hello 🙂 world to", " Hello  to\nい",
                     "to はい"):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            pieces = [piece(i, first=k == 0) for k, i in enumerate(ids)]
            decoded = tokenizer.decode(ids)
            assert b"".join(raw for _, raw in pieces) == decoded.encode(), (style, text)
            if "\ufffd" not in "".join(t for t, _ in pieces):  # no character split
                assert "".join(t for t, _ in pieces) == decoded, (style, text)
        japanese = tokenizer("はい", add_special_tokens=False)["input_ids"]
        assert "<0xE3>" in hf.convert_ids_to_tokens(japanese)  # it fell back to bytes
        assert piece(hf.convert_tokens_to_ids("<0xE3>")) == ("\ufffd", b"\xe3")
        assert piece(hf.convert_tokens_to_ids("<0x0A>")) == ("\n", b"\n")
        hello = hf.convert_tokens_to_ids("▁Hello")
        assert piece(hello) == (" Hello", b" Hello")
        first = " Hello" if style == "gemma" else "Hello"
        assert piece(hello, first=True) == (first, first.encode())
        eos = tokenizer.eos_token_id  # an added token: its text's bytes
        assert piece(eos) == ("</s>", b"</s>")
    # a results file's chat entries: the first token read as the completion's first
    ids = hf("Hello world to", add_special_tokens=False)["input_ids"]
    values = [{"token_id": i, "logprob": -1.0, "top": []} for i in ids]
    table = pa.table({"id": ["a"], "completion": [hf.decode(ids)], "finish_reason": ["length"],
                      "prompt_tokens": [3], "completion_tokens": [len(ids)],
                      "cached_tokens": [0], "error": [None], "logprobs": [values]})
    buf = io.BytesIO()
    write_results(table, buf, ["chat"], "m", 1, token_pieces(hf))
    content = json.loads(buf.getvalue())["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert bytes(b for e in content for b in e["bytes"]) == hf.decode(ids).encode()


def test_batch_file_round_trips_through_a_job(tmp_path: Path):
    (tmp_path / "batch.jsonl").write_text("\n".join(_batch_file()) + "\n")
    job = {"name": "openai", "model": {"path": str(tiny_model_folder("llama")), "device": "cpu"},
           "input": {"path": str(tmp_path / "batch.jsonl"), "format": "openai-batch"},
           "output": {"path": str(tmp_path / "out" / "results.jsonl"), "format": "openai-batch"},
           "sampling": {"max_tokens": 6}, "engine": {"kv_cache_memory": "64MiB"}}
    (tmp_path / "job.yaml").write_text(json.dumps(job))
    proc = run_in_process("run", str(tmp_path / "job.yaml"), "--quiet")
    assert proc.returncode == 3, proc.stderr  # finished, with error rows
    results = [json.loads(x) for x in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    wanted = [json.loads(x)["custom_id"] if i != 5 else "line-6"
              for i, x in enumerate(_batch_file())]
    assert [r["custom_id"] for r in results] == wanted  # each once, in input order
    errors = {r["custom_id"]: r["error"]["message"] for r in results if r["error"]}
    expected_errors = {"line-6", "hot"} | (set() if "json_schema" in SAMPLING_FIELDS
                                           else {"structured"})
    assert set(errors) == expected_errors
    assert errors["hot"] == "line 16: body.temperature: expected a number in 0..2, got 'hot'"
    assert errors["line-6"].startswith("line 6: not valid JSON")
    for r in results:
        if r["error"]:
            assert r["response"] is None
            continue
        body = r["response"]["body"]
        chat = r["custom_id"].startswith(("chat", "structured"))
        assert body["object"] == ("chat.completion" if chat else "text_completion")
        choice, = body["choices"]
        text = choice["message"]["content"] if chat else choice["text"]
        assert isinstance(text, str) and choice["finish_reason"] in ("stop", "length")
        usage = body["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert 1 <= usage["completion_tokens"] <= 6
    chat0 = next(r for r in results if r["custom_id"] == "chat-0")
    assert chat0["response"]["body"]["usage"]["completion_tokens"] <= 3  # its own max tokens
