"""Host memory flat in the job's size (issue 27 item 2): the peak resident set of a job grows by
little per extra row. A job of short templated prompts, 16 tokens each with 5 log-probability
alternatives, on a tiny random Llama, at two sizes, each in a fresh child process
(scripts/measure_row_memory.py: a warm-up job first, then the peak reset and read through
resource.getrusage); parts every 32 rows, so that both sizes write parts (Arrow's memory pool
grows once, at the first one, by tens of MiB).

A driver that kept every finished row's token ids, text and log-probabilities (Python objects:
~16 x (TokenLogprob + 5 tuples)) measured ~BEFORE bytes per extra row; one that lets them go
~AFTER (see the bound's comment).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from measure_row_memory import measure, write_job

SMALL, LARGE = 200, 1000
BOUND = 4096  # bytes per extra row: see the module docstring


def test_peak_memory_per_extra_row(tmp_path: Path) -> None:
    peaks = {n: measure(write_job(tmp_path / str(n), n, 16, 5), checkpoint_rows=32)
             for n in (SMALL, LARGE)}
    assert all(peaks[n]["rows"] == n for n in peaks)
    per_row = (peaks[LARGE]["peak_kib"] - peaks[SMALL]["peak_kib"]) * 1024 / (LARGE - SMALL)
    assert per_row <= BOUND, (f"peak RSS grew by {per_row:.0f} bytes per extra row "
                              f"(bound {BOUND}): {peaks}")
