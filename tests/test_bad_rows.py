"""Bad rows in a real Parquet file, through a real job on the tiny random Llama: each bad row is
an error row naming its field, the good rows (the other rows of the same row group) complete,
and the command exits 3."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
from bad_inputs import (
    DEEP_SCHEMA,
    job_file,
    messages_column,
    output_rows,
    text_column,
    texts_column,
    write_parquet,
)
from job_files import run_in_process

from batchllm import run_job

PROMPT = "Does clause 4 allow the tenant to end the lease early?"
# id -> (prompt, max_tokens, temperature, json_schema, stop, regex), None: the job's default
ROWS = {
    "ok": (PROMPT, None, None, None, None, None),
    "utf8-prompt": (b"Does clause \xff\xfe allow it?", None, None, None, None, None),
    "max-tokens-int64": (PROMPT, 2_147_483_653, None, None, None, None),
    "inf-temperature": (PROMPT, None, float("inf"), None, None, None),
    "tiny-temperature": (PROMPT, None, 1e-50, None, None, None),
    "deep-schema": (PROMPT, None, None, DEEP_SCHEMA, None, None),
    "many-stops": (PROMPT, None, None, None, [f"#{i}" for i in range(17)], None),
    "long-stop": (PROMPT, None, None, None, ["x" * 257], None),
    "utf8-stop": (PROMPT, None, None, None, ["\n\n", b"\xc3("], None),
    "utf8-regex": (PROMPT, None, None, None, None, b"(yes|no\xe2\x82)"),
    b"id-\xfe": ("Who pays for repairs?", None, None, None, None, None),
    "capped": ("Summarize clause 9.", 2_000_000_000, None, None, None, None),
    "ok-last": ("Who pays for repairs?", None, None, None, None, None),
}
ERRORS = {
    "utf8-prompt": "input.prompt_column: prompt is not valid UTF-8 (byte 0xff at position 12)",
    "max-tokens-int64": "max_tokens must be an integer in 1..2147483647, got 2147483653",
    "inf-temperature": "temperature must be a finite number >= 0, got inf",
    "deep-schema": "json_schema is nested more than 64 levels deep at properties.a.properties",
    "many-stops": "stop: at most 16 stop strings of at most 256 characters each, got 17",
    "long-stop": "stop: at most 16 stop strings of at most 256 characters each, got 1 strings, "
                 "the longest 257",
    "utf8-stop": "sampling.stop (a per-row input column): stop[1] is not valid UTF-8 (byte 0xc3",
    "utf8-regex": "sampling.regex (a per-row input column): regex is not valid UTF-8 (byte 0xe2",
    "id-\\xfe": "input.id_column: id is not valid UTF-8 (byte 0xfe at position 3); the row's id",
}


def _parquet(tmp_path):
    cols = list(zip(*ROWS.values()))
    return write_parquet(tmp_path / "in.parquet", {
        "id": text_column(list(ROWS)),
        "prompt": text_column(list(cols[0])),
        "max_tokens": pa.array(cols[1], pa.int64()),
        "temperature": pa.array(cols[2], pa.float64()),
        "json_schema": pa.array(cols[3], pa.string()),
        "stop": texts_column(list(cols[4])),
        "regex": text_column(list(cols[5])),
    })


def test_bad_parquet_rows_are_error_rows_and_the_job_exits_3(tmp_path) -> None:
    job = job_file(tmp_path, "rows", {"path": str(_parquet(tmp_path))})
    done = run_in_process("run", str(job), "--quiet")
    assert done.returncode == 3, done.stderr
    out = output_rows(job)
    assert list(out) == [k.decode("utf-8", "backslashreplace") if isinstance(k, bytes) else k
                         for k in ROWS]
    for key, row in out.items():
        if key in ERRORS:
            assert row["finish_reason"] == "error" and row["completion"] is None, key
            assert row["error"].startswith(ERRORS[key]), (key, row["error"])
        else:
            assert row["error"] is None and row["completion"], (key, row)
    assert out["ok"]["completion_tokens"] == 3 == out["ok-last"]["completion_tokens"]
    # a temperature float32 cannot hold (1e-50 is 0 there) is greedy, not NaN probabilities
    assert out["tiny-temperature"]["completion"] == out["ok"]["completion"]
    # max_tokens within int32 but past the model's room: capped there, as vLLM does
    capped = out["capped"]
    assert capped["finish_reason"] == "length"
    assert capped["prompt_tokens"] + capped["completion_tokens"] == 96


def test_bad_message_content_is_an_error_row(tmp_path) -> None:
    path = write_parquet(tmp_path / "chats.parquet", {
        "id": pa.array(["a", "b", "c"]),
        "messages": messages_column(["What is a lease?", b"Who \xe9 pays?", "Name a clause."]),
    })
    metrics = run_job(job_file(tmp_path, "chats", {"path": str(path),
                                                  "messages_column": "messages"}),
                      progress=False)
    out = output_rows(tmp_path / "chats.yaml")
    assert metrics["rows_error"] == 1 and metrics["rows_ok"] == 2
    assert out["b"]["error"] == ("input.messages_column: messages[1].content is not valid UTF-8 "
                                 "(byte 0xe9 at position 4)")
    assert out["a"]["completion_tokens"] == 3 == out["c"]["completion_tokens"]


def test_a_null_role_or_content_is_an_error_row_naming_it(tmp_path) -> None:
    """Parquet's message structs may hold nulls: the row's error names the message and its
    field (the chat template's own message was "'dict object' has no attribute 'role'")."""
    kind = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    msgs = pa.array([[{"role": "user", "content": "What is a lease?"}],
                     [{"role": "user", "content": "Hi."}, None, {"role": None, "content": "Who?"}],
                     [{"role": "user", "content": None}],
                     [None, {"role": "user", "content": "Name a clause."}]], kind)
    path = tmp_path / "chats.parquet"
    pq.write_table(pa.table({"id": ["a", "b", "c", "d"], "messages": msgs}), path)
    job = job_file(tmp_path, "chats", {"path": str(path), "messages_column": "messages"})
    assert run_job(job, progress=False)["rows_error"] == 2
    out = output_rows(job)
    assert out["b"]["error"] == "input.messages_column: messages[2].role is null"  # null kept
    assert out["c"]["error"] == "input.messages_column: messages[0].content is null"
    assert out["a"]["completion_tokens"] == 3 == out["d"]["completion_tokens"]  # null left out


def test_a_float_max_tokens_past_int64_is_an_error_row(tmp_path) -> None:
    """pandas writes an integer column with nulls as floats: a max_tokens of 1e20 there is its
    row's error (the plan's int64 count of every setting's max_tokens raised OverflowError, and
    the job ended with exit 1)."""
    path = tmp_path / "floats.parquet"
    pq.write_table(pa.table({"id": ["a", "b", "c"],
                             "prompt": ["What is a lease?", "Who pays?", "Name a clause."],
                             "max_tokens": pa.array([4.0, 1e20, None])}), path)
    job = job_file(tmp_path, "floats", {"path": str(path)})
    assert run_job(job, progress=False)["rows_error"] == 1
    out = output_rows(job)
    assert out["b"]["error"].startswith("max_tokens must be an integer in 1..2147483647, got 1")
    assert out["a"]["completion_tokens"] == 4 and out["c"]["completion_tokens"] == 3
