"""run_job(): rows in -> prompts -> plan -> engine -> rows out, with checkpoints and metrics.

A run holds its output's lock (rows/lock.py) from before it reads anything until its files are
written; a write that fails (disk full) stops it with one line that says what is saved and how to
resume (JobFailed).
"""

from __future__ import annotations

import errno
import json
import os
import shlex
import signal
import sys
import threading
import time

from batchllm import collector
from batchllm.config import ConfigError, JobConfig, load_job
from batchllm.engine.metrics import Phases, RunMetrics
from batchllm.engine.scheduler import KVCacheTooSmall
from batchllm.model.errors import ModelError
from batchllm.progress import Progress, summary
from batchllm.resume import JobCannotStart, job_fingerprint, prepare_output
from batchllm.rows import storage
from batchllm.rows.blocks import InputIndex, read_index
from batchllm.rows.build import build_table
from batchllm.rows.lock import OutputLock, OutputLocked
from batchllm.rows.openai_results import write_results
from batchllm.rows.prometheus import PrometheusFile
from batchllm.rows.reader import InputRows, read_input
from batchllm.rows.redact import redact
from batchllm.rows.samples import whole_rows
from batchllm.rows.writer import CheckpointWriter, write_metrics
from batchllm.scale.assign import partitioned
from batchllm.scale.cluster import require_ray


class JobInterrupted(Exception):
    """SIGINT or SIGTERM: finished rows were flushed; the job can be resumed."""


class JobFailed(Exception):
    """The run stopped for a reason the message states in one line (a file that cannot be
    written); what is saved and how to resume are in it (exit code 1)."""


START_ERRORS = (ConfigError, JobCannotStart, ModelError, KVCacheTooSmall)  # exit code 2


def exit_code(error: BaseException) -> int:
    """The command's exit code for a run that raised `error`."""
    return 2 if isinstance(error, START_ERRORS) else 1


def resume_command(job: object, overrides: list[str] | tuple[str, ...] = ()) -> str:
    """The command that resumes this job: its file and overrides, with output.mode=resume."""
    where = os.fspath(job) if isinstance(job, (str, os.PathLike)) else "JOB.yaml"
    keep = [o for o in overrides if not o.replace(" ", "").startswith("output.mode=")]
    sets = "".join(f" --set {shlex.quote(o)}" for o in [*keep, "output.mode=resume"])
    return f"batchllm run {shlex.quote(where)}{sets}"


def run_job(job: str | os.PathLike | JobConfig, overrides: list[str] | tuple[str, ...] = (),
            progress: bool = True, *, progress_every: float = 30.0,
            resume: str | None = None, started: float | None = None) -> dict:
    """Run a job file (or a loaded config); returns the metrics, also written next to the output.
    Raises ConfigError / JobCannotStart before anything runs when the job cannot start, JobFailed
    when a file cannot be written, JobInterrupted on SIGINT / SIGTERM. progress_every: seconds
    between plain progress lines (stderr not a terminal). resume: the command that resumes the
    job, for messages (default: from `job` and `overrides`). started: the perf_counter time the
    phases count from (the command passes its process's start; default: this call)."""
    phases = Phases(started)
    cfg = job if isinstance(job, JobConfig) else load_job(job, overrides)
    resume = resume or resume_command(job, overrides)
    require_ray(cfg)
    lock = OutputLock(cfg.output.path)
    try:
        lock.acquire()
    except OutputLocked as e:
        pid = e.holder.pid if e.holder.pid is not None else "PID"
        raise JobCannotStart(redact(f"{e}; wait for it to end (`flock {e.lock_path} true` returns "
                                    f"when it does), or stop it (kill {pid}) and resume: "
                                    f"{resume}")) from None
    except OSError as e:
        why = ("it is a symbolic link (remove it, if no run of this job is starting)"
               if e.errno == errno.ELOOP else e.strerror or e)
        raise JobCannotStart(redact(f"output.path: cannot create the lock file {lock.path}: "
                                    f"{why}")) from None
    if lock.local_only:
        print(redact(f"batchllm: note: object storage has no locks; {cfg.output.path} is locked "
                     "on this machine only"), file=sys.stderr)
    prom = None
    if cfg.output.prometheus:
        prom = PrometheusFile(cfg.output.prometheus, cfg.name, start_timestamp_seconds=time.time())
    try:
        return _run_locked(cfg, progress, progress_every, prom, resume, phases)
    except BaseException as e:
        if prom is not None:
            prom.update(exit_status=exit_code(e))
        raise
    finally:
        lock.release()


