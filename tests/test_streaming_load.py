"""The streaming load's host memory (model/weights.py), measured in fresh child processes by
scripts/measure_load_rss.py on a ~220 MB random Llama saved by transformers in one file.

Peak resident set during load_model at most what the model holds plus its largest tensor plus
a small constant; after the load, at most what it holds plus that constant (a load that keeps
the file's mapping alive holds the whole file on top: ~220 MB here); and a warm start whose
projections come from the panel file reads almost nothing of the checkpoint.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from measure_load_rss import measure, random_llama

pytestmark = pytest.mark.slow  # the fast lane leaves it out (README: Run the tests)

SLACK_MB = 48  # weights.TRIM_BYTES of untrimmed holes and the interpreter's noise: measured
# 19-35 MB above the model and its largest tensor here


@functools.cache
def checkpoint(saved: str) -> Path:
    root = Path(tempfile.mkdtemp(prefix="batchllm-rss-"))
    atexit.register(shutil.rmtree, root, True)
    return random_llama(root / f"llama-{saved}", hidden=512, layers=12, vocab=8192, saved=saved)


@pytest.mark.parametrize("saved", ["float32", "bfloat16"])
def test_a_load_holds_one_tensor_beyond_the_model(saved: str, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("BATCHLLM_PANEL_CACHE", "0")  # the loader alone (the file: below)
    m = measure(checkpoint(saved), "float32", tmp_path / "cache")
    assert m["checkpoint_mb"] > 100
    grown, peak = m["after_mb"] - m["baseline_mb"], m["peak_mb"] - m["baseline_mb"]
    assert grown <= m["held_mb"] + SLACK_MB, m
    # a bfloat16 tensor is cast to float32, then cut into panels: both copies live for a moment
    copies = 1 if saved == "float32" else 2
    assert peak <= m["held_mb"] + copies * m["largest_mb"] + SLACK_MB, m


def test_a_warm_start_reads_no_projection(tmp_path: Path) -> None:
    folder = checkpoint("float32")
    cold = measure(folder, "float32", tmp_path / "cache")
    warm = measure(folder, "float32", tmp_path / "cache")
    assert (cold["panel_cache"], warm["panel_cache"]) == ("written", "hit")
    assert warm["after_mb"] - warm["baseline_mb"] <= SLACK_MB, warm
    assert cold["peak_mb"] - cold["after_mb"] <= cold["largest_mb"] + SLACK_MB, cold
