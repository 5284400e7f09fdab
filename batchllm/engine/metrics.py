"""What a run measures: live counters for the progress line (EngineStats), the run's figures
(RunMetrics), a typed record whose `to_dict` gives the metrics file's keys, and the phases of a
job (Phases, phase_report).

Each RunMetrics field says how the figures of several workers combine (`merge`: summed, the
largest, or the same everywhere), so merging workers is written once, here, by field.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields, replace


@dataclass
class EngineStats:
    """Live and final counters of the step loop, for the progress line and the metrics."""

    kv_pages_total: int = 0
    kv_bytes_per_token: int = 0
    prefill_tokens: int = 0  # prompt tokens fed through the forward pass, counted where it runs
    completion_tokens: int = 0
    rows_done: int = 0
    steps: int = 0
    steps_replayed: int = 0  # steps run from a captured CUDA graph
    steps_overlapped: int = 0  # steps launched before the last step's sampled ids were read
    step_host_seconds: float = 0.0  # step loop time outside the forward and sampling kernels
    preemptions: int = 0
    prefix_evictions: int = 0  # shared prefixes dropped from the cache before their last user
    kv_pages_in_use: int = 0
    kv_pages_peak: int = 0
    kv_pages_shared: int = 0
    kv_pages_shared_peak: int = 0
    waiting: int = 0
    running: int = 0


def _sum(default=0):
    return field(default=default, metadata={"merge": "sum"})


def _max(default=0):
    return field(default=default, metadata={"merge": "max"})


def _same(default=None):
    return field(default=default, metadata={"merge": "same"})


@dataclass
class RunMetrics:
    """The figures of one run of the engine over a list of rows (DESIGN.md "Output Parquet")."""

    rows: int = _sum()  # rows this run was given, minus those done by an earlier run
    prompt_tokens: int = _sum()
    prefill_tokens: int = _sum()
    tree_tokens: int = _sum()  # distinct prompt tokens of the rows run (per worker: its own tree)
    cached_tokens: int = _sum()
    completion_tokens: int = _sum()
    wall_seconds: float = _max(0.0)
    kv_pages_total: int = _max()
    kv_pages_peak: int = _max()
    kv_pages_shared_peak: int = _max()
    kv_bytes_per_token: int = _same(0)
    page_size: int = _same(0)
    preemptions: int = _sum()
    prefix_evictions: int = _sum()
    steps: int = _sum()
    steps_replayed: int = _sum()  # steps run from a captured CUDA graph
    # steps whose forward and sampling were launched before the previous step's sampled ids were
    # read on the host (engine.overlap; 0 without it)
    steps_overlapped: int = _sum()
    # the step loop's time outside the model's forward and the sampling kernels (what a device
    # would wait for); per step: / steps
    step_host_seconds: float = _sum(0.0)
    plan_seconds: float = _max(0.0)  # planning the rows (tree, groups, order)
    run_seconds: float = _max(0.0)  # the engine's step loop, first forward to last row
    device: str = _same("")
    dtype: str = _same("")
    model: str = _same("")
    kernel_path: str = _same("")  # which kernels ran: cuda-triton, cpu-c-avx512, cpu-torch, ...

    @property
    def output_tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_seconds if self.wall_seconds else 0.0

    @property
    def total_tokens_per_s(self) -> float:
        total = self.prompt_tokens + self.completion_tokens
        return total / self.wall_seconds if self.wall_seconds else 0.0

    def to_dict(self) -> dict:
        """The metrics file's keys, rates included."""
        d = asdict(self)
        d["output_tokens_per_s"] = self.output_tokens_per_s
        d["total_tokens_per_s"] = self.total_tokens_per_s
        return d

    @classmethod
    def merge(cls, parts: list[RunMetrics], **overrides) -> RunMetrics:
        """Several runs as one (workers of one job): each field by its rule; `overrides` set
        fields that the parts cannot tell (the job's wall time, the whole job's tree)."""
        merged = cls()
        for f in fields(cls):
            values = [getattr(p, f.name) for p in parts]
            if not values:
                continue
            rule = f.metadata["merge"]
            value = sum(values) if rule == "sum" else max(values) if rule == "max" else values[0]
            setattr(merged, f.name, value)
        return replace(merged, **overrides)


# The phases of a job, each measured by the code that does it, as flat keys of the metrics file
# (`<phase>_seconds`: one number per key, as the Prometheus file and `jq` read them). They run
# one after the other, so that they add up to the whole (`process_seconds`, less the lock and
# the output checks); `startup_seconds` is the span the user waits for the first forward:
# import + read + load + tokenize + plan.
PHASES = {  # key -> what it covers
    "import": "interpreter and packages: before reading starts, and the engine's import",
    "read": "reading the input (and its digest for resume)",
    "load": "model: config, weights, panels, tokenizer, KV pool",
    "tokenize": "chat template and tokenizer over every row",
    "plan": "prefix tree, groups and order",
    "run": "the step loop: prefill and decode",
    "write": "the final file",
}


def process_started() -> float:
    """When this process started, on time.perf_counter's clock (Linux: /proc/self/stat's start
    time, 10 ms resolution; elsewhere: now, i.e. when the command began to run)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, after the name
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.perf_counter() - max(0.0, age)
    except (OSError, ValueError, IndexError, AttributeError):
        return time.perf_counter()


class Phases:
    """The job's phase durations, from `started` (perf_counter time: the process start for
    the command, the call for run_job from Python)."""

    def __init__(self, started: float | None = None) -> None:
        self.started = time.perf_counter() if started is None else started
        self.seconds: dict[str, float] = {}
        self.first_forward: float | None = None  # perf_counter time of the model's first call
        self.notes: dict[str, str] = {}  # what explains a phase: {"panel_cache": "hit"}

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Add the time the block takes to `phase`."""
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t

    def since_start(self, phase: str) -> None:
        """Add the time from `started` to now to `phase` (what ran before the job's code)."""
        self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - self.started

    def to_dict(self) -> dict[str, float]:
        """`<phase>_seconds` for each phase measured, `startup_seconds` when a forward ran,
        `process_seconds` (start to now)."""
        d = {f"{p}_seconds": self.seconds[p] for p in PHASES if p in self.seconds}
        if self.first_forward is not None:
            d["startup_seconds"] = self.first_forward - self.started
        d["process_seconds"] = time.perf_counter() - self.started
        return {**d, **self.notes}


def phase_report(metrics: dict) -> str:
    """`batchllm run --profile`'s table: each phase's seconds and share of the whole."""
    whole = metrics.get("process_seconds") or 0.0
    lines = ["batchllm: profile (seconds)"]
    for phase, what in PHASES.items():
        value = metrics.get(f"{phase}_seconds")
        if value is not None:
            share = f"{100 * value / whole:3.0f}%" if whole else ""
            lines.append(f"  {phase:<9}{value:8.2f} {share:>4}  {what}")
    measured = sum(metrics.get(f"{p}_seconds") or 0.0 for p in PHASES)
    lines.append(f"  {'other':<9}{whole - measured:8.2f}       lock, output checks, progress")
    lines.append(f"  {'whole':<9}{whole:8.2f}       process start -> files written")
    if metrics.get("startup_seconds") is not None:
        cache = metrics.get("panel_cache")
        lines.append(f"  {'start-up':<9}{metrics['startup_seconds']:8.2f}       process start -> "
                     "first forward" + (f" (panel file: {cache})" if cache else ""))
    return "\n".join(lines)
