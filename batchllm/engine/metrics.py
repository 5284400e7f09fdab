"""What a run measures: live counters for the progress line (EngineStats) and the run's figures
(RunMetrics), a typed record whose `to_dict` gives the metrics file's keys.

Each RunMetrics field says how the figures of several workers combine (`merge`: summed, the
largest, or the same everywhere), so merging workers is written once, here, by field.
"""

from __future__ import annotations

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
    device: str = _same("")
    dtype: str = _same("")
    model: str = _same("")

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
