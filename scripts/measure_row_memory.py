"""Host memory per row of a job: the peak resident set of `run_job` in fresh child processes at
several sizes, each phase's peak, and the growth per extra row read off a least-squares line
through the sizes' medians (the difference cancels the model, torch and everything else a job
holds whatever its size).

    python scripts/measure_row_memory.py [--rows 4000,12000,24000] [--repeat 3]
        [--max-tokens 16] [--logprobs 5] [--out DIR] [--sample-every SECONDS]

Each child first runs a warm-up job of the same shape (WARM_ROWS rows: torch imported, the model
loaded once, the allocator's arenas made), lets the warm-up's objects go (frozen by
batchllm.collector: unfrozen and collected, for the job to reuse) and then runs the measured job
with each phase's peak taken apart: at a phase's start the peak so far is booked to the phase
that ends and the peak is reset (/proc/self/clear_refs 5: VmHWM, which getrusage's ru_maxrss
follows, starts again from the current resident set). The phases: `start` (lock, input read,
the model loaded again), `tokenize` (rows/build.py), `plan` (admission, the prefix tree, the
plan), `run` (Engine.generate), `after_run`, `write` (the final file's merge). The job's peak
is the largest. Parts are cut every 256 rows by count, never by the clock, and the children's
hash seed is fixed, so that only the process itself varies.

Where the noise is (2026-12-07, this 2-core machine): the run phase. The same 4,000-row job
peaked there at 679, 711 and 738 MiB in three children, the same 200-row job at 520 and 620,
while tokenize and plan repeat within 1 MiB. Not the hash seed, address randomization, Arrow's
pool or the clock's part flushes (each ruled out); it is the step loop's freed temporaries (a
step's logits for 64 rows are 12.6 MB) left as fragments in glibc's heap, which
engine/cpu_allocator.py keeps (mmap threshold 32 MiB, no trim below 1 GiB): with the threshold
at 4 MiB the same 1,000-row job peaked at 538-550 MiB over five children, not 648-711, but
took 42-44 s of CPU against 19 (each step's large blocks mapped and faulted in afresh). Hence
`--repeat` children per size, their median, and a fit through three sizes rather than the
difference of two peaks (also printed: bytes_per_extra_row_ends, the issue's first-to-last
definition); and the CI test (tests/test_row_memory.py) bounds what the driver holds after the
run (`retained` mode: the Python objects and numpy buffers traced by tracemalloc, started after
the warm-up; the resident set with the freed memory given back is reported beside them, but it
moves by megabytes from child to child: glibc's heap, transparent huge pages).

The job (issue 27): short templated prompts on a tiny random Llama (tests/hf_reference.py) on the
CPU, sampled, each row `--max-tokens` tokens with `--logprobs` alternatives, max_num_seqs 64.
Prints one JSON line per child (rows, wall_s, cpu_s, peak_mib, phases' peaks in MiB), one per
size (the medians), then the fit: bytes per extra row of the job's peak and of each phase's.
--sample-every: each child's VmRSS every that many seconds in OUT/ROWS/rss.csv (a long run's
record: the 1M-row job). `child JOB [1]` is the measuring child itself (1: retained mode, with
tracemalloc on during the measured job).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

WARM_ROWS = 64


def prompts(n: int) -> list[str]:
    """n short templated prompts (a few distinct templates, the numbers varying)."""
    return [f"Order {i}: ship {i % 7} boxes to city {i % 13} by day {i % 31}. Confirm?"
            for i in range(n)]


def write_job(folder: Path, rows: int, max_tokens: int, logprobs: int) -> Path:
    """folder/in.parquet with `rows` prompts and folder/job.yaml running them."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from hf_reference import tiny_model_folder

    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "in.parquet"
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(rows)], "prompt": prompts(rows)}),
                   data)
    job = {
        "name": f"row-memory-{rows}",
        "model": {"path": str(tiny_model_folder("llama")), "device": "cpu"},
        "input": {"path": str(data)},
        "output": {"path": str(folder / "out.parquet"), "mode": "overwrite"},
        "sampling": {"max_tokens": max_tokens, "temperature": 0.8, "seed": 1,
                     "logprobs": logprobs},
        "engine": {"kv_cache_memory": "32MiB", "max_num_seqs": 64},
    }
    path = folder / "job.yaml"
    path.write_text(json.dumps(job))  # JSON is YAML
    return path


