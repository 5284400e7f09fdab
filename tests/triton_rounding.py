"""Triton's interpreter rounded as a GPU rounds, for the tests (imported by conftest.py).

The interpreter casts float32 to bfloat16 by truncation where compiled kernels round to nearest
even; truncation's bias adds up over a model's layers (measured on the tiny Llama: logits 2.1
apart from transformers' bfloat16 instead of 0.5). The tests compare the kernels against
transformers and their twins as a GPU would run them, so under TRITON_INTERPRET=1 the cast is
made to round to nearest even. The shipped package leaves Triton as it is.
"""

from __future__ import annotations

import importlib.util
import os


def round_to_nearest_even() -> None:
    """Patch the interpreter's float32 -> bfloat16 cast (once; a no-op without triton or where
    the interpreter has no such cast)."""
    if importlib.util.find_spec("triton") is None:
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_rounds_to_nearest", False) or not hasattr(builder, "cast_impl"):
        return
    cast = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            x = np.asarray(src.data, dtype=np.float32)
            bits = x.view(np.uint32).astype(np.uint64)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # ties to even
            out = np.where(np.isnan(x), 0x7FC0, bits).astype(np.uint16)
            return interpreter.TensorHandle(out, tl.bfloat16)
        return cast(self, src, dst_type)

    builder.cast_impl = cast_impl
    builder._rounds_to_nearest = True


if os.environ.get("TRITON_INTERPRET") == "1":
    round_to_nearest_even()
