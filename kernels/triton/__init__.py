"""The Triton kernels of the CUDA path, one per file: a private `_name_kernel` and one public
launcher that checks its inputs (checks.py) and computes the grid.

  store_kv.py          a step's new K and V into their slots of the paged cache
  paged_attention.py   causal attention of a step (prefill chunks and decodes) over paged KV
  prefix_attention.py  each group's queries against its shared prefix pages (cascade)
  merge_states.py      two attention states over disjoint keys merged by log-sum-exp
  tiles.py             the jitted pieces the two attention kernels share
  checks.py            the launchers' input checks and grid arithmetic

Their pure-torch twins are in kernels.reference. Importing this package needs triton; without
it the import fails here, with the reason. Under TRITON_INTERPRET=1 (set before triton is
imported) the launchers also run on CPU tensors, slowly: that is how the tests check them.
"""

try:
    import triton  # noqa: F401
except ImportError as error:  # triton is not installed (CPU-only machines)
    raise ImportError(
        f"kernels.triton needs triton, which could not be imported ({type(error).__name__}: "
        f"{error}); on the CPU use the twins in kernels.reference"
    ) from error
