"""Bad rows in real JSON Lines, CSV and OpenAI Batch files, through real jobs on the tiny random
Llama: each bad row (or line) is an error row naming its field, the others complete."""

from __future__ import annotations

import json

import pytest
from bad_inputs import DEEP_ARRAY, job_file, output_rows
from job_files import run_in_process

from batchllm import run_job
from batchllm.config import SAMPLING_FIELDS, InputConfig
from batchllm.rows import json_lines
from batchllm.rows.blocks import count_rows
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


RAGGED_CSV = (b"prompt,temperature,max_tokens\n"
              b"Does clause 4 allow subletting?,0.5,\n"
              b"Who pays, the tenant or the landlord?,0.5,2\n"  # an unquoted comma: 4 fields
              b'"Name a clause\nof the lease.",0,2\n'  # one record on lines 4-5
              b"Name a party.,0.7\n"  # cut short: polars padded it with a null
              b"\n"
              b'"Who \xff pays?",0.5,\n'
              b"Name a clause.,hot,\n"
              b'"What law, if any, governs it?",,1\r\n')
RAGGED_ERRORS = {
    1: "input.prompt_column: CSV record on line 3 has 4 fields, the header has 3",
    3: "input.prompt_column: CSV record on line 6 has 2 fields, the header has 3",
    4: "input.prompt_column: CSV line 7 is empty, the header has 3 fields",
    5: "input.prompt_column: prompt is not valid UTF-8",
    6: 'sampling.temperature (a per-row input column): expected a number, got "hot"',
}


def test_ragged_csv_records_are_error_rows(tmp_path) -> None:
    """A CSV record with more fields than the header (polars refused the whole file: exit 2),
    with fewer (polars padded it with nulls: it ran on the job's defaults) or none (a blank
    line: a row of nulls) fails its own row, naming its line (a quoted cell spanning lines
    counted); the other rows run with their cells as polars reads them (a bad byte and a word
    among numbers still fail their rows), and `plan` and the row count agree with `run`."""
    path = tmp_path / "in.csv"
    path.write_bytes(RAGGED_CSV)
    job = job_file(tmp_path, "ragged", {"path": str(path)}, ignore_eos=True)
    proc = run_in_process("run", str(job), "--quiet")
    assert proc.returncode == 3, proc.stderr
    out = output_rows(job)
    assert list(out) == list(range(8))
    for row, why in RAGGED_ERRORS.items():
        assert out[row]["error"] == why and out[row]["finish_reason"] == "error", out[row]
    assert [out[r]["completion_tokens"] for r in (0, 2, 7)] == [3, 2, 1]  # its max_tokens
    assert all(out[r]["error"] is None for r in (0, 2, 7))
    rows = read_input(InputConfig(path=str(path)))
    assert rows.prompts[2] == "Name a clause\nof the lease."
    assert rows.prompts[7] == "What law, if any, governs it?"
    assert rows.overrides["max_tokens"] == [None, None, 2, None, None, None, None, 1]
    assert rows.overrides["temperature"][:3] == [0.5, None, 0.0]
    plan = run_in_process("plan", str(job))
    assert plan.returncode == 0, plan.stderr
    report = dict(line.split(None, 1) for line in plan.stdout.splitlines() if line.strip())
    assert (report["rows"], report["rows_with_errors"]) == ("8", "5")
    assert count_rows(InputConfig(path=str(path))) == 8


