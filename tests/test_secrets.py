"""Nothing the job prints or records shows a URI's credentials (s3://key:secret@bucket/...), and
the error log, which holds the command line, is readable by its owner only, also where it falls
back to when the output's folder cannot take it."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from batchllm.config import load_job
from batchllm.error_log import write_error_log
from batchllm.rows.lock import OutputLock
from batchllm.rows.prometheus import render
from batchllm.rows.redact import redact
from batchllm.rows.storage import WriteFailed
from batchllm.rows.writer import write_metrics
from batchllm.scale.cluster import actor_name

SECRET = "wJalrXUtnFEMI/K7MDENG+bPxRfiCY"
URI = f"s3://AKIAEXAMPLE:{SECRET}@bucket/out/result.parquet"


@pytest.mark.parametrize(("text", "shown"), [
    (URI, "s3://***@bucket/out/result.parquet"),
    (f"cannot read '{URI}': denied", "cannot read 's3://***@bucket/out/result.parquet': denied"),
    ("https://token@host/p?X-Amz-Signature=abc&part=2",
     "https://***@host/p?X-Amz-Signature=***&part=2"),
    ("abfs://container@account.dfs.core.windows.net/x?sig=abc",
     "abfs://container@account.dfs.core.windows.net/x?sig=***"),  # container@account: no secret
    ("gs://bucket/a:b@c and /local/p@x", "gs://bucket/a:b@c and /local/p@x"),
])
def test_redact(text, shown):
    assert redact(text) == shown


def test_nothing_recorded_shows_the_secret(tmp_path, monkeypatch):
    (tmp_path / "in.parquet").write_bytes(b"")
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps({"name": "secret", "input": {"path": str(tmp_path / "in.parquet")},
                               "output": {"path": URI}, "sampling": {"max_tokens": 4}}))
    cfg = load_job(job)
    assert SECRET not in actor_name(cfg, 1) and "s3://***@bucket" in actor_name(cfg, 1)
    assert SECRET not in str(WriteFailed(URI, OSError(13, "Permission denied")))
    assert SECRET not in render(f"job of {URI}", {"rows": 3})
    metrics = write_metrics(tmp_path / "m.parquet", {"output": URI, "rows": 3})
    assert SECRET not in Path(metrics).read_text()
    monkeypatch.setattr(sys, "argv", ["batchllm", "run", "job.yaml", "--set",
                                      f"output.path={URI}"])
    monkeypatch.setenv("BATCHLLM_CACHE", str(tmp_path / "cache"))
    with OutputLock(URI) as lock:
        assert SECRET not in Path(lock.path).read_text()


def test_the_error_log_is_private_wherever_it_goes(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["batchllm", "run", "job.yaml", "--set",
                                      f"input.path={URI}"])
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "in.parquet").write_bytes(b"")
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps({"name": "log", "input": {"path": str(tmp_path / "in.parquet")},
                               "output": {"path": str(out / "o.parquet")},
                               "sampling": {"max_tokens": 4}}))
    cfg = load_job(job)
    beside = write_error_log(cfg, RuntimeError(f"reading {URI} failed"))
    assert beside == f"{out / 'o.parquet'}.error.log"
    # nowhere to write beside the output (no config): this user's private logs folder
    monkeypatch.setenv("BATCHLLM_CACHE", str(tmp_path / "cache"))
    fallback = write_error_log(None, RuntimeError(f"reading {URI} failed"))
    assert fallback.startswith(str(tmp_path / "cache" / "logs"))
    assert stat.S_IMODE(os.stat(os.path.dirname(fallback)).st_mode) == 0o700
    # no cache either: a new private folder in the temporary folder
    monkeypatch.setenv("BATCHLLM_CACHE", "/proc/no-such-cache")
    last = write_error_log(None, RuntimeError("x"))
    assert stat.S_IMODE(os.stat(os.path.dirname(last)).st_mode) == 0o700
    for path in (beside, fallback, last):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        text = Path(path).read_text()
        assert SECRET not in text and "command: batchllm run job.yaml" in text