def _status_kib(key: str, pid: int | str = "self") -> int:
    """A /proc/PID/status figure in KiB: VmHWM (the peak resident set since start or the last
    reset), VmRSS."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {key} in /proc/{pid}/status")


def retained_kib() -> int:
    """The resident set once the garbage is collected and glibc and Arrow have given their free
    memory back (malloc_trim, release_unused): what the process still holds, without the
    step loop's freed temporaries, whose fragmented heap moves the peak by tens of MiB."""
    import ctypes

    import pyarrow as pa

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    pa.default_memory_pool().release_unused()
    return _status_kib("VmRSS")


class PhasePeaks:
    """Each phase's peak resident set (KiB): enter(name) books the peak so far to the phase
    that ends and resets it."""

    def __init__(self) -> None:
        self.phase = "start"
        self.peaks: dict[str, int] = {}
        Path("/proc/self/clear_refs").write_text("5")

    def enter(self, name: str) -> None:
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), _status_kib("VmHWM"))
        Path("/proc/self/clear_refs").write_text("5")
        self.phase = name


def _around(owner, name: str, peaks: PhasePeaks, phase: str, after: str | None,
            on_return=None) -> None:
    """owner.name wrapped: phase `phase` entered before it runs, on_return() called and `after`
    entered once it returns."""
    inner = getattr(owner, name)

    def wrapped(*args, **kwargs):
        peaks.enter(phase)
        try:
            return inner(*args, **kwargs)
        finally:
            if on_return:
                on_return()
            if after:
                peaks.enter(after)

    setattr(owner, name, wrapped)


def child(job: str, retained: bool) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    import batchllm.job
    from batchllm.engine.engine import Engine
    from batchllm.job import run_job
    from batchllm.rows.writer import CheckpointWriter

    warm = Path(job).parent / "warm"
    warm.mkdir(exist_ok=True)
    pq.write_table(pa.table({"id": [f"w{i}" for i in range(WARM_ROWS)],
                             "prompt": prompts(WARM_ROWS)}), warm / "in.parquet")
    spec = json.loads(Path(job).read_text())
    spec.update(name="row-memory-warm-up", input={"path": str(warm / "in.parquet")},
                output={"path": str(warm / "out.parquet"), "mode": "overwrite"})
    (warm / "job.yaml").write_text(json.dumps(spec))
    run_job(warm / "job.yaml", progress=False)
    gc.unfreeze()  # what the warm-up froze (batchllm.collector) is freed, for the job to reuse
    gc.collect()
    # parts of checkpoint_rows rows each, never by the clock (a flush every 5 s, as a user's
    # job does, makes the parts' sizes, and Arrow's allocations, depend on the machine's load)
    CheckpointWriter.maybe_flush = lambda w: (len(w._rows) >= w.flush_rows and w.flush())
    peaks = PhasePeaks()
    held: dict[str, int] = {}

    def after_run() -> None:  # the rows' table, the plan, the writer are alive here
        held["retained_kib"] = retained_kib()
        held["traced_kib"] = tracemalloc.get_traced_memory()[0] // 1024

    _around(batchllm.job, "build_table", peaks, "tokenize", "plan")
    _around(Engine, "generate", peaks, "run", "after_run", after_run if retained else None)
    _around(CheckpointWriter, "finalize", peaks, "write", None)
    if retained:
        tracemalloc.start()
    start = time.perf_counter()
    metrics = run_job(job, progress=False)
    peaks.enter("end")
    usage = resource.getrusage(resource.RUSAGE_SELF)  # the warm-up's included
    print(json.dumps({"rows": metrics["rows"], "wall_s": round(time.perf_counter() - start, 1),
                      "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
                      "peak_kib": max(peaks.peaks.values()), "phases_kib": peaks.peaks,
                      **held}))


