"""Host memory flat in the job's size (issue 27 item 2): what the driver holds grows by little per
extra row. A job of short templated prompts, 16 tokens each with 5 log-probability alternatives,
on a tiny random Llama, at two sizes, each in a fresh child process (scripts/measure_row_memory.py:
a warm-up job first, then the peak reset, each phase's peak read from VmHWM, the same figure as
resource.getrusage's ru_maxrss); parts every 32 rows, so that both sizes write parts.

Two figures per child:
- traced: the Python objects and numpy buffers alive the moment the engine returns (tracemalloc,
  started after the warm-up; numpy reports its buffers to it): the table of rows, the plan, the
  writer and whatever else the driver keeps. Measured 0.2 KB per extra row from 200 to 1,200 rows
  (2026-12-07, 321 -> 528 KiB, twice); a driver that keeps a copy of each finished row's
  output line (planted in CheckpointWriter.add) holds 3.4 KB more per row and fails the 1-KiB
  bound, the issue's goal. The resident set at the same moment
  (retained_kib, after gc, malloc_trim and Arrow's release_unused) is reported, not bounded: it
  moved from 2.2 to 9.1 KB per extra row between runs and machines (glibc's heap and transparent
  huge pages: a 2-MiB page appears in one child and not the next), while a 50,000-row job's
  resident set stayed within 740-757 MiB from its 8,000th row to its end.
- peak: the job's largest phase peak. The step loop's freed temporaries (logits of 64 rows are
  12.6 MB a step) stay in glibc's heap as fragments, and how far the heap grows moves from one
  child to the next: the same 200-row job peaked at 520 and 620 MiB in its run phase. The peak's
  bound is therefore loose (what it catches: holding a step's tensors per row); the 1-KiB goal
  for the peak is the script's, read off medians at 4,000, 12,000 and 24,000 rows.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from measure_row_memory import measure, write_job

pytestmark = pytest.mark.slow  # the fast lane leaves it out (README: Run the tests)

SMALL, LARGE = 200, 1200
TRACED_BOUND = 1024  # bytes per extra row: measured 0.2 KB (module docstring)
PEAK_BOUND = 256 * 1024  # bytes per extra row: above the run phase's 100 MiB spread / 1,000 rows


def test_memory_per_extra_row(tmp_path: Path) -> None:
    got = {n: measure(write_job(tmp_path / str(n), n, 16, 5), checkpoint_rows=32, retained=True)
           for n in (SMALL, LARGE)}
    assert all(got[n]["rows"] == n for n in got)

    def per_row(key: str) -> float:
        return (got[LARGE][key] - got[SMALL][key]) * 1024 / (LARGE - SMALL)

    assert per_row("traced_kib") <= TRACED_BOUND, (
        f"the driver held {per_row('traced_kib'):.0f} bytes of Python objects and numpy buffers "
        f"more per extra row after the run (bound {TRACED_BOUND}): {got}")
    assert per_row("peak_kib") <= PEAK_BOUND, (
        f"peak RSS grew by {per_row('peak_kib'):.0f} bytes per extra row (bound {PEAK_BOUND}): "
        f"{got}")