def _run_locked(cfg: JobConfig, progress: bool, every: float, prom: PrometheusFile | None,
                resume: str, phases: Phases) -> dict:
    phases.since_start("import")
    with phases.timed("read"):
        rows: InputRows | InputIndex = read_index(cfg.input) if partitioned(cfg) else read_input(
            cfg.input)
    with phases.timed("load"):  # the model's files, dtype, device, kernels: before the weights
        writer = CheckpointWriter(cfg.output.path, job_fingerprint(cfg, rows.files),
                                  flush_rows=int(os.environ.get("BATCHLLM_CHECKPOINT_ROWS", "256")))
    done = prepare_output(cfg, writer)
    if done is None:
        print(redact(f"{cfg.output.path} is complete; nothing to resume"), file=sys.stderr)
        try:
            with storage.open_bytes(cfg.output.path + ".metrics.json") as f:
                return json.load(f)
        except (OSError, ValueError):
            return {"rows": rows.num_rows, "rows_error": 0}
    whole = whole_rows(done)  # the other keys of `done`: samples of rows not all done
    if prom is not None:
        prom.update(rows=rows.num_rows, rows_done=whole, rows_resumed=whole)
    bar = Progress(rows.num_rows, whole, enabled=progress, every=every, prometheus=prom)
    try:
        metrics = _run_rows(cfg, rows, writer, done, bar, resume, phases)
        bar.close()
        with phases.timed("write"):
            written = writer.finalize(rows.ids.type, _metadata(cfg), cfg.output.include_prompt,
                                      cfg.output.include_token_ids, rows.num_rows,
                                      _final_format(cfg, rows))
        metrics.update(this_process(metrics), rows=written.rows,
                       rows_ok=written.rows - written.rows_error, rows_error=written.rows_error,
                       rows_resumed=whole, job=cfg.name, parts_discarded=len(writer.discarded),
                       **phases.to_dict(), fingerprint=writer.fingerprint)
        write_metrics(cfg.output.path, metrics)
    except storage.WriteFailed as e:
        bar.close()
        raise JobFailed(_write_failed(e, cfg, writer, whole, resume)) from e
    if prom is not None:
        prom.update(**metrics, rows_done=written.rows, kv_pages_in_use=0, waiting=0, running=0,
                    exit_status=3 if written.rows_error else 0,
                    last_success_timestamp_seconds=time.time())
        if prom.error:
            print(redact(f"batchllm: warning: {prom.error}"), file=sys.stderr)
    print(redact(summary(metrics, cfg.output.path)), file=sys.stderr)
    return metrics


def _run_rows(cfg: JobConfig, rows: InputRows | InputIndex, writer: CheckpointWriter,
              done: set[int], bar: Progress, resume: str, phases: Phases) -> dict:
    """Run every row not in `done` (locally or on Ray workers) with SIGINT / SIGTERM turned
    into JobInterrupted after the finished rows are flushed."""
    def interrupt(signum, frame) -> None:
        raise JobInterrupted(signal.Signals(signum).name)

    handled = (signal.SIGINT, signal.SIGTERM)
    main_thread = threading.current_thread() is threading.main_thread()  # signals: main only
    previous = {s: signal.signal(s, interrupt) for s in handled} if main_thread else {}
    try:
        if cfg.engine.workers > 1 and whole_rows(done) < rows.num_rows:  # else nothing to shard
            from batchllm.scale.driver import run_sharded  # imports ray

            return _phases_of(run_sharded(cfg, rows, writer, done, bar), phases)
        if isinstance(rows, InputIndex):  # every row is done already: nothing to shard
            with phases.timed("read"):
                rows = read_input(cfg.input)
        return _phases_of(_run_local(cfg, rows, writer, done, bar, phases), phases)
    except JobInterrupted as stop:
        writer.flush()
        bar.close()
        print(redact(f"\n{stop}: finished rows are saved in {writer.parts_dir}; resume with\n"
                     f"  {resume}"), file=sys.stderr)
        raise
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _write_failed(e: storage.WriteFailed, cfg: JobConfig, writer: CheckpointWriter,
                  resumed: int, resume: str) -> str:
    if writer.has_checkpoint():
        saved = f"the {resumed + writer.rows_flushed} finished rows are saved in {writer.parts_dir}"
    elif storage.exists(cfg.output.path):
        saved = f"the output {cfg.output.path} is complete"
    else:
        saved = "no finished rows were saved yet"
    return redact(f"{e}; {saved}; once there is room, resume with: {resume}")


