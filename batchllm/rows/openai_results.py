"""The OpenAI Batch results file (output.format: openai-batch): one JSON line per input row, in
input order.

A row that ran: `{"id", "custom_id", "response": {"status_code": 200, "request_id", "body"},
"error": null}`, the body shaped as the endpoint answers (chat.completion with a message, or
text_completion with text), with `choices` (one per sample), `finish_reason` and `usage`
(prompt_tokens_details.cached_tokens: the prompt tokens taken from a shared prefix). A row that
failed: `"response": null, "error": {"code", "message"}`. Ids are derived from the model and the
custom_id, so a resumed job writes the same ids.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from typing import IO, Any

import pyarrow as pa

from batchllm.rows.record import ERROR


def _hex(*parts: object) -> str:
    return hashlib.blake2b("\x00".join(map(str, parts)).encode(), digest_size=12).hexdigest()


# (a token id, whether it is the completion's first) -> its (text, bytes): as it reads in the
# completion's text (model/tokenizer.py token_pieces: a SentencePiece token's leading space is
# dropped first only), its bytes as the token holds them (a token that splits a character:
# its share, where its text is U+FFFD)
TokenPiece = Callable[[int, bool], tuple[str, bytes]]


def _logprobs(kind: str, values: list[dict] | None, text: TokenPiece | None) -> dict | None:
    """The `logprobs` column of one line in OpenAI's shape: chat `{"content": [{token, logprob,
    bytes, top_logprobs}]}`, completions `{tokens, token_logprobs, top_logprobs}`."""
    if values is None or text is None:
        return None
    if kind == "chat":
        def entry(token_id: int, logprob: float, first: bool) -> dict:
            t, raw = text(token_id, first)
            return {"token": t, "logprob": logprob, "bytes": list(raw)}

        return {"content": [{**entry(v["token_id"], v["logprob"], n == 0),
                             "top_logprobs": [entry(a["token_id"], a["logprob"], n == 0)
                                              for a in v["top"]]}
                            for n, v in enumerate(values)]}
    return {"tokens": [text(v["token_id"], n == 0)[0] for n, v in enumerate(values)],
            "token_logprobs": [v["logprob"] for v in values],
            "top_logprobs": [{text(a["token_id"], n == 0)[0]: a["logprob"] for a in v["top"]}
                             for n, v in enumerate(values)]}


def _choice(kind: str, index: int, line: dict, text: TokenPiece | None) -> dict:
    choice: dict[str, Any] = {"index": index}
    if kind == "chat":
        choice["message"] = {"role": "assistant", "content": line["completion"]}
    else:
        choice["text"] = line["completion"]
    choice["logprobs"] = _logprobs(kind, line.get("logprobs"), text)
    choice["finish_reason"] = line["finish_reason"]
    return choice


def result_line(kind: str, samples: list[dict], model: str, created: int,
                text: TokenPiece | None = None) -> dict:
    """One results line from the output rows of one input row (one per sample, in order)."""
    first = samples[0]
    custom_id = str(first["id"])
    line: dict[str, Any] = {"id": f"batch_req_{_hex(model, custom_id)}", "custom_id": custom_id}
    if first["finish_reason"] == ERROR:
        return {**line, "response": None,
                "error": {"code": "request_failed", "message": first["error"]}}
    completion = sum(s["completion_tokens"] for s in samples)
    body = {
        "id": f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{_hex('body', model, custom_id)}",
        "object": "chat.completion" if kind == "chat" else "text_completion",
        "created": created,
        "model": model,
        "choices": [_choice(kind, s.get("sample", k), s, text) for k, s in enumerate(samples)],
        "usage": {"prompt_tokens": first["prompt_tokens"], "completion_tokens": completion,
                  "total_tokens": first["prompt_tokens"] + completion,
                  "prompt_tokens_details": {"cached_tokens": first["cached_tokens"]}},
    }
    return {**line, "response": {"status_code": 200,
                                 "request_id": f"req_{_hex('req', model, custom_id)}",
                                 "body": body},
            "error": None}


def write_results(groups: pa.Table | Iterable[pa.Table], f: IO[bytes], kinds: list[str] | str,
                  model: str, created: int, text: TokenPiece | None = None) -> None:
    """The final table, or its groups in order (each holding whole rows), as results lines,
    written group by group. With a `sample` column, consecutive lines of one id are its samples.
    kinds: per input row, or for all rows, "chat" or "completion"; text: a token id's text and
    bytes, for the log-probabilities (the `logprobs` column)."""
    row = 0
    for table in [groups] if isinstance(groups, pa.Table) else groups:
        lines = table.to_pylist()
        k = 0
        while k < len(lines):
            end = k + 1
            while (end < len(lines) and "sample" in lines[end]
                   and lines[end]["id"] == lines[k]["id"]):
                end += 1
            kind = kinds if isinstance(kinds, str) else kinds[row]
            out = result_line(kind, lines[k:end], model, created, text)
            f.write((json.dumps(out, ensure_ascii=False) + "\n").encode())
            row, k = row + 1, end
        table = lines = None  # let go before the next group is read
