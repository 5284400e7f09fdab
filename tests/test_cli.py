"""`batchllm run` through the real command line on a small job: output schema, input order,
metrics file, exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hf_reference import tiny_model_folder
from job_files import ops_job, run_cli, run_in_process

BATCHLLM = str(Path(sys.executable).parent / "batchllm")


def write_job(tmp: Path, rows: dict, **sections) -> Path:
    pq.write_table(pa.table(rows), tmp / "in.parquet")
    job = {
        "name": "cli-test",
        "model": {"path": str(tiny_model_folder("llama")), "device": "cpu"},
        "input": {"path": str(tmp / "in.parquet")},
        "output": {"path": str(tmp / "out" / "result.parquet")},
        "sampling": {"max_tokens": 6},
        "engine": {"kv_cache_memory": "64MiB"},
    }
    for key, value in sections.items():
        job[key].update(value)
    path = tmp / "job.yaml"
    path.write_text(json.dumps(job))  # JSON is YAML
    return path


def run(*args: str) -> subprocess.CompletedProcess:
    """`batchllm ARGS` in this process (the CLI's app); run_process for the console script's own
    exit codes."""
    return run_in_process(*args)


def run_process(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([BATCHLLM, *args], capture_output=True, text=True, env=env,
                          timeout=600, check=False)


PROMPTS = ["Summarize the contract.", "Who pays?", "What law governs it?",
           "Who pays? Answer briefly.", "Is there a notice period?"]


def test_run_writes_output_in_input_order_with_metrics(tmp_path: Path) -> None:
    ids = ["c", "a", "e", "b", "d"]
    job = write_job(tmp_path, {"id": ids, "prompt": PROMPTS,
                               "max_tokens": pa.array([3, None, 5, 2, None], pa.int32())},
                    sampling={"ignore_eos": True}, output={"include_token_ids": True})
    proc = run("run", str(job), "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    out = pq.read_table(tmp_path / "out" / "result.parquet")
    assert out.schema.names == ["id", "completion", "finish_reason", "prompt_tokens",
                                "completion_tokens", "cached_tokens", "error", "token_ids"]
    assert out.schema.field("prompt_tokens").type == pa.int32()
    assert out.column("id").to_pylist() == ids
    assert out.column("completion_tokens").to_pylist() == [3, 6, 5, 2, 6]  # per-row max_tokens
    assert set(out.column("finish_reason").to_pylist()) == {"length"}
    meta = out.schema.metadata
    assert meta[b"batchllm.job"] == b"cli-test"
    metrics = json.loads((tmp_path / "out" / "result.parquet.metrics.json").read_text())
    for key in ("rows", "rows_ok", "rows_error", "prompt_tokens", "prefill_tokens",
                "tree_tokens", "cached_tokens", "completion_tokens", "wall_seconds",
                "output_tokens_per_s", "total_tokens_per_s", "kv_pages_total", "kv_pages_peak",
                "preemptions", "device", "dtype", "model"):
        assert key in metrics, key
    assert metrics["rows"] == metrics["rows_ok"] == 5
    assert metrics["completion_tokens"] == 22
    assert metrics["prefill_tokens"] == metrics["tree_tokens"]
    assert "5 rows" in proc.stderr  # the summary block
    # the output exists: mode error refuses to touch it
    again = run("run", str(job), "--quiet")
    assert again.returncode == 2
    assert "output.path" in again.stderr and "exists" in again.stderr
    # --set overrides a field
    over = run("run", str(job), "--quiet", "--set", "output.mode=overwrite")
    assert over.returncode == 0, over.stderr


@pytest.mark.slow  # the whole command in a process of its own
def test_error_rows_give_exit_code_3(tmp_path: Path) -> None:
    job = write_job(tmp_path, {"prompt": ["Hello there.", None, "  ", "Bye."],
                               "temperature": [0.0, 0.0, 0.0, -2.0]})
    proc = run_process("run", str(job), "--quiet")  # the console script's own exit code
    assert proc.returncode == 3, proc.stderr
    out = pq.read_table(tmp_path / "out" / "result.parquet").to_pylist()
    assert [r["id"] for r in out] == [0, 1, 2, 3]
    assert [r["finish_reason"] for r in out][1:] == ["error"] * 3
    assert out[0]["finish_reason"] in ("stop", "length") and out[0]["error"] is None
    assert "null" in out[1]["error"] and "empty" in out[2]["error"]
    assert "temperature" in out[3]["error"]
    assert out[1]["completion"] is None


@pytest.mark.parametrize("section, change, words", [
    ("sampling", {"temprature": 1.0}, "sampling.temprature: unknown key; did you mean temperature"),
    ("input", {"prompt_column": "text"}, "input.prompt_column"),
    ("model", {"path": "/nonexistent/model"}, "/nonexistent/model"),
])
def test_job_that_cannot_start_gives_exit_code_2(tmp_path, section, change, words) -> None:
    job = write_job(tmp_path, {"prompt": ["Hello."]}, **{section: change})
    proc = run("run", str(job), "--quiet")
    assert proc.returncode == 2, proc.stderr
    assert words in proc.stderr
    assert "Traceback" not in proc.stderr


def test_plan_prints_the_prediction_without_running(tmp_path: Path) -> None:
    shared = "Please review this agreement carefully and answer. " * 5
    job = write_job(tmp_path, {"prompt": [shared + q for q in PROMPTS]})
    proc = run("plan", str(job))
    assert proc.returncode == 0, proc.stderr
    report = dict(line.split(None, 1) for line in proc.stdout.strip().splitlines())
    assert int(report["rows"]) == 5
    assert int(report["tree_tokens"]) < int(report["prompt_tokens"])
    assert int(report["predicted_prefill_tokens"]) == int(report["tree_tokens"])
    assert report["model_family"] == "llama"
    assert int(report["kv_bytes_per_token"]) == 2 * 2 * 2 * 16 * 4  # K,V x layers x heads x D x fp32
    assert not (tmp_path / "out").exists()


def test_an_unsupported_architecture_cannot_start(tmp_path: Path) -> None:
    import shutil

    from transformers import GPT2Config

    folder = tmp_path / "gpt2"
    shutil.copytree(tiny_model_folder("llama"), folder)
    GPT2Config().to_json_file(folder / "config.json")
    job = write_job(tmp_path, {"prompt": ["Hello."]}, model={"path": str(folder)})
    for command in ("run", "plan"):
        proc = run(command, str(job))
        assert proc.returncode == 2, proc.stderr
        assert "model type 'gpt2' is not supported; supported: llama, mistral" in proc.stderr
        assert "gemma2" in proc.stderr and "Traceback" not in proc.stderr


def test_too_long_prompts_become_error_rows_and_near_limit_rows_stop_at_it(tmp_path) -> None:
    long_prompt = "clause " * 80  # far more than 48 tokens with the chat template
    job = write_job(tmp_path, {"prompt": ["Hi.", long_prompt]},
                    model={"max_model_len": 48}, sampling={"max_tokens": 40, "ignore_eos": True})
    proc = run("run", str(job), "--quiet")
    assert proc.returncode == 3, proc.stderr
    short, long_ = pq.read_table(tmp_path / "out" / "result.parquet").to_pylist()
    assert long_["finish_reason"] == "error"
    assert "max_model_len" in long_["error"] and "48" in long_["error"]
    # fits, but leaves less room than max_tokens: generates up to the limit, ends with length
    assert short["finish_reason"] == "length"
    assert short["prompt_tokens"] + short["completion_tokens"] == 48


def test_kv_cache_too_small_for_one_request_is_reported_before_the_run(tmp_path) -> None:
    job = write_job(tmp_path, {"prompt": ["Summarize the contract in detail."]},
                    engine={"kv_cache_memory": "8KiB", "page_size": 4})
    proc = run("run", str(job), "--quiet")
    assert proc.returncode == 2, proc.stderr
    assert "engine.kv_cache_memory" in proc.stderr and "needs" in proc.stderr
    assert not (tmp_path / "out" / "result.parquet").exists()


@pytest.mark.slow  # the whole command in a process of its own
def test_unexpected_failure_is_one_line_naming_the_traceback_log(tmp_path: Path) -> None:
    job = ops_job(tmp_path, "run")
    log = tmp_path / "run" / "out.parquet.error.log"
    proc = run_cli("run", str(job), "--quiet", fault="crash")
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        ("batchllm: error: RuntimeError: injected failure inside the engine (the traceback is in "
        f"{log}; --debug prints it here)")]
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and "faulty_cli.py" in text
    assert "RuntimeError: injected failure inside the engine" in text
    debug = run_cli("run", str(job), "--quiet", "--debug", "--set", "output.mode=overwrite",
                    fault="crash")
    assert debug.returncode == 1
    assert "Traceback (most recent call last)" in debug.stderr
    assert debug.stderr.splitlines()[-1].startswith("batchllm: error: RuntimeError: injected")
    assert not (tmp_path / "run" / "out.parquet.lock").exists()  # released on the way out
