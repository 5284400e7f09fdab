"""scripts/compile_check.py in CI: every Triton kernel, through its launcher's own plan and its
binder's specialisation, compiled for sm_90 and sm_80 by Triton's compiler and bundled ptxas
(no GPU needed); and a kernel change that breaks compilation turns it red.

CI runs a reduced matrix (REDUCED: bfloat16 and float32, head sizes 64 and 128, groups 1 and 7,
page size 16, every step kind, no window and no soft cap; then bfloat16 with a window and a soft
cap: ~230 specialisations, 2-3 minutes on 2 cores; then the FP8 KV cache's kernels in
bfloat16, FP8_KV); the script's default is the full one (5,760 variants: float16, groups 3, 4
and 8, 8 KV heads, page sizes 1 and 32, windows, soft caps and FP8 caches crossed with
everything), run by hand or on a bigger machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the fast lane leaves it out (README: Run the tests)

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]
REDUCED = ["--caps", "90,80", "--dtypes", "bfloat16,float32", "--head-dims", "64,128",
           "--groups", "1,7", "--kv-heads", "2", "--page-sizes", "16", "--windows", "0",
           "--softcaps", "0", "--kv-caches", "auto"]
OPTIONS = ["--caps", "90,80", "--dtypes", "bfloat16", "--head-dims", "64,128", "--groups", "7",
           "--kv-heads", "2", "--page-sizes", "16", "--windows", "4096", "--softcaps", "50",
           "--kv-caches", "auto"]
# The FP8 KV cache: its store, rotary store and attention kernels (e4m3 bits read as uint8,
# kernels/triton/fp8.py) in bfloat16, every step kind (with its decode splits and combine).
FP8_KV = ["--caps", "90,80", "--dtypes", "bfloat16", "--head-dims", "128", "--groups", "7",
          "--kv-heads", "2", "--page-sizes", "16", "--windows", "0", "--softcaps", "0",
          "--kv-caches", "fp8"]


def compile_check(args: list[str], prelude: str = "") -> subprocess.CompletedProcess:
    """The script in a fresh process (real kernels: no interpreter), after `prelude`."""
    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'scripts')!r})\n"
            "import compile_check\n" + prelude + f"\nsys.exit(compile_check.main({args!r}))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1200, check=False)


def test_every_kernel_compiles_for_sm90_and_sm80_without_spills():
    done = compile_check(REDUCED)
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0, "\n".join(lines[-30:]) + done.stderr[-3000:]
    summary = lines[-1]
    assert summary.startswith("compile_check: 32 variants x 2 targets (sm_90, sm_80)")
    assert summary.endswith("OK")
    assert "of 11 kernels" in summary  # every kernel of kernels/triton/ reached
    for cap in (90, 80):
        assert any(line.startswith(f"sm_{cap} bfloat16 _paged_attention_kernel[mixed]")
                   and "DECODE=True" in line for line in lines)
        assert any(line.startswith(f"sm_{cap} bfloat16 _prefix_attention_kernel[shared]")
                   for line in lines)


def test_a_planted_non_power_of_two_block_turns_it_red():
    """A kernel change that cannot compile (a key block of 48: tl.arange needs a power of two)
    fails the check, naming the kernel and the reason."""
    planted = (
        "import batchllm_kernels.triton.paged_attention as pa\n"
        "real = pa.launch_options\n"
        "def planted(*args):\n"
        "    options = real(*args)\n"
        "    options['BLOCK_N'] = 48\n"
        "    return options\n"
        "pa.launch_options = planted\n"
    )
    args = ["--caps", "90,80", "--dtypes", "bfloat16", "--head-dims", "64", "--groups", "7",
            "--kv-heads", "2", "--page-sizes", "16", "--steps", "decode", "--windows", "0",
            "--softcaps", "0"]
    done = compile_check(args, planted)
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 1, "\n".join(lines[-30:]) + done.stderr[-3000:]
    errors = [line for line in lines if " ERROR " in line]
    assert errors and all("_paged_attention_kernel[decode]" in line for line in errors)
    assert all("power of 2" in line for line in errors), errors
    assert {line.split()[0] for line in errors} == {"sm_90", "sm_80"}
    assert lines[-1].endswith("FAILED")
    assert sum(line.startswith("FAIL ") for line in lines) == len(errors)


def test_windows_and_soft_caps_compile_too():
    done = compile_check(OPTIONS)
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0, "\n".join(lines[-30:]) + done.stderr[-3000:]
    assert lines[-1].startswith("compile_check: 8 variants") and lines[-1].endswith("OK")
    assert any("WINDOW=4096" in line and "SOFTCAP=50.0" in line and "DECODE=True" in line
               for line in lines)


def test_the_fp8_kv_cache_compiles_without_spills():
    done = compile_check(FP8_KV)
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0, "\n".join(lines[-30:]) + done.stderr[-3000:]
    assert lines[-1].startswith("compile_check: 4 variants") and lines[-1].endswith("OK")
    for kernel in ("_store_kv_kernel", "_rope_store_kernel", "_paged_attention_kernel",
                   "_prefix_attention_kernel"):
        for cap in (90, 80):
            assert any(line.startswith(f"sm_{cap} bfloat16 {kernel}") and "FP8=True" in line
                       for line in lines), (kernel, cap)
