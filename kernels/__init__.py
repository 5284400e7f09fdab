"""batchllm's attention kernels: Triton launchers for CUDA and their pure-torch twins.

The launchers need triton; without it `import kernels` still works, the twins (`*_ref`) run,
and calling a launcher raises ImportError. Under TRITON_INTERPRET=1 (set before this import)
the launchers also run on CPU tensors, slowly: that is how the tests check them.
"""

from kernels.reference import (
    merge_states_ref,
    paged_attention_ref,
    prefix_attention_ref,
    store_kv_ref,
)

try:
    from kernels.merge_states import merge_states
    from kernels.paged_attention import paged_attention
    from kernels.prefix_attention import prefix_attention
    from kernels.store_kv import store_kv

    HAS_TRITON = True
except ImportError as _error:  # triton is not installed (CPU-only machines)
    HAS_TRITON = False
    _reason = f"{type(_error).__name__}: {_error}"

    def _unavailable(name: str):
        def launcher(*args, **kwargs):
            raise ImportError(
                f"kernels.{name} needs triton, which could not be imported ({_reason}); "
                f"use kernels.{name}_ref on the CPU"
            )

        launcher.__name__ = name
        return launcher

    merge_states = _unavailable("merge_states")
    paged_attention = _unavailable("paged_attention")
    prefix_attention = _unavailable("prefix_attention")
    store_kv = _unavailable("store_kv")

__all__ = [
    "HAS_TRITON",
    "merge_states",
    "merge_states_ref",
    "paged_attention",
    "paged_attention_ref",
    "prefix_attention",
    "prefix_attention_ref",
    "store_kv",
    "store_kv_ref",
]
