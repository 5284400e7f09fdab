"""The command line: parse, build the config, delegate. Exit codes as DESIGN.md says:
0 every row succeeded; 3 finished with error rows; 2 the job cannot start; 1 anything else."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Offline batch LLM inference: Parquet prompts in, Parquet completions out.")

_SET = typer.Option("--set", help="Override a job field: section.key=value (repeatable).")


def _cannot_start(message: str) -> None:
    print(f"batchllm: error: {message}", file=sys.stderr)
    raise typer.Exit(2)


def _start_errors() -> tuple[type[BaseException], ...]:
    from batchllm.config import ConfigError
    from batchllm.engine.scheduler import KVCacheTooSmall
    from batchllm.job import JobCannotStart
    from batchllm.model.errors import ModelError

    return (ConfigError, JobCannotStart, ModelError, KVCacheTooSmall)


@app.command()
def run(
    job: Annotated[Path, typer.Argument(help="The job file (YAML).")],
    overrides: Annotated[list[str] | None, _SET] = None,
    quiet: Annotated[bool, typer.Option("--quiet", help="No progress bar.")] = False,
) -> None:
    """Run a job: every input row gets an output row."""
    from batchllm.job import JobInterrupted, run_job

    try:
        metrics = run_job(job, overrides or [], progress=not quiet)
    except _start_errors() as e:
        _cannot_start(str(e))
    except JobInterrupted:
        raise typer.Exit(1)
    raise typer.Exit(3 if metrics.get("rows_error") else 0)


@app.command()
def plan(
    job: Annotated[Path, typer.Argument(help="The job file (YAML).")],
    overrides: Annotated[list[str] | None, _SET] = None,
) -> None:
    """Read and tokenize the input, build the prefix tree and print what a run would do.
    Runs no model forward pass."""
    from batchllm.plan_report import plan_job

    try:
        report = plan_job(job, overrides or [])
    except _start_errors() as e:
        _cannot_start(str(e))
    width = max(map(len, report))
    for key, value in report.items():
        print(f"{key:<{width}}  {value}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
