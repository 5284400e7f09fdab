"""What a scheduler's log and a monitor see of a run: plain progress lines when stderr is a file,
and the Prometheus text file (output.prometheus) during and after the run.

No test here rests on the run's pace: the run is paced by its own checkpoint parts (the CLI
sleeps one progress interval after each part, so it spans several intervals on any machine) and
held after its first part until the test has read the live file."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
from job_files import OPS_ROWS, ops_job
from prometheus_client.parser import text_string_to_metric_families

LINE = re.compile(r"batchllm: progress (\d+)/60 rows \(\d+\.\d%\), \d+\.\d out tok/s, prefix hit "
                  r"\d+%, KV \d+/\d+ pages, \d+ preemptions, elapsed (\d+):(\d\d):(\d\d), "
                  r"left (~\d+:\d\d:\d\d|\?)")
EVERY = 0.1  # --progress-every

pytestmark = pytest.mark.slow  # the whole command in a process of its own

# The CLI paced by its parts: after each part it sleeps EVERY (so the run spans a progress
# interval per part, whatever the machine's pace); after the first, it writes the flag file and
# waits for the release file (the test reads the live Prometheus file meanwhile).
_PACED = """
import os, sys, time
from batchllm.rows.writer import CheckpointWriter
every, flag, release = float(sys.argv.pop(1)), sys.argv.pop(1), sys.argv.pop(1)
write, written = CheckpointWriter._write_part, []
def write_then_pace(self, rows):
    write(self, rows)
    written.append(len(rows))
    if len(written) == 1:
        open(flag, "w").close()
        while not os.path.exists(release):
            time.sleep(0.01)
    time.sleep(every)
CheckpointWriter._write_part = write_then_pace
from batchllm.cli import main
sys.argv[0] = "batchllm"
main()
"""


def _figures(text: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        assert family.type == "gauge" and family.name.startswith("batchllm_")
        sample, = family.samples
        assert sample.labels == {"job": "ops-test"}
        out[family.name.removeprefix("batchllm_")] = sample.value
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The operations job run with stderr into a file and a Prometheus file; what was seen."""
    tmp = tmp_path_factory.mktemp("monitored")
    prom = tmp / "textfile" / "ops.prom"
    job = ops_job(tmp, "run", output={"prometheus": str(prom)})
    flag, release = tmp / "held", tmp / "release"
    env = dict(os.environ, BATCHLLM_CHECKPOINT_ROWS="6", PYTHONUNBUFFERED="1")
    with open(tmp / "stderr.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", _PACED, str(EVERY), str(flag), str(release),
                                 "run", str(job), "--progress-every", str(EVERY)],
                                env=env, stdout=subprocess.PIPE, stderr=log, text=True)
        while not flag.exists():  # held after its first part: mid-run
            assert proc.poll() is None, (tmp / "stderr.log").read_text()
            time.sleep(0.01)
        live = _figures(prom.read_text())
        release.touch()
        proc.communicate(timeout=600)
    assert proc.returncode == 0, (tmp / "stderr.log").read_text()
    metrics = json.loads((tmp / "run" / "out.parquet.metrics.json").read_text())
    return {"log": (tmp / "stderr.log").read_bytes().decode(), "prom": prom, "live": live,
            "metrics": metrics}


def test_progress_is_one_plain_line_per_interval(run):
    log = run["log"]
    assert "\r" not in log
    lines = [x for x in log.splitlines() if x.startswith("batchllm: progress")]
    assert len(lines) >= 2, log  # the run spans an interval per part (ten parts)
    matches = [LINE.fullmatch(x) for x in lines]
    assert all(matches), lines
    done = [int(m.group(1)) for m in matches]
    elapsed = [int(m.group(2)) * 3600 + int(m.group(3)) * 60 + int(m.group(4)) for m in matches]
    assert done == sorted(done) and elapsed == sorted(elapsed)
    # a line each EVERY seconds, never two within one interval (elapsed is in whole seconds)
    assert len(lines) - 1 <= (elapsed[-1] - elapsed[0] + 1) / EVERY
    assert "batchllm: 60 rows (60 ok, 0 errors)" in log  # the summary block at the end


def test_prometheus_file_parses_and_equals_the_metrics_file(run):
    final, metrics = _figures(run["prom"].read_text()), run["metrics"]
    asked = ["rows_done", "rows_error", "prompt_tokens", "completion_tokens", "prefill_tokens",
             "tree_tokens", "output_tokens_per_s", "kv_pages_in_use", "kv_pages_peak",
             "preemptions", "prefix_evictions", "waiting", "last_success_timestamp_seconds",
             "exit_status"]
    assert [k for k in asked if k not in final] == []
    shared = sorted(set(final) & set(metrics))
    assert len(shared) >= 16, shared
    assert {k: final[k] for k in shared} == {k: float(metrics[k]) for k in shared}
    assert final["rows_done"] == final["rows"] == OPS_ROWS
    assert final["exit_status"] == 0 and final["kv_pages_in_use"] == 0
    assert final["last_success_timestamp_seconds"] >= final["start_timestamp_seconds"]
    assert sorted(p.name for p in run["prom"].parent.iterdir()) == ["ops.prom"]  # no temp left
    live = run["live"]  # read while the job was held after its first part: no exit status yet
    assert "exit_status" not in live and live["rows"] == OPS_ROWS
