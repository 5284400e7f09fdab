"""Builds and loads the C kernels of the CPU path (the .c files beside this one): with the system
C compiler on first use, cached, called through ctypes.

Built with `$CC` (default `cc`) -O3 -march=native -fopenmp into $BATCHLLM_CACHE/kernels (default
~/.cache/batchllm/kernels) as cpu_<name>-<key>.so, keyed by the source and the headers beside it,
the flags, the compiler and the CPU; OpenMP is torch's own runtime (libgomp from torch/lib,
already loaded), so torch's thread count applies. Without a compiler, or with
BATCHLLM_CPU_KERNEL=0 (`enabled()` false), `load_library` returns None (a warning says why, once
per library) and the torch twins run.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

_HERE = Path(__file__).parent
_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fPIC")
# Compiled and linked in two steps: -ffast-math at link time adds crtfastmath.o to a shared
# library too (GCC < 13), whose constructor sets flush-to-zero and denormals-are-zero for the
# whole process when the library loads, so every float op of torch and numpy in it flushed
# subnormals to zero (seen: hypothesis refusing to draw floats after a model had loaded).
_LINK = ("-shared",)


def _torch_omp() -> Path | None:
    """torch's bundled libgomp.so.1, or None (then the kernel is built without OpenMP)."""
    lib = Path(torch.__file__).parent / "lib"
    return lib if (lib / "libgomp.so.1").exists() else None


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return "".join(line for line in f if line.startswith(("model name", "flags")))
    except OSError:
        return platform.processor()


def _build(name: str, compiler: str) -> Path:
    source = _HERE / f"{name}.c"
    omp = _torch_omp()
    openmp = ["-fopenmp"] if omp else []
    flags = [*_FLAGS, *openmp]
    link = [*_LINK, *openmp, *([f"-Wl,-rpath,{omp}"] if omp else [])]
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             check=True).stdout
    texts = [p.read_text() for p in [source, *sorted(_HERE.glob("*.h"))]]
    key = hashlib.sha256("\0".join([*texts, *flags, *link, version, platform.machine(),
                                    _cpu_id()]).encode()).hexdigest()[:16]
    env = os.environ.get("BATCHLLM_CACHE")
    folder = (Path(env).expanduser() if env else Path.home() / ".cache" / "batchllm") / "kernels"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        folder = Path(tempfile.gettempdir())
    target = folder / f"cpu_{name}-{key}.so"
    if not target.exists():
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
        os.close(fd)
        try:
            obj = tmp + ".o"
            try:
                subprocess.run([compiler, *flags, "-c", str(source), "-o", obj], check=True,
                               capture_output=True, text=True)
                subprocess.run([compiler, obj, *link, "-o", tmp], check=True,
                               capture_output=True, text=True)
            finally:
                if os.path.exists(obj):
                    os.remove(obj)
            os.replace(tmp, target)  # atomic: another process may build the same key
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


def enabled() -> bool:
    """False when BATCHLLM_CPU_KERNEL=0: the C kernels are switched off, neither built nor
    picked (batchllm/model/ops.py asks here), and the torch twins run."""
    return os.environ.get("BATCHLLM_CPU_KERNEL", "1") != "0"


def load_library(name: str, what: str) -> ctypes.CDLL | None:
    """kernels/cpu/{name}.c built and loaded, or None where it cannot be (`what` names it in the
    warning). Callers cache the result and set the argument types."""
    if not enabled():
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    try:
        if compiler is None:
            raise OSError("no C compiler (set CC, or install gcc)")
        return ctypes.CDLL(str(_build(name, compiler)))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or e
        print(f"batchllm: {what} could not be built ({detail}); the slower torch path runs",
              file=sys.stderr)
        return None
