"""Structured output on SmolLM2: a job of 54 rows with three JSON schemas (nested objects, enums,
arrays, required fields), regexes and choices, job-wide and per row; every `stop` row parses and
validates, greedy output equals transformers under the same mask, a bad schema is an error row."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from grammar_reference import hf_constrained_greedy
from hf_reference import assert_tokens_match, first_divergence

from batchllm.job import run_job

pytestmark = pytest.mark.slow  # a job on the real SmolLM2 model

PERSON = {  # the job-wide schema, given as a file
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["buyer", "seller", "agent"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
CONTRACT = {  # nested object, enum, optional field
    "type": "object",
    "properties": {
        "party": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 24},
                           "country": {"enum": ["US", "UK", "DE", "FR"]}},
            "required": ["name", "country"],
            "additionalProperties": False,
        },
        "amount": {"type": "integer"},
        "signed": {"type": "boolean"},
    },
    "required": ["party", "signed"],
    "additionalProperties": False,
}
LABELS = {  # array of enums with bounds
    "type": "object",
    "properties": {
        "labels": {"type": "array", "items": {"enum": ["urgent", "legal", "finance", "other"]},
                   "minItems": 1, "maxItems": 3},
        "score": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["labels", "score"],
    "additionalProperties": False,
}
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"
MOODS = ["positive", "negative", "neutral"]
TOPICS = ["a late payment", "a software licence", "an office lease", "a supply contract",
          "a merger", "a loan", "a consulting deal", "a trademark"]


def job_rows() -> list[dict]:
    """54 rows: 14 per schema, 6 regex, 6 choice; then a bad schema and two constraints."""
    rows = []
    for i in range(14):
        t = TOPICS[i % len(TOPICS)]
        rows.append({"prompt": f"Describe a person in {t} case {i} as JSON.", "kind": "person"})
        rows.append({"prompt": f"Extract the party of {t} (case {i}) as JSON.",
                     "json_schema": json.dumps(CONTRACT), "kind": "contract"})
        rows.append({"prompt": f"Label this note about {t}, number {i}, as JSON.",
                     "json_schema": json.dumps(LABELS), "kind": "labels"})
    for i in range(6):
        rows.append({"prompt": f"When was {TOPICS[i]} signed? Answer with a date.",
                     "regex": DATE, "kind": "date"})
        rows.append({"prompt": f"Is this review of {TOPICS[i]} positive? 'It was fine {i}.'",
                     "choice": json.dumps(MOODS), "kind": "mood"})
    rows.append({"prompt": "Bad schema.", "json_schema": '{"type": "frobnicate"}', "kind": "bad"})
    rows.append({"prompt": "Two constraints.", "regex": "a+", "choice": '["a"]', "kind": "two"})
    return rows


@pytest.fixture(scope="module")
def structured_job(tmp_path_factory, smollm2_folder) -> tuple[list[dict], pa.Table, dict]:
    tmp = tmp_path_factory.mktemp("structured")
    rows = job_rows()
    columns = {"id": [f"q{i}" for i in range(len(rows))]}
    for name in ("prompt", "json_schema", "regex", "choice"):
        columns[name] = pa.array([r.get(name) for r in rows], pa.string())
    pq.write_table(pa.table(columns), tmp / "in.parquet")
    (tmp / "person.json").write_text(json.dumps(PERSON))
    job = {
        "name": "structured",
        "model": {"path": str(smollm2_folder), "device": "cpu", "dtype": "float32"},
        "input": {"path": str(tmp / "in.parquet")},
        "output": {"path": str(tmp / "out.parquet"), "include_token_ids": True},
        "sampling": {"max_tokens": 64, "json_schema": str(tmp / "person.json")},
        "engine": {"kv_cache_memory": "256MiB"},
    }
    (tmp / "job.yaml").write_text(json.dumps(job))
    metrics = run_job(str(tmp / "job.yaml"), progress=False)
    return rows, pq.read_table(tmp / "out.parquet"), metrics


SCHEMAS = {"person": PERSON, "contract": CONTRACT, "labels": LABELS}


def test_every_stop_row_parses_and_validates(structured_job) -> None:
    rows, table, _ = structured_job
    out = table.to_pylist()
    assert [o["id"] for o in out] == [f"q{i}" for i in range(len(rows))]
    stops = 0
    for row, o in zip(rows, out):
        if row["kind"] in ("bad", "two"):
            continue
        assert o["finish_reason"] in ("stop", "length"), o
        if o["finish_reason"] == "length":
            assert o["completion_tokens"] == 64
            continue
        stops += 1
        text = o["completion"]
        if row["kind"] in SCHEMAS:
            jsonschema.validate(json.loads(text), SCHEMAS[row["kind"]])
        elif row["kind"] == "date":
            assert re.fullmatch(DATE, text), text
        else:
            assert text in MOODS
    assert stops >= 45, f"only {stops} of 54 rows finished with stop"


def test_bad_constraints_are_error_rows_and_the_job_goes_on(structured_job) -> None:
    rows, table, metrics = structured_job
    out = {o["id"]: o for o in table.to_pylist()}
    bad, two = out[f"q{len(rows) - 2}"], out[f"q{len(rows) - 1}"]
    assert bad["finish_reason"] == "error" and bad["completion"] is None
    assert bad["error"].startswith("sampling.json_schema: ") and "frobnicate" in bad["error"]
    assert two["finish_reason"] == "error"
    assert "regex and choice are both set" in two["error"]
    assert metrics["rows_error"] == 2 and metrics["rows_ok"] == len(rows) - 2


def test_greedy_constrained_output_equals_transformers_under_the_same_mask(
        structured_job, smollm2_folder) -> None:
    """One row of each kind against the brute-force reference, over their first 24 tokens."""
    rows, table, _ = structured_job
    out = table.to_pylist()
    from batchllm.model.tokenizer import load_tokenizer
    from batchllm.rows.prompts import conversation, render_chats, tokenize

    tok = load_tokenizer(smollm2_folder)
    kinds = [r["kind"] for r in rows]
    picks = {kinds.index(k): k for k in ("person", "contract", "labels", "date", "mood")}
    specs = {"person": ("json_schema", PERSON), "contract": ("json_schema", CONTRACT),
             "labels": ("json_schema", LABELS), "date": ("regex", DATE),
             "mood": ("choice", MOODS)}
    for i, kind in picks.items():
        text = render_chats(tok, [conversation(rows[i]["prompt"], None)])
        prompt = tokenize(tok, text, False)[0].tolist()
        # the first 24 tokens: transformers' generate runs ~1 s a token on a busy 2-core machine
        ref, gaps = hf_constrained_greedy(smollm2_folder, prompt, *specs[kind], max_tokens=24)
        ours = out[i]["token_ids"][:24]
        tie = assert_tokens_match(ours, ref, gaps, row=f"{i} ({kind})")
        assert tie or first_divergence(ours, ref) is None


def test_grammar_cache_compiles_each_spec_once(smollm2_folder) -> None:
    from batchllm.engine.grammar import Grammars
    from batchllm.model.tokenizer import load_tokenizer
    from batchllm.sampling_params import SamplingParams

    g = Grammars(load_tokenizer(Path(smollm2_folder)), {2}, 49152)
    a = SamplingParams(json_schema=PERSON)
    assert g.problem(a) is None and g.problem(SamplingParams(json_schema=json.dumps(PERSON))) is None
    assert len(g._templates) == 1  # a dict and its JSON text are one spec
    m1, m2 = g.matcher(a), g.matcher(a)
    assert m1 is not m2 and not m1.is_error()
