"""Bad rows in real JSON Lines, CSV and OpenAI Batch files, through real jobs on the tiny random
Llama: each bad row (or line) is an error row naming its field, the others complete."""

from __future__ import annotations

import json

import pytest
from bad_inputs import DEEP_ARRAY, job_file, output_rows

from batchllm import run_job
from batchllm.config import SAMPLING_FIELDS, InputConfig
from batchllm.rows import json_lines
from batchllm.rows.openai_batch import parse_batch
from batchllm.rows.reader import read_input

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def _line(custom_id: str, url: str = CHAT, **body) -> bytes:
    if url == CHAT and "messages" not in body:
        body["messages"] = [{"role": "user", "content": "Does clause 4 allow subletting?"}]
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": body}).encode()


def _batch_lines() -> list[bytes]:
    return [
        _line("ok"),
        _line("big-temperature", temperature=10**400),
        _line("hot", temperature=2.5),
        _line("deep", metadata=json.loads("[" * 60 + "]" * 60)).replace(
            b"[" * 60 + b"]" * 60, DEEP_ARRAY.encode()),
        _line("utf8", messages=[{"role": "user", "content": "Who pays?"}]).replace(
            b"Who", b"Wh\xff"),
        _line("x-id").replace(b"x-id", b"x-\xfeid"),
        _line("surrogate", COMPLETIONS, prompt="Clause \ud800 says"),
        _line("five-stops", stop=["#1", "#2", "#3", "#4", "#5"]),
        _line("many-stops", stop=[f"#{i}" for i in range(17)]),
        b"",
        _line("big-max-tokens", max_tokens=2**31 + 5),
        _line("tiny-temperature", temperature=1e-50),
        _line("nan").replace(b'"body": {', b'"body": {"temperature": NaN, '),
        _line("ok-completion", COMPLETIONS, prompt="The tenant shall"),
        _line("inf", temperature=float("inf")),  # json.dumps writes Infinity
    ]


BATCH_ERRORS = {
    "big-temperature": "line 2: body.temperature: expected a number in 0..2, got 1000000000",
    "hot": "line 3: body.temperature: expected a number in 0..2, got 2.5",
    "line-4": "line 4: nested more than 64 levels deep at body.metadata[0][0][0]",
    "utf8": "line 5: body.messages[0].content: not valid UTF-8 text",
    "line-6": "line 6: custom_id: not valid UTF-8 text",
    "surrogate": "line 7: body.prompt: not valid UTF-8 text",
    "many-stops": "line 9: body.stop: expected at most 16 stop strings of at most 256 characters",
    "big-max-tokens": "line 11: body.max_tokens: expected an integer in 1..2147483647, got",
    "nan": "line 13: body.temperature: expected a number in 0..2, got NaN",
    "inf": "line 15: body.temperature: expected a number in 0..2, got Infinity",
}


def test_bad_openai_batch_lines_are_error_rows(tmp_path) -> None:
    path = tmp_path / "batch.jsonl"
    path.write_bytes(b"\n".join(_batch_lines()) + b"\n")
    job = job_file(tmp_path, "batch", {"path": str(path), "format": "openai-batch"})
    metrics = run_job(job, progress=False)
    out = output_rows(job)
    assert metrics["rows_error"] == len(BATCH_ERRORS) and metrics["rows"] == 14
    for key, row in out.items():
        if key in BATCH_ERRORS:
            assert row["error"].startswith(BATCH_ERRORS[key]), (key, row["error"])
        else:
            assert row["error"] is None and row["completion_tokens"] == 3, (key, row)
    assert out["tiny-temperature"]["completion"] == out["ok"]["completion"]  # greedy


@pytest.mark.parametrize("read_bytes", [1, 7, 64])
def test_batch_files_read_in_blocks_give_the_same_rows(tmp_path, monkeypatch,
                                                      read_bytes: int) -> None:
    """Lines split across blocks anywhere (a "\\r\\n" too): the rows and errors of the whole
    file split at once."""
    data = b"\r\n".join(_batch_lines()[:9]) + b"\n\n" + b"\n".join(_batch_lines()[9:]) + b"\r\n"
    path = tmp_path / "batch.jsonl"
    path.write_bytes(data)
    whole = parse_batch([("f", data.splitlines())], SAMPLING_FIELDS)
    monkeypatch.setattr(json_lines, "READ_BYTES", read_bytes)
    got = parse_batch([("f", json_lines.lines(str(path)))], SAMPLING_FIELDS)
    assert got == whole and len(got.ids) == 14


