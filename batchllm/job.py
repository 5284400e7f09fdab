"""run_job(): rows in -> prompts -> plan -> engine -> rows out, with checkpoints and metrics."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import threading

from batchllm.config import ConfigError, JobConfig, load_job
from batchllm.engine.metrics import RunMetrics
from batchllm.engine.runtime import Runtime
from batchllm.progress import Progress, summary
from batchllm.rows.blocks import InputIndex, read_index
from batchllm.rows.build import build_rows
from batchllm.rows.reader import InputRows, read_input
from batchllm.rows.writer import CheckpointWriter, write_metrics
from batchllm.scale.assign import partitioned
from batchllm.scale.cluster import require_ray


class JobCannotStart(Exception):
    """The job cannot start: the output exists, an input or the model is missing (exit code 2)."""


class JobInterrupted(Exception):
    """SIGINT or SIGTERM: finished rows were flushed; the job can be resumed."""


def _file_digest(path: str) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fingerprint(cfg: JobConfig, files: tuple[str, ...]) -> dict:
    """What must not change between a run and its resume: the model, the input and its
    contents, the sampling settings. Engine settings and the order may change."""
    d = cfg.to_dict()
    return {
        "model": d["model"]["path"],
        "dtype": d["model"]["dtype"],
        "input": {k: v for k, v in d["input"].items() if k != "path"},
        "sampling": d["sampling"],
        "files": [[os.path.basename(f), _file_digest(f)] for f in files],
        "include": [cfg.output.include_prompt, cfg.output.include_token_ids],
    }


def _prepare_output(cfg: JobConfig, writer: CheckpointWriter) -> set[int]:
    """Apply output.mode; returns the rows already done (resume)."""
    exists = os.path.exists(cfg.output.path)
    if cfg.output.mode == "error" and (exists or writer.has_checkpoint()):
        what = cfg.output.path if exists else writer.parts_dir
        raise JobCannotStart(
            f"output.path: {what} exists; set output.mode to overwrite or resume "
            f"(--set output.mode=resume)"
        )
    if cfg.output.mode == "overwrite":
        writer.clear()
        return set()
    if cfg.output.mode == "resume":
        if exists and not writer.has_checkpoint():
            return {-1}  # already complete: nothing to run
        return writer.done_rows()
    return set()


def run_job(job: str | JobConfig, overrides: list[str] | tuple[str, ...] = (),
            progress: bool = True) -> dict:
    """Run a job file (or a loaded config); returns the metrics, also written next to the output.
    Raises ConfigError / JobCannotStart before anything runs when the job cannot start."""
    cfg = job if isinstance(job, JobConfig) else load_job(job, overrides)
    require_ray(cfg)
    rows: InputRows | InputIndex = read_index(cfg.input) if partitioned(cfg) else read_input(
        cfg.input)
    writer = CheckpointWriter(cfg.output.path, fingerprint(cfg, rows.files),
                              flush_rows=int(os.environ.get("BATCHLLM_CHECKPOINT_ROWS", "256")))
    done = _prepare_output(cfg, writer)
    if done == {-1}:
        print(f"{cfg.output.path} is complete; nothing to resume", file=sys.stderr)
        try:
            with open(cfg.output.path + ".metrics.json") as f:
                return json.load(f)
        except OSError:
            return {"rows": rows.num_rows, "rows_error": 0}
    whole = sum(1 for k in done if isinstance(k, int))  # the rest: samples of rows not all done
    bar = Progress(rows.num_rows, whole, enabled=progress)

    def interrupt(signum, frame) -> None:
        raise JobInterrupted(signal.Signals(signum).name)

    handled = (signal.SIGINT, signal.SIGTERM)
    main_thread = threading.current_thread() is threading.main_thread()  # signals: main only
    previous = {s: signal.signal(s, interrupt) for s in handled} if main_thread else {}
    try:
        if cfg.engine.workers > 1 and whole < rows.num_rows:  # else nothing to shard
            from batchllm.scale.driver import run_sharded  # imports ray

            metrics = run_sharded(cfg, rows, writer, done, bar).to_dict()
        else:
            if isinstance(rows, InputIndex):  # every row is done already: nothing to shard
                rows = read_input(cfg.input)
            metrics = _run_local(cfg, rows, writer, done, bar).to_dict()
    except JobInterrupted as stop:
        writer.flush()
        bar.close()
        where = job if isinstance(job, (str, os.PathLike)) else "JOB.yaml"
        print(f"\n{stop}: finished rows are saved in {writer.parts_dir}; resume with\n"
              f"  batchllm run {where} --set output.mode=resume", file=sys.stderr)
        raise
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    bar.close()
    written = writer.finalize(rows.ids.type, _metadata(cfg), cfg.output.include_prompt,
                              cfg.output.include_token_ids, rows.num_rows)
    metrics.update(rows=written.rows, rows_ok=written.rows - written.rows_error,
                   rows_error=written.rows_error, rows_resumed=whole, job=cfg.name)
    write_metrics(cfg.output.path, metrics)
    print(summary(metrics, cfg.output.path), file=sys.stderr)
    return metrics


def _run_local(cfg: JobConfig, source: InputRows, writer: CheckpointWriter, done: set[int],
               bar: Progress) -> RunMetrics:
    """The single-process path: every row planned (so that a resumed run makes the same plan),
    the rows in `done` skipped."""
    runtime = Runtime.from_config(cfg)
    rows = build_rows(runtime.tokenizer, cfg.input, cfg.sampling, source,
                      keep_prompt=cfg.output.include_prompt)

    def on_row(row) -> None:
        writer.add(row)
        bar.row_done(row)

    return runtime.run(rows, on_row, bar.step, skip=done)


def _metadata(cfg: JobConfig) -> dict[str, str]:
    return {
        "batchllm.job": cfg.name,
        "batchllm.model": cfg.model.path,
        "batchllm.sampling": json.dumps(cfg.to_dict()["sampling"]),
    }


__all__ = ["ConfigError", "JobCannotStart", "JobInterrupted", "run_job"]
