"""The progress of a run on stderr, the live Prometheus file, and the summary block at the end.

On a terminal, a tqdm bar. Anywhere else (cron, systemd, a CI log), one plain line every
`every` seconds, with no carriage returns:
  batchllm: progress 120/960 rows (12.5%), 312.4 out tok/s, prefix hit 92%, KV 120/331 pages,
  0 preemptions, elapsed 0:01:30, left ~0:10:30
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm import tqdm

from batchllm.engine.metrics import EngineStats
from batchllm.rows.prometheus import PrometheusFile
from batchllm.rows.record import ERROR, Row

PROMETHEUS_EVERY = 5.0  # seconds between live updates of the Prometheus file


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class Progress:
    """rows done / total, output tokens/s, shared-prefix hit rate, KV pages in use, preemptions.

    enabled: False (--quiet) prints nothing; the Prometheus file is updated either way."""

    def __init__(self, total: int, already_done: int, enabled: bool = True, every: float = 30.0,
                 stream: TextIO | None = None, prometheus: PrometheusFile | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.plain = enabled and not _is_terminal(self.stream)
        self.bar = tqdm(total=total, initial=already_done, unit="row", file=self.stream,
                        disable=not enabled or self.plain, dynamic_ncols=True, smoothing=0.1)
        self.total, self.done, self.resumed = total, already_done, already_done
        self.every = every
        self.prometheus = prometheus
        self.start = time.perf_counter()
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.rows_error = 0
        self.stats = EngineStats()
        self._last_postfix = self._last_line = self._last_prom = self.start
        self._rows = 0.0  # rows done here, a sample of a row with n samples counting 1/n
        self._shown = 0  # of them, those added to `done`

    def row_done(self, row: Row) -> None:
        self.prompt_tokens += row.prompt_tokens
        self.cached_tokens += row.cached_tokens
        self.rows_error += row.finish_reason == ERROR
        self._rows += 1 / row.num_samples
        whole = int(self._rows + 1e-6) - self._shown
        if whole:
            self._shown += whole
            self.add_rows(whole)

    def add_rows(self, n: int) -> None:
        """n more rows done (a sharded job counts its workers' parts)."""
        self.done += n
        self.bar.update(n)
        self.tick()

    def step(self, stats: EngineStats) -> None:
        self.stats = stats
        now = time.perf_counter()
        if not self.bar.disable and now - self._last_postfix >= 0.5:
            self._last_postfix = now
            self.bar.set_postfix_str(
                f"out {self._rate(now):.1f} tok/s, prefix hit {self._hit():.0%}, "
                f"KV {stats.kv_pages_in_use}/{stats.kv_pages_total} pages "
                f"({stats.kv_pages_shared} shared), "
                f"queue {stats.waiting}, preempt {stats.preemptions}",
            )
        self.tick()

    def tick(self) -> None:
        """Write the plain line and the Prometheus file when their time has come."""
        now = time.perf_counter()
        if self.plain and now - self._last_line >= self.every:
            self._last_line = now
            print(self.line(now), file=self.stream, flush=True)
        if self.prometheus is not None and now - self._last_prom >= PROMETHEUS_EVERY:
            self._last_prom = now
            self.prometheus.update(**self.live())

    def _rate(self, now: float) -> float:
        return self.stats.completion_tokens / max(now - self.start, 1e-9)

    def _hit(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def line(self, now: float | None = None) -> str:
        """The plain progress line."""
        now = time.perf_counter() if now is None else now
        elapsed, s = now - self.start, self.stats
        ran = self.done - self.resumed
        left = f"~{_clock((self.total - self.done) * elapsed / ran)}" if ran else "?"
        share = self.done / self.total if self.total else 1.0
        return (f"batchllm: progress {self.done}/{self.total} rows ({share:.1%}), "
                f"{self._rate(now):.1f} out tok/s, prefix hit {self._hit():.0%}, "
                f"KV {s.kv_pages_in_use}/{s.kv_pages_total} pages, {s.preemptions} preemptions, "
                f"elapsed {_clock(elapsed)}, left {left}")

    def live(self) -> dict[str, object]:
        """The run's figures so far, for the Prometheus file."""
        s, elapsed = self.stats, time.perf_counter() - self.start
        return {
            "rows": self.total, "rows_done": self.done, "rows_error": self.rows_error,
            "rows_resumed": self.resumed, "prompt_tokens": self.prompt_tokens,
            "prefill_tokens": s.prefill_tokens, "cached_tokens": self.cached_tokens,
            "completion_tokens": s.completion_tokens, "output_tokens_per_s": self._rate(
                time.perf_counter()), "kv_pages_total": s.kv_pages_total,
            "kv_pages_in_use": s.kv_pages_in_use, "kv_pages_peak": s.kv_pages_peak,
            "preemptions": s.preemptions, "prefix_evictions": s.prefix_evictions,
            "waiting": s.waiting, "running": s.running, "wall_seconds": elapsed,
        }

    def close(self) -> None:
        self.bar.close()


def summary(metrics: dict, output: str) -> str:
    m = metrics
    lines = [
        f"batchllm: {m['rows']} rows ({m['rows_ok']} ok, {m['rows_error']} errors) -> {output}",
        (f"  tokens: prompt {m['prompt_tokens']}, prefilled {m['prefill_tokens']} "
         f"(tree {m['tree_tokens']}, cached {m['cached_tokens']}), completion "
         f"{m['completion_tokens']}"),
        (f"  speed: {m['wall_seconds']:.1f} s, {m['output_tokens_per_s']:.1f} output tok/s, "
         f"{m['total_tokens_per_s']:.1f} total tok/s"),
        (f"  KV cache: {m['kv_pages_total']} pages of {m['page_size']} tokens "
         f"({m['kv_bytes_per_token']} bytes/token), peak {m['kv_pages_peak']} "
         f"(shared {m['kv_pages_shared_peak']}), preemptions {m['preemptions']}"),
        f"  model {m['model']} on {m['device']} ({m['dtype']})",
    ]
    if m.get("rows_resumed") or m.get("parts_discarded"):
        if "run_rows" in m:  # the figures above are this process's; the rows the file's
            lines.append(f"  this run: {m['run_rows']} rows, prefilled {m['run_prefill_tokens']},"
                         f" completion {m['run_completion_tokens']}, "
                         f"{m['run_output_tokens_per_s']:.1f} output tok/s")
        lines.append(f"  resumed: {m.get('rows_resumed', 0)} rows from the checkpoint, "
                     f"{m.get('parts_discarded', 0)} parts discarded")
    return "\n".join(lines)