def test_bad_jsonl_and_csv_rows_are_error_rows(tmp_path) -> None:
    lines = [b'{"id": "a", "prompt": "Does clause 4 allow subletting?"}',
             b'{"id": "b", "prompt": "Who \xff pays?"}',
             b"",
             b'{"id": "c", "prompt": "Name a clause.", "stop": ' + DEEP_ARRAY.encode() + b"}",
             b'{"id": "d", "prompt": "Who pays?", "notes": ' + DEEP_ARRAY.encode() + b"}",
             b'{"id": "e", "prompt": "Name a party.", "temperature": 1e400}']
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_bytes(b"\n".join(lines) + b"\n")
    job = job_file(tmp_path, "jsonl", {"path": str(jsonl)})
    assert run_job(job, progress=False)["rows_error"] == 3
    out = output_rows(job)
    assert out["b"]["error"] == "input.prompt_column: prompt is not valid UTF-8"
    assert out["c"]["error"].startswith(
        "sampling.stop (a per-row input column): stop[0][0]")
    assert "is nested more than 64 levels deep" in out["c"]["error"]
    assert out["e"]["error"] == "temperature must be a finite number >= 0, got inf"
    assert out["a"]["completion_tokens"] == 3 == out["d"]["completion_tokens"]  # d: unread

    csv = tmp_path / "in.csv"
    csv.write_bytes(b'id,prompt\na,Does clause 4 allow subletting?\nb,"Who \xff\n pays?"\n'
                    b"c,Name a clause.\n")
    job = job_file(tmp_path, "csv", {"path": str(csv)})
    assert run_job(job, progress=False)["rows_error"] == 1
    out = output_rows(job)
    assert out["b"]["error"] == "input.prompt_column: prompt is not valid UTF-8"
    assert out["a"]["completion_tokens"] == 3 == out["c"]["completion_tokens"]


def test_cells_of_the_wrong_type_in_jsonl_and_csv_are_error_rows(tmp_path) -> None:
    """A JSON Lines or CSV cell that is not what its column holds (a word among numbers, a
    prompt that is a number, a list or an object, an integer past 64 bits) fails its own row,
    naming the field; the others run, their values as written (a seed of 2**63 + 5 is a seed,
    not the float pyarrow or polars would make of it; a schema written as a JSON object is a
    schema)."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    rows = [{"id": "ok", "prompt": "Does clause 4 allow subletting?", "temperature": 0.5},
            {"id": "hot", "prompt": "Who pays?", "temperature": "hot"},
            {"id": "num-prompt", "prompt": 5},
            {"id": "list-prompt", "prompt": ["a", "b"]},
            {"id": "obj-prompt", "prompt": {"x": 1}},
            {"id": "stop-5", "prompt": "Name a clause.", "stop": 5},
            {"id": "text-max", "prompt": "Name a party.", "max_tokens": "5"},
            {"id": "big-max", "prompt": "Name a party.", "max_tokens": 1e20},
            {"id": "u64-seed", "prompt": "Name a party.", "seed": 2**63 + 5, "temperature": 1.0},
            {"id": "i64-seed", "prompt": "Name a party.", "seed": 2**63 - 5, "temperature": 1.0},
            {"id": "schema", "prompt": "Give a.", "json_schema": schema, "max_tokens": 12},
            {"id": "stop-list", "prompt": "Name a clause.", "stop": ["zz", "yy"]}]
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    job = job_file(tmp_path, "jsonl", {"path": str(jsonl)})
    assert run_job(job, progress=False)["rows_error"] == 7
    out = output_rows(job)
    per_row = "(a per-row input column)"
    assert out["hot"]["error"] == f'sampling.temperature {per_row}: expected a number, got "hot"'
    assert out["num-prompt"]["error"] == "input.prompt_column: expected text, got 5"
    assert out["list-prompt"]["error"] == 'input.prompt_column: expected text, got ["a", "b"]'
    assert out["obj-prompt"]["error"] == 'input.prompt_column: expected text, got {"x": 1}'
    assert out["stop-5"]["error"] == \
        f"sampling.stop {per_row}: expected a string or a list of strings, got 5"
    assert out["text-max"]["error"] == f'sampling.max_tokens {per_row}: expected an integer, ' \
                                       f'got "5"'
    assert out["big-max"]["error"] == f"sampling.max_tokens {per_row}: {10**20} is out of " \
                                      f"range (64-bit integers)"
    for key in ("ok", "u64-seed", "i64-seed", "schema", "stop-list"):
        assert out[key]["error"] is None and out[key]["completion_tokens"] > 0, key
    assert out["schema"]["completion"].startswith('{"a": ')  # the schema held it
    seeds = read_input(InputConfig(path=str(jsonl))).overrides["seed"]
    assert seeds[8:10] == [2**63 + 5, 2**63 - 5]  # as written, not as floats

    csv = tmp_path / "in.csv"
    csv.write_text("id,prompt,temperature,seed\n"
                   "a,Does clause 4 allow subletting?,0.5,7\n"
                   "b,Who pays?,hot,\n"
                   f"c,Name a party.,,{2**63 + 5}\n"
                   f"d,Name a clause.,0,{2**70}\n")
    job = job_file(tmp_path, "csv", {"path": str(csv)})
    assert run_job(job, progress=False)["rows_error"] == 2
    out = output_rows(job)
    assert out["b"]["error"] == f'sampling.temperature {per_row}: expected a number, got "hot"'
    assert out["d"]["error"] == f"sampling.seed {per_row}: {2**70} is out of range (64-bit " \
                                f"integers)"
    assert out["a"]["completion_tokens"] == 3 == out["c"]["completion_tokens"]