# What this process did, under names that say so: after a resume `rows`, `rows_ok` and
# `rows_error` count the whole file, while the run's figures count only the rows this process ran.
THIS_PROCESS = ("rows", "prompt_tokens", "prefill_tokens", "cached_tokens", "completion_tokens",
                "wall_seconds", "output_tokens_per_s", "total_tokens_per_s")


def this_process(metrics: dict) -> dict:
    """run_<key> for each THIS_PROCESS key of a run's metrics (before `rows` becomes the
    file's)."""
    return {f"run_{k}": metrics[k] for k in THIS_PROCESS if k in metrics}


def _phases_of(metrics, phases: Phases) -> dict:
    """The metrics file's keys of a RunMetrics (or the sharded path's ShardedMetrics, whose
    `run` merges its workers': the slowest one's plan and run seconds), its plan and run
    seconds put into the job's phases."""
    run: RunMetrics = getattr(metrics, "run", metrics)
    phases.seconds["plan"] = run.plan_seconds
    phases.seconds["run"] = run.run_seconds
    return metrics.to_dict()


def _run_local(cfg: JobConfig, source: InputRows, writer: CheckpointWriter, done: set[int],
               bar: Progress, phases: Phases) -> RunMetrics:
    """The single-process path: every row planned (so that a resumed run makes the same plan),
    the rows in `done` skipped."""
    with collector.start_up():  # torch and the model: objects as long-lived as the process
        with phases.timed("import"):
            from batchllm.engine.runtime import Runtime  # torch: not before the lock is held

        with phases.timed("load"):
            runtime = Runtime.from_config(cfg)
    phases.notes["panel_cache"] = runtime.loaded.panel_cache
    with phases.timed("tokenize"):
        rows = build_table(runtime.tokenizer, cfg.input, cfg.sampling, source,
                           keep_prompt=cfg.output.include_prompt, release_input=True)
    if source.prompts is not None:  # never read again (the table holds what it needs): ~110 B
        source.prompts.clear()  # a row of a short prompt, let go block by block above

    def on_row(row) -> None:
        writer.add(row)  # a copy, written with the next part
        bar.row_done(row)
        row.release()  # the driver keeps no finished row's results until the end

    try:
        return runtime.run_rows(rows, on_row, bar.step, skip=done)
    finally:
        phases.first_forward = runtime.loaded.first_forward


def _final_format(cfg: JobConfig, rows: InputRows | InputIndex):
    """How the final file is written: None for Parquet, else the OpenAI Batch results writer
    (each row a chat or a completion, as its request was), given the groups in order."""
    if cfg.output.format != "openai-batch":
        return None
    kinds: list[str] | str = "chat" if cfg.input.chat_template else "completion"
    if isinstance(rows, InputRows) and rows.prompts_as_is:
        kinds = ["chat" if m is not None else "completion" for m in rows.messages]
    created = int(time.time())
    # a token id's text and bytes, for the results' log-probabilities (the tokenizer loaded
    # only if asked)
    from batchllm.model.tokenizer import lazy_token_pieces

    return lambda groups, schema, f: write_results(groups, f, kinds, cfg.model.path, created,
                                                   lazy_token_pieces(cfg.model.path,
                                                                     cfg.model.revision))


def _metadata(cfg: JobConfig) -> dict[str, str]:
    return {
        "batchllm.job": cfg.name,
        "batchllm.model": cfg.model.path,
        "batchllm.sampling": json.dumps(cfg.to_dict()["sampling"]),
    }


__all__ = ["ConfigError", "JobCannotStart", "JobFailed", "JobInterrupted", "exit_code",
           "resume_command", "run_job"]
