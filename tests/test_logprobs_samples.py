"""Log-probabilities against transformers' log_softmax (SmolLM2: the tiny random models' logits,
scaled up on purpose, leave 2.5e-4 of float32 summation noise in a log-probability, SmolLM2's
3.5e-5), n samples per row (distinct, reproducible whatever the batch, one prefill), their output
lines and resume per sample (a tiny model)."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from grammar_reference import hf_logprobs
from hf_reference import tiny_model_folder
from job_files import tiny_job

from batchllm import LLM, SamplingParams
from batchllm.config import ConfigError, load_job
from batchllm.engine.runtime import Runtime
from batchllm.job import run_job
from batchllm.resume import job_fingerprint
from batchllm.rows.build import build_rows
from batchllm.rows.reader import read_input
from batchllm.rows.samples import done_keys
from batchllm.rows.writer import CheckpointWriter

FOLDER = tiny_model_folder("llama")


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(FOLDER), dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def small_batches() -> LLM:
    """The same model with steps of at most 3 sequences and 24 tokens, pages of 4."""
    return LLM(str(FOLDER), dtype="float32", device="cpu", max_num_seqs=3,
               max_batched_tokens=24, page_size=4)


@pytest.fixture(scope="module")
def smol(smollm2_folder) -> LLM:
    return LLM(str(smollm2_folder), dtype="float32", device="cpu")


def prompts(n: int = 8) -> list[list[int]]:
    rng = np.random.default_rng(4)
    shared = rng.integers(5, 4000, 24).tolist()
    return [shared + rng.integers(5, 4000, 2 + i % 4).tolist() for i in range(n)]


def tokens(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.mark.slow  # loads the real SmolLM2 model
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_equal_transformers_log_softmax(smol: LLM, smollm2_folder,
                                                 temperature: float) -> None:
    """Chosen token and top-5, within 1e-4, under log_softmax(logits / T) (T = 1 when greedy)."""
    ps = prompts(6)
    outs = smol.generate(ps, SamplingParams(max_tokens=9, temperature=temperature, seed=2,
                                           logprobs=5, ignore_eos=True))
    for p, o in zip(ps, outs):
        ref = hf_logprobs(smollm2_folder, p, o.token_ids, temperature or 1.0)  # [T, V]
        assert o.logprobs is o.outputs[0].logprobs and len(o.logprobs) == len(o.token_ids) == 9
        for t, (tok, lp) in enumerate(zip(o.token_ids, o.logprobs)):
            assert lp.token_id == tok
            assert abs(lp.logprob - float(ref[t, tok])) < 1e-4
            ids, values = zip(*lp.top)
            assert len(ids) == 5 and list(values) == sorted(values, reverse=True)
            assert torch.allclose(ref[t, list(ids)], torch.tensor(values), atol=1e-4)
            assert torch.allclose(ref[t].topk(5).values, torch.tensor(values), atol=1e-4)
            if temperature == 0.0:
                assert lp.logprob == values[0]  # greedy: the chosen token is the top one


@pytest.mark.slow  # loads the real SmolLM2 model
def test_logprobs_of_a_constrained_row_are_over_the_allowed_tokens(smol: LLM,
                                                                   smollm2_folder) -> None:
    """After the mask: the alternatives are allowed tokens only, renormalized among them."""
    p = prompts(1)[0]
    out = smol.generate([p], SamplingParams(max_tokens=4, logprobs=20, choice=["yes", "no"]))[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
    first = out.logprobs[0]
    ids = [i for i, _ in first.top]
    assert 2 <= len(ids) < 20  # a few first tokens of "yes"/"no", never 20 of the vocabulary
    raw = hf_logprobs(smollm2_folder, p, out.token_ids)[0]
    assert torch.allclose(torch.log_softmax(raw[ids], 0),
                          torch.tensor([v for _, v in first.top]), atol=1e-4)


def test_no_logprobs_unless_asked(llm: LLM) -> None:
    out = llm.generate(prompts(1), SamplingParams(max_tokens=3))[0]
    assert out.logprobs is None and len(out.outputs) == 1 and out.outputs[0].index == 0


def test_n_samples_distinct_reproducible_batch_invariant_one_prefill(
        llm: LLM, small_batches: LLM) -> None:
    ps = prompts(8)
    sp = SamplingParams(max_tokens=8, temperature=0.8, seed=5, n=4, ignore_eos=True)
    first = llm.generate(ps, sp)
    m4 = llm.last_metrics
    assert [len(o.outputs) for o in first] == [4] * 8
    assert all([c.index for c in o.outputs] == [0, 1, 2, 3] for o in first)
    distinct = sum(len({tuple(c.token_ids) for c in o.outputs}) == 4 for o in first)
    assert distinct >= 6, f"only {distinct} of 8 rows have 4 different completions"
    assert tokens(llm.generate(ps, sp)) == tokens(first)
    assert tokens(small_batches.generate(ps, sp)) == tokens(first)
    one = llm.generate(ps, replace(sp, n=1))
    assert m4["prefill_tokens"] == llm.last_metrics["prefill_tokens"] == m4["tree_tokens"]
    assert [o.token_ids for o in one] == [o.outputs[0].token_ids for o in first]  # sample 0


def test_seeded_constrained_sampling_is_batch_invariant(llm: LLM, small_batches: LLM) -> None:
    words = r"[a-z]{2,5}(, [a-z]{2,5}){0,2}"
    sp = SamplingParams(max_tokens=16, temperature=0.9, seed=3, n=2, regex=words)
    ps = prompts(6)
    first = llm.generate(ps, sp)
    assert tokens(small_batches.generate(ps, sp)) == tokens(first)
    done = [c for o in first for c in o.outputs if c.finish_reason == "stop"]
    assert done and all(re.fullmatch(words, c.text) for c in done)


def test_job_output_lines_per_sample_and_resume_per_sample(tmp_path) -> None:
    texts = [f"Clause {i % 3}: the buyer pays within {i} days." for i in range(6)]
    sampling = {"max_tokens": 5, "temperature": 0.8, "seed": 3, "n": 3, "logprobs": 2,
                "ignore_eos": True}
    engine = {"kv_cache_memory": "64MiB", "max_num_seqs": 4}
    full_job = tiny_job(tmp_path, "full", "samples", texts, sampling, engine)
    full = run_job(str(full_job), progress=False)
    table = pq.read_table(tmp_path / "full" / "out.parquet")
    lines = table.to_pylist()
    assert table.column_names[-2:] == ["sample", "logprobs"]
    assert [(o["id"], o["sample"]) for o in lines] == [
        (f"r{i}", s) for i in range(6) for s in range(3)]
    assert all(len(o["logprobs"]) == o["completion_tokens"] == 5 for o in lines)
    assert all(len(t["top"]) == 2 for o in lines for t in o["logprobs"])

    # An earlier run that flushed some samples: rows 0 and 4 partly, row 1 wholly.
    part_job = tiny_job(tmp_path, "part", "samples", texts, sampling, engine)
    cfg = load_job(part_job)
    source = read_input(cfg.input)
    writer = CheckpointWriter(cfg.output.path, job_fingerprint(cfg, source.files),
                              flush_rows=10**6)
    runtime = Runtime.from_config(cfg)
    rows = build_rows(runtime.tokenizer, cfg.input, cfg.sampling, source)
    keep = {(0, 0), (0, 2), (1, 0), (1, 1), (1, 2), (4, 1)}
    runtime.run_rows(rows, lambda r: writer.add(r) if r.key in keep else None)
    writer.flush()
    assert writer.done_rows() == {1, (0, 0), (0, 2), (4, 1)}
    resumed = run_job(str(part_job), ["output.mode=resume"], progress=False)
    again = pq.read_table(tmp_path / "part" / "out.parquet").to_pylist()
    # The same tokens; a log-probability only up to float32 summation order (a sample batched
    # with other rows than before: up to ~2e-5 on this model, whose logits are scaled up).
    assert [{**o, "logprobs": None} for o in again] == [{**o, "logprobs": None} for o in lines]
    for o, ref in zip(again, lines):
        assert [t["token_id"] for t in o["logprobs"]] == [t["token_id"] for t in ref["logprobs"]]
        assert np.allclose([t["logprob"] for t in o["logprobs"]],
                           [t["logprob"] for t in ref["logprobs"]], atol=1e-4)
    assert resumed["completion_tokens"] == full["completion_tokens"] - 5 * len(keep)


def test_sample_column_only_when_n_is_above_one(tmp_path) -> None:
    job = tiny_job(tmp_path, "one", "one", ["a b c", "d e f"], {"max_tokens": 2},
                   {"kv_cache_memory": "64MiB"})
    run_job(str(job), progress=False)
    names = pq.read_table(tmp_path / "one" / "out.parquet").column_names
    assert "sample" not in names and "logprobs" not in names


def test_done_keys() -> None:
    a = np.asarray
    assert done_keys(a([0, 1, 2]), a([0, 0, 0]), a([1, 1, 1])) == {0, 1, 2}
    assert done_keys(a([0, 0, 1, 1, 1]), a([0, 1, 2, 0, 2]), a([2, 2, 3, 3, 3])) == {
        0, (1, 0), (1, 2)}


def test_sampling_fields_in_the_job_file(tmp_path) -> None:
    from batchllm.config import job_from_dict

    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"b": {}, "a": {}}}))
    base = {"name": "x", "input": {"path": "in.parquet"}, "output": {"path": "o.parquet"}}

    def sampling(**kw):
        return job_from_dict({**base, "sampling": {"max_tokens": 4, **kw}}).sampling

    s = sampling(json_schema=str(schema), n=3, logprobs=20)
    assert json.loads(s.json_schema) == {"type": "object", "properties": {"b": {}, "a": {}}}
    assert list(json.loads(s.json_schema)["properties"]) == ["b", "a"]  # order kept
    assert sampling(json_schema={"type": "string"}).json_schema == '{"type": "string"}'
    assert sampling(choice=["x", "y"]).choice == ("x", "y")
    for bad, where in [({"n": 0}, "sampling.n"), ({"logprobs": 21}, "sampling.logprobs"),
                       ({"json_schema": str(tmp_path / "none.json")}, "sampling.json_schema"),
                       ({"choice": []}, "sampling.choice"),
                       ({"regex": "a", "choice": ["a"]}, "sampling.choice")]:
        with pytest.raises(ConfigError, match=where):
            sampling(**bad)


def test_per_row_n_logprobs_and_choice_columns(tmp_path) -> None:
    import pyarrow as pa

    data = tmp_path / "in.parquet"
    pq.write_table(pa.table({
        "id": [10, 11, 12, 13],
        "prompt": ["a b c", "d e f", "g h i", "j k l"],
        "n": pa.array([1, 2, None, 3], pa.int64()),
        "logprobs": pa.array([0, 3, None, 1], pa.int64()),
        "choice": pa.array([None, ["up", "down"], None, None], pa.list_(pa.string())),
    }), data)
    job = tiny_job(tmp_path, "rows", "rows", [], {"max_tokens": 3},
                   {"kv_cache_memory": "64MiB"})
    run_job(str(job), progress=False)
    lines = pq.read_table(tmp_path / "rows" / "out.parquet").to_pylist()
    assert [(o["id"], o["sample"]) for o in lines] == [
        (10, 0), (11, 0), (11, 1), (12, 0), (13, 0), (13, 1), (13, 2)]
    assert [o["logprobs"] is None for o in lines] == [True, False, False, True, False, False,
                                                       False]
    assert all(o["completion"] in ("up", "down") for o in lines[1:3])
    assert all(len(t["top"]) == 1 for o in lines[4:] for t in o["logprobs"])