@pytest.mark.parametrize("spanning", [False, True])
def test_a_csv_record_cut_short_is_an_error_row_not_padded(tmp_path, spanning: bool) -> None:
    """polars reads a record with fewer fields than the header, or a blank line, padding it
    with nulls (the row ran on the job's defaults, or failed as a null prompt): it is an error
    row naming its line, found from the records of the rows with a null last cell (their lines
    counted from the newlines earlier cells hold). An empty last cell is no such record."""
    first = '"Does clause 4\nallow subletting?"' if spanning else "Does clause 4 allow subletting?"
    path = tmp_path / "in.csv"
    path.write_text(f"prompt,max_tokens\n{first},2\nName a party.\n\nWho pays?,\n"
                    f"What law governs it?,1\n")
    job = job_file(tmp_path, "short", {"path": str(path)}, ignore_eos=True)
    proc = run_in_process("run", str(job), "--quiet")
    assert proc.returncode == 3, proc.stderr
    out = output_rows(job)
    line = 4 if spanning else 3
    assert out[1]["error"] == \
        f"input.prompt_column: CSV record on line {line} has 1 field, the header has 2"
    assert out[2]["error"] == \
        f"input.prompt_column: CSV line {line + 1} is empty, the header has 2 fields"
    assert [out[r]["error"] for r in (0, 3, 4)] == [None] * 3
    assert [out[r]["completion_tokens"] for r in (0, 3, 4)] == [2, 3, 1]
    assert len(out) == count_rows(InputConfig(path=str(path))) == 5


def test_a_ragged_csv_record_with_ids_or_an_open_quote_refuses_the_file(tmp_path) -> None:
    """Where the rows have ids, a ragged record's id is unknown (a comma too many may be in
    any cell; a record cut short may be the start of the next): the file is refused, exit 2,
    naming the line, as with a broken JSON line (polars refused such a file, not naming it, or
    padded the record). A quote never closed swallows the rest of the file: refused, naming
    the line where its record starts, ids or not."""
    path = tmp_path / "in.csv"
    job = job_file(tmp_path, "ids", {"path": str(path)})
    start = "id,prompt,temperature\na,Does clause 4 allow subletting?,0.5\n"
    unknown = "so the row's 'id' is unknown"
    open_quote = ("the CSV record on line 3 opens a quote that is never closed (the file ends "
                  "inside it)")
    cases = [(start + "b,Who pays, the tenant?,0.5\nc,Name a party.\n",
              (f"CSV record on line 3 has 4 fields, the header has 3, {unknown}; 2 records "
               f"in all do not have the header's fields")),
             (start + "b,Who pays?,0.5\nc,Name a party.\n",
              f"CSV record on line 4 has 2 fields, the header has 3, {unknown}"),
             (start + 'b,"Who pays?,0.5\nc,Name a party.,0.5\n', open_quote),
             ('prompt\nDoes clause 4 allow subletting?\n"Who pays?\nName a party.\n', open_quote)]
    for text, why in cases:
        path.write_text(text)
        for command in ("run", "plan"):
            proc = run_in_process(command, str(job), *(["--quiet"] if command == "run" else []))
            assert proc.returncode == 2, proc.stderr
            assert proc.stderr.strip() == \
                f"batchllm: error: input.path: cannot read {path} as CSV: {why}", proc.stderr


def test_a_byte_order_mark_before_a_quoted_header_is_not_part_of_it(tmp_path) -> None:
    """Excel's "CSV UTF-8" begins with a byte-order mark, which polars drops: the count of the
    header's fields drops it too (it split '"prompt, text"' in two, and every record was
    ragged)."""
    path = tmp_path / "in.csv"
    path.write_bytes(b'\xef\xbb\xbf"prompt, text",max_tokens\n"a\nb",1\nc\nd,2\n')
    rows = read_input(InputConfig(path=str(path), prompt_column="prompt, text"))
    assert rows.prompts == ["a\nb", None, "d"]
    assert rows.errors == {
        1: "input.prompt_column: CSV record on line 4 has 1 field, the header has 2"}


def test_a_csv_of_numbers_alone_is_counted_with_its_short_record(tmp_path) -> None:
    """A file with no text column (its cells' newlines are counted in text columns only) and a
    record cut short: four rows, as `run` reads them."""
    path = tmp_path / "in.csv"
    path.write_text("a,b\n1,2\n3\n5,\n7,8\n")
    assert count_rows(InputConfig(path=str(path))) == 4
