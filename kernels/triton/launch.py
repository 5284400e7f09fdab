"""A kernel launch as data: the kernel, its grid, its runtime arguments and its compile-time ones.

Every launcher builds its launches with a `plan_*` function and hands them to `run`, the one
place that launches. scripts/compile_check.py compiles the very same plans for real GPU targets
(built on meta tensors, without a GPU), so the check and the real launch cannot drift; a test
counts launches by replacing `run`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
from triton.runtime.interpreter import InterpretedFunction


class Launch(NamedTuple):
    kernel: Any  # a @triton.jit kernel (an InterpretedFunction under TRITON_INTERPRET=1)
    grid: tuple[int, ...]
    args: tuple  # runtime arguments in the kernel's order: tensors, ints, floats
    constexprs: dict[str, Any]  # constexpr arguments by name, and num_warps / num_stages


def run(launches: Iterable[Launch]) -> None:
    """Launch each in turn on the current stream."""
    for launch in launches:
        launch.kernel[launch.grid](*launch.args, **launch.constexprs)


def interpreted(kernel: object) -> bool:
    """Whether `kernel` runs in Triton's interpreter (TRITON_INTERPRET=1 when it was made)."""
    return isinstance(kernel, InterpretedFunction)


def dot_f32(kernel: object, dtype: torch.dtype) -> bool:
    """Whether `kernel` must upcast its tl.dot operands to float32: the interpreter multiplies
    the raw bits of bfloat16 operands (triton#11584; float16 and float32 are right)."""
    return dtype == torch.bfloat16 and interpreted(kernel)
