"""The command line: parse, build the config, delegate. Exit codes as DESIGN.md says:
0 every row succeeded; 3 finished with error rows; 2 the job cannot start; 1 anything else.

Every failure is one line on stderr (`batchllm: error: ...`); an unexpected one also names the
log file that holds its traceback (`<output>.error.log`), and `--debug` prints the traceback.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Offline batch LLM inference: Parquet prompts in, Parquet completions out.")

_SET = typer.Option("--set", help="Override a job field: section.key=value (repeatable).")


def _fail(message: str, code: int) -> None:
    from batchllm.rows.redact import redact  # no URI's credentials in what is printed

    print(redact(f"batchllm: error: {message}"), file=sys.stderr)
    raise typer.Exit(code)


def _start_errors() -> tuple[type[BaseException], ...]:
    from batchllm.job import START_ERRORS

    return START_ERRORS


@app.command()
def run(
    job: Annotated[Path, typer.Argument(help="The job file (YAML).")],
    overrides: Annotated[list[str] | None, _SET] = None,
    quiet: Annotated[bool, typer.Option("--quiet", help="No progress output.")] = False,
    progress_every: Annotated[float, typer.Option(
        "--progress-every", min=0.1,
        help="Seconds between progress lines when stderr is not a terminal.")] = 30.0,
    debug: Annotated[bool, typer.Option(
        "--debug", help="Print the traceback of an unexpected failure here too.")] = False,
    profile: Annotated[bool, typer.Option(
        "--profile", help="Print the seconds of each phase (start-up, read, load, tokenize, "
        "plan, run, write) at the end.")] = False,
) -> None:
    """Run a job: every input row gets an output row."""
    from batchllm.engine.metrics import phase_report, process_started

    started = process_started()
    from batchllm.config import load_job
    from batchllm.error_log import write_error_log
    from batchllm.job import JobFailed, JobInterrupted, resume_command, run_job

    overrides = overrides or []
    cfg = None
    try:
        cfg = load_job(job, overrides)
        metrics = run_job(cfg, progress=not quiet, progress_every=progress_every,
                          resume=resume_command(job, overrides), started=started)
    except _start_errors() as e:
        _fail(str(e), 2)
    except JobInterrupted:
        raise typer.Exit(1)
    except JobFailed as e:
        _fail(str(e), 1)
    except Exception as e:  # noqa: BLE001 - the one place every unexpected failure ends
        log = write_error_log(cfg, e)
        if debug:
            from batchllm.rows.redact import redact

            print(redact("".join(traceback.format_exception(e))), end="", file=sys.stderr)
        what = str(e).replace("\n", " ")
        _fail(f"{type(e).__name__}: {what} (the traceback is in {log}"
              + (")" if debug else "; --debug prints it here)"), 1)
    if profile and "process_seconds" in metrics:  # not for a job that was already complete
        print(phase_report(metrics), file=sys.stderr)
    raise typer.Exit(3 if metrics.get("rows_error") else 0)


@app.command()
def plan(
    job: Annotated[Path, typer.Argument(help="The job file (YAML).")],
    overrides: Annotated[list[str] | None, _SET] = None,
    devices: Annotated[str | None, typer.Option(
        "--devices", help="Plan the memory for these devices instead of this machine's: "
        "COUNTxKIND (2xH200, 8xH100) or COUNTxSIZE (4x80GiB).")] = None,
    memory_only: Annotated[bool, typer.Option(
        "--memory-only", help="Only the memory plan, from the model's config.json alone (no "
        "input read, no weights or tokenizer needed).")] = False,
) -> None:
    """Read and tokenize the input, build the prefix tree and print what a run would do, and
    whether the model and its KV cache fit the devices. Runs no model forward pass."""
    from batchllm.plan_report import plan_job

    try:
        report = plan_job(job, overrides or [], devices, memory_only)
    except _start_errors() as e:
        _fail(str(e), 2)
    width = max(map(len, report))
    for key, value in report.items():
        print(f"{key:<{width}}  {value}")


def main() -> None:
    """The `batchllm` command. The process ends as Python ends it, with the exit hooks of the
    libraries it loaded (logging, multiprocessing's children, pyarrow's S3, Ray's shutdown): an
    os._exit here saved only 0.15-0.5 s of an 8-row SmolLM2 job of 27-32 s (issue 31)."""
    app()


if __name__ == "__main__":
    main()
