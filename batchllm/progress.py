"""The progress line (tqdm on stderr) and the summary block at the end."""

from __future__ import annotations

import time

from tqdm import tqdm

from batchllm.engine.metrics import EngineStats
from batchllm.rows.record import Row


class Progress:
    """rows done / total, output tokens/s, shared-prefix hit rate, KV pages in use."""

    def __init__(self, total: int, already_done: int, enabled: bool = True) -> None:
        self.bar = tqdm(total=total, initial=already_done, unit="row", disable=not enabled,
                        dynamic_ncols=True, smoothing=0.1)
        self.start = time.perf_counter()
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self._last = 0.0
        self._rows = 0.0  # rows done here, a sample of a row with n samples counting 1/n
        self._shown = 0

    def row_done(self, row: Row) -> None:
        self.prompt_tokens += row.prompt_tokens
        self.cached_tokens += row.cached_tokens
        self._rows += 1 / row.num_samples
        whole = int(self._rows + 1e-6) - self._shown
        if whole:
            self._shown += whole
            self.bar.update(whole)

    def step(self, stats: EngineStats) -> None:
        now = time.perf_counter()
        if now - self._last < 0.5:
            return
        self._last = now
        hit = self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        self.bar.set_postfix_str(
            f"out {stats.completion_tokens / (now - self.start):.1f} tok/s, prefix hit {hit:.0%}, "
            f"KV {stats.kv_pages_in_use}/{stats.kv_pages_total} pages "
            f"({stats.kv_pages_shared} shared), "
            f"queue {stats.waiting}, preempt {stats.preemptions}",
        )

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
    return "\n".join(lines)
