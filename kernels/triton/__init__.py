"""The Triton kernels of the CUDA path, one per file: a private `_name_kernel` and one public
launcher that checks its inputs (checks.py) and computes the grid. Each launcher builds its
launches as data with a `plan_*` function (launch.py) and runs them; scripts/compile_check.py
compiles the same plans for real GPU targets.

  store_kv.py          a step's new K and V into their slots of the paged cache
  rotary.py            the rotary embedding of q and k in place, with the KV store
  rms_norm.py          the residual add and RMSNorm in one pass
  gated_mul.py         SiLU- or GELU-tanh-and-multiply of the gate-up projection
  paged_attention.py   causal attention of a step (prefill chunks and decodes) over paged KV
  prefix_attention.py  each group's queries against its shared prefix pages (cascade)
  merge_states.py      two attention states over disjoint keys merged by log-sum-exp
  combine_splits.py    the key splits of one attention launch folded by log-sum-exp
  tiles.py             the jitted pieces the two attention kernels share
  fp8.py               the e4m3 codec of the FP8 KV cache and the FP8 weights
  checks.py            the launchers' input checks and grid arithmetic
  launch.py            a launch as data, and the one place that launches

Their pure-torch twins are in batchllm_kernels.reference. Importing this package needs triton;
without it the import fails here, with the reason. Under TRITON_INTERPRET=1 (set before these
modules are imported) the launchers also run on CPU tensors, slowly: that is how the tests, and
BATCHLLM_BACKEND=triton on a machine without a GPU, run them. (The interpreter truncates
float32 -> bfloat16 casts where a GPU rounds to nearest even; the tests round as a GPU does:
tests/triton_rounding.py.)
"""

import importlib
import os
import sys

try:
    import triton  # noqa: F401
except ImportError as error:  # triton is not installed (CPU-only machines)
    raise ImportError(
        "batchllm_kernels.triton needs triton, which could not be imported "
        f"({type(error).__name__}: {error}); on the CPU use the twins in "
        f"batchllm_kernels.reference"
    ) from error


def _interpret_triton_library() -> None:
    """Triton makes its own @jit library functions (tl.zeros, tl.max, tl.sum ...) when it is
    imported; if that was before TRITON_INTERPRET=1 was set (importing transformers' models
    imports triton), remake them for the interpreter, as our kernels will be."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(tl.zeros, InterpretedFunction):
        return
    standard = importlib.reload(sys.modules["triton.language.standard"])
    for name, value in vars(standard).items():
        if isinstance(value, InterpretedFunction) and hasattr(tl, name):
            setattr(tl, name, value)


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpret_triton_library()
