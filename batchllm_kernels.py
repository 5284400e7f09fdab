"""batchllm's kernels: the kernels/ folder, imported as `batchllm_kernels` (never as `kernels`,
the import name of Hugging Face's kernels package, which transformers imports).

An installed batchllm maps the name to the folder (pyproject.toml's package-dir); this file does
the same for a source tree on sys.path (tests and scripts run from the repository root, or
PYTHONPATH set to it), so that they import this tree's kernels and not an installed copy's. The
folder has no __init__.py: from the root it is only a namespace portion named `kernels`, which
any installed `kernels` package beats.

  kernels/triton/     the Triton kernels of the CUDA path, one per file, each behind a launcher
                      that checks its inputs (needs triton; nothing else imports it)
  kernels/cpu/        the CPU path's C kernels (sources, header), their builder and ctypes
                      bindings, and the CPU attention dispatcher (C or torch per part of a step)
  kernels/reference/  the pure-torch twins of both (store, paged and prefix attention, merge,
                      pointwise steps) and the step index they use
  kernels/atomic_write.py  the one write-then-rename helper

Which of them a model runs is picked once per (device, dtype) in batchllm/model/ops.py.
"""

import os

__path__ = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels")]
