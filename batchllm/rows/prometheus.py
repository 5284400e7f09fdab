"""The run's figures as a Prometheus text file (output.prometheus), for node_exporter's textfile
collector: gauges named batchllm_<metric>, each with the label job="<job name>", written atomically
(a temporary file beside it, then a rename: the collector never reads half a file), at the start,
every few seconds while the job runs, and at the end.

The names are the metrics file's keys (batchllm_prefill_tokens is metrics.json's prefill_tokens;
run_* count this process's work alone, as after a resume the rows count the whole file),
plus what only a live run has (rows_done, kv_pages_in_use, waiting, running) and what a monitor
alerts on: exit_status (written when the run ends: 0, 1, 2 or 3, as the command's exit code),
last_success_timestamp_seconds (when a run last wrote its final file; kept from the file's
previous contents until then), start_timestamp_seconds.
"""

from __future__ import annotations

import math
import os
import re

from batchllm.rows import storage
from batchllm.rows.redact import redact

GAUGES: dict[str, str] = {  # name (without the prefix) -> help text
    "rows": "input rows of the job",
    "rows_done": "rows finished so far, by this run and the runs it resumed",
    "rows_ok": "rows that finished without an error",
    "rows_error": "rows that finished with an error",
    "rows_resumed": "rows taken from an earlier run's checkpoint",
    "run_rows": "rows this process ran (after a resume: not those of the checkpoint)",
    "run_prefill_tokens": "prompt tokens this process fed through the model's forward pass",
    "run_completion_tokens": "tokens this process generated",
    "run_output_tokens_per_s": "tokens this process generated per second of its run",
    "prompt_tokens": "prompt tokens of the rows run",
    "prefill_tokens": "prompt tokens fed through the model's forward pass",
    "tree_tokens": "distinct prompt tokens in the prefix tree",
    "cached_tokens": "prompt tokens taken from a shared prefix instead of computed",
    "completion_tokens": "generated tokens",
    "output_tokens_per_s": "generated tokens per second of the run",
    "total_tokens_per_s": "prompt and generated tokens per second of the run",
    "kv_pages_total": "pages of the KV cache",
    "kv_pages_in_use": "KV cache pages in use now",
    "kv_pages_peak": "most KV cache pages in use at once",
    "preemptions": "sequences preempted for memory and recomputed",
    "prefix_evictions": "shared prefixes evicted from the KV cache before their last user",
    "waiting": "requests waiting to be scheduled (the queue)",
    "running": "sequences running",
    "wall_seconds": "seconds the run has taken",
    "startup_seconds": "seconds from the process start to the first forward pass",
    "import_seconds": "seconds of the phase: interpreter and packages",
    "read_seconds": "seconds of the phase: reading the input",
    "load_seconds": "seconds of the phase: loading the model",
    "tokenize_seconds": "seconds of the phase: chat template and tokenizer",
    "plan_seconds": "seconds of the phase: planning (prefix tree, groups, order)",
    "run_seconds": "seconds of the phase: the step loop",
    "write_seconds": "seconds of the phase: writing the final file",
    "process_seconds": "seconds from the process start to the files written",
    "parts_discarded": "checkpoint parts moved aside on resume (unreadable or another job's)",
    "start_timestamp_seconds": "when this run started (Unix time)",
    "last_success_timestamp_seconds": "when a run last wrote the final output (Unix time)",
    "exit_status": "the run's exit code (0 ok, 3 some error rows, 2 cannot start, 1 failed)",
}
PREFIX = "batchllm_"


def _label(value: str) -> str:
    value = redact(value)
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render(job: str, figures: dict[str, object]) -> str:
    """The text format: HELP, TYPE and one sample per known figure (non-numbers skipped)."""
    lines = []
    for name, text in GAUGES.items():
        value = figures.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            continue
        lines += [f"# HELP {PREFIX}{name} {text}", f"# TYPE {PREFIX}{name} gauge",
                  f'{PREFIX}{name}{{job="{_label(job)}"}} {value!r}']
    return "\n".join(lines) + "\n"


def previous_value(path: str, name: str) -> float | None:
    """A gauge's value in an existing file (None when there is none)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    m = re.search(rf"^{PREFIX}{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    try:
        return float(m.group(1)) if m else None
    except ValueError:
        return None


class PrometheusFile:
    """The figures of one run, rewritten on each update. A file that cannot be written does not
    stop the job: `error` says why, for a warning."""

    def __init__(self, path: str, job: str, **figures: object) -> None:
        self.path, self.job = path, job
        self.figures: dict[str, object] = dict(figures)
        last = previous_value(path, "last_success_timestamp_seconds")
        if last is not None:
            self.figures.setdefault("last_success_timestamp_seconds", last)
        self.error: str | None = None

    def update(self, **figures: object) -> None:
        self.figures.update(figures)
        try:
            folder = os.path.dirname(self.path)
            if folder:
                os.makedirs(folder, exist_ok=True)
            storage.write_text(self.path, render(self.job, self.figures))
        except OSError as e:
            self.error = str(e)