def measure(job: Path, checkpoint_rows: int = 256, retained: bool = False,
            sample_every: float = 0.0) -> dict:
    """Runs the job in a fresh child (a part every `checkpoint_rows` rows); its rows, wall
    seconds, peak resident set (peak_kib) and each phase's (phases_kib). retained: also the
    resident set the moment the engine returns, after the freed memory is given back
    (retained_kib), and the Python objects and numpy buffers alive then (traced_kib, by
    tracemalloc: the table of rows, the plan, the writer and whatever else the driver keeps;
    the peaks that follow are then not the job's own). sample_every: the child's
    VmRSS every that many seconds, appended to rss.csv beside the job (seconds, MiB)."""
    env = {**os.environ, "BATCHLLM_CHECKPOINT_ROWS": str(checkpoint_rows),
           "PYTHONHASHSEED": "0"}  # sets' and dicts' orders, hence allocations, run to run
    cmd = [sys.executable, __file__, "child", str(job), str(int(retained))]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env) as proc:
        if sample_every > 0:
            _sample_rss(proc, job.parent / "rss.csv", sample_every)
        out, err = proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"the measuring child failed ({proc.returncode}):\n{err[-4000:]}")
    return json.loads(out.strip().splitlines()[-1])


def _sample_rss(proc: subprocess.Popen, path: Path, every: float) -> None:
    """Until proc ends: its VmRSS every `every` seconds, a line "seconds,MiB" each."""
    start = time.monotonic()
    with path.open("a") as f:
        while proc.poll() is None:
            try:
                rss = _status_kib("VmRSS", proc.pid)
            except (OSError, RuntimeError):  # ending
                break
            f.write(f"{time.monotonic() - start:.0f},{rss / 1024:.1f}\n")
            f.flush()
            time.sleep(every)


def slope(xs: list[float], ys: list[float]) -> float:
    """The least-squares slope of ys over xs."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return (sum((x - mx) * (y - my) for x, y in zip(xs, ys))
            / sum((x - mx) ** 2 for x in xs))


def main() -> None:
    if sys.argv[1:2] == ["child"]:
        return child(sys.argv[2], sys.argv[3:4] == ["1"])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="4000,12000,24000")
    ap.add_argument("--repeat", type=int, default=3, help="children per size (their median)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--logprobs", type=int, default=5)
    ap.add_argument("--out", default="/tmp/batchllm-row-memory")
    ap.add_argument("--sample-every", type=float, default=0.0,
                    help="seconds between VmRSS samples of each child, in OUT/ROWS/rss.csv")
    args = ap.parse_args()
    sizes = [int(s) for s in args.rows.split(",")]
    medians = []
    for n in sizes:
        job = write_job(Path(args.out) / str(n), n, args.max_tokens, args.logprobs)
        runs = []
        for _ in range(args.repeat):
            r = measure(job, sample_every=args.sample_every)
            runs.append(r)
            print(json.dumps({"rows": r["rows"], "wall_s": r["wall_s"], "cpu_s": r["cpu_s"],
                              "peak_mib": round(r["peak_kib"] / 1024, 1),
                              "phases_mib": {k: round(v / 1024, 1)
                                             for k, v in r["phases_kib"].items()}}), flush=True)
        phases = {k: statistics.median(r["phases_kib"].get(k, 0) for r in runs)
                  for k in runs[0]["phases_kib"]}
        med = {"rows": n, "median_peak_mib": round(statistics.median(
            r["peak_kib"] for r in runs) / 1024, 1),
            "median_phases_mib": {k: round(v / 1024, 1) for k, v in phases.items()}}
        print(json.dumps(med), flush=True)
        medians.append(med)
    if len(sizes) < 2:  # one size: no growth to report
        return
    xs = [m["rows"] for m in medians]
    fit = {"bytes_per_extra_row": round(slope(xs, [m["median_peak_mib"] * 2**20
                                                   for m in medians])),
           "bytes_per_extra_row_ends": round((medians[-1]["median_peak_mib"]
                                              - medians[0]["median_peak_mib"]) * 2**20
                                             / (xs[-1] - xs[0])),
           "phases_bytes_per_extra_row": {
               k: round(slope(xs, [m["median_phases_mib"].get(k, 0) * 2**20 for m in medians]))
               for k in medians[0]["median_phases_mib"]}}
    print(json.dumps(fit))


if __name__ == "__main__":
    main()
