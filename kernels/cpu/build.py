"""Builds and loads the C kernels of the CPU path (the .c files beside this one): with the system
C compiler on first use, cached, called through ctypes.

Built with `$CC` (default `cc`) -O3 -march=native (x86-64-v3 with BATCHLLM_CPU_ISA=avx2)
-fopenmp into $BATCHLLM_CACHE/kernels (default
~/.cache/batchllm/kernels) as cpu_<name>-<key>.so, keyed by the source and the headers beside it,
the flags, the compiler and the CPU; OpenMP is torch's own runtime (libgomp from torch/lib,
already loaded), so torch's thread count applies; where torch has none, the kernels are built
without OpenMP, on one thread, and a note says so once.

A library is code the job runs, so its folder is private: created 0700, and used only while it
is a real folder owned by this user, writable by no one else, in a parent where no one else can
swap it (not writable by others, or sticky like /tmp); a library is loaded only when it is a
regular file owned by this user and writable by no one else (a planted one is rebuilt over).
With nowhere safe to build (no home, a read-only or shared cache), nothing is built or loaded
and the torch twins run: a warning says so once. (The data caches beside it, such as the panel
file, are never executed and may stay shareable.) Without a compiler, on a CPU without AVX2, or
with BATCHLLM_CPU_KERNEL=0 (`enabled()` false), `load_library` returns None (a note says why,
once) and the torch twins run.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import torch

from batchllm_kernels.atomic_write import atomic_path

_HERE = Path(__file__).parent
_FLAGS = ("-O3", "-ffast-math", "-fno-finite-math-only", "-fPIC")
# Compiled and linked in two steps: -ffast-math at link time adds crtfastmath.o to a shared
# library too (GCC < 13), whose constructor sets flush-to-zero and denormals-are-zero for the
# whole process when the library loads, so every float op of torch and numpy in it flushed
# subnormals to zero (seen: hypothesis refusing to draw floats after a model had loaded).
_LINK = ("-shared",)


def _march() -> str:
    """-march=native, or x86-64-v3 (AVX2 and FMA, no AVX-512) with
    BATCHLLM_CPU_ISA=avx2: the AVX2 build run and tested on a machine that has more."""
    return "-march=x86-64-v3" if os.environ.get("BATCHLLM_CPU_ISA") == "avx2" else "-march=native"


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


def isa() -> str:
    """The widest vector unit the kernels are built for here (-march=native): avx512, avx2, or
    the machine's name where it has neither."""
    flags = set()
    for line in _cpu_id().splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
    if "avx512f" in flags and _march() == "-march=native":
        return "avx512"
    return "avx2" if "avx2" in flags else platform.machine().lower() or "unknown"


_said: set[str] = set()  # the notes printed once per process


def _once(key: str, message: str) -> None:
    if key not in _said:
        _said.add(key)
        print(f"batchllm: {message}", file=sys.stderr)


def _unsafe(path: Path, st: os.stat_result, kind: str) -> str | None:
    """Why `path` (lstat'ed: `st`) may not hold code this process loads, or None."""
    want = stat.S_ISDIR if kind == "folder" else stat.S_ISREG
    if not want(st.st_mode):
        return f"{path} is not a {kind}"
    if st.st_uid != os.getuid():
        return f"{path} belongs to another user (uid {st.st_uid})"
    if st.st_mode & 0o022:
        return f"{path} is writable by others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def private_folder() -> Path | None:
    """The folder the kernels are built in and loaded from, made 0700 when new; None (and a
    warning, once) when there is no safe one (module docstring)."""
    try:
        env = os.environ.get("BATCHLLM_CACHE")
        root = Path(env).expanduser() if env else Path.home() / ".cache" / "batchllm"
        folder = root / "kernels"
        root.mkdir(parents=True, exist_ok=True)  # the data caches' root: shareable
        with contextlib.suppress(FileExistsError):
            folder.mkdir(mode=0o700)
        why = _unsafe(folder, os.lstat(folder), "folder")
        parent = os.stat(root)
        if why is None and parent.st_mode & 0o022 and not parent.st_mode & stat.S_ISVTX:
            why = f"{root} is writable by others: the folder in it could be swapped"
    except (OSError, RuntimeError) as e:  # RuntimeError: no home directory
        why = f"no cache folder ({getattr(e, 'strerror', None) or e})"
    if why is None:
        return folder
    _once("unsafe", f"the C kernels are not built or loaded: {why}; the slower torch path runs "
          "(set BATCHLLM_CACHE to a folder of your own)")
    return None


def _build(name: str, compiler: str, folder: Path) -> Path:
    source = _HERE / f"{name}.c"
    omp = _torch_omp()
    if omp is None:
        _once("omp", "warning: torch has no bundled OpenMP runtime (libgomp); the C kernels are "
              "built without OpenMP and run on one thread")
    openmp = ["-fopenmp"] if omp else []
    flags = [*_FLAGS, _march(), *openmp]
    link = [*_LINK, *openmp, *([f"-Wl,-rpath,{omp}"] if omp else [])]
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             check=True).stdout
    texts = [p.read_text() for p in [source, *sorted(_HERE.glob("*.h"))]]
    key = hashlib.sha256("\0".join([*texts, *flags, *link, version, platform.machine(),
                                    _cpu_id()]).encode()).hexdigest()[:16]
    target = folder / f"cpu_{name}-{key}.so"
    try:
        built = _unsafe(target, os.lstat(target), "file") is None
    except FileNotFoundError:
        built = False
    if not built:  # new, or not one this user built: built (again) over it
        with atomic_path(target, mode=0o700, durable=False) as tmp:  # another process may
            obj = tmp + ".o"                                        # build the same key
            try:
                subprocess.run([compiler, *flags, "-c", str(source), "-o", obj], check=True,
                               capture_output=True, text=True)
                subprocess.run([compiler, obj, *link, "-o", tmp], check=True,
                               capture_output=True, text=True)
            finally:
                if os.path.exists(obj):
                    os.remove(obj)
    return target


def enabled() -> bool:
    """Whether the C kernels are built and picked here (batchllm/model/ops.py asks): not when
    BATCHLLM_CPU_KERNEL=0 (switched off), nor on a CPU without AVX2 (ARM, macOS, older x86:
    their vector code is AVX2 / AVX-512 only, scalar elsewhere, and torch's BLAS is faster there;
    a note says so once). Then the torch twins run. Without torch's OpenMP they are still
    picked, on one thread: a 16 x 32-token SmolLM2 generate took 16.6-21.6 s so, 135-169 s on
    torch's ops (BATCHLLM_CPU_KERNEL=0), 80-81 s with OpenMP (2 rounds, a 2-core AMD EPYC at
    load 7.5-9.6, issue 31)."""
    if os.environ.get("BATCHLLM_CPU_KERNEL", "1") == "0":
        return False
    if isa() not in ("avx512", "avx2"):
        _once("isa", f"the C kernels need AVX2 or AVX-512, not found on this CPU ({isa()}); "
              "torch's ops run")
        return False
    return True


def load_library(name: str, what: str) -> ctypes.CDLL | None:
    """kernels/cpu/{name}.c built and loaded, or None where it cannot be (`what` names it in the
    warning). Callers cache the result and set the argument types."""
    if not enabled():
        return None
    folder = private_folder()
    if folder is None:
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    try:
        if compiler is None:
            raise OSError("no C compiler (set CC, or install gcc)")
        return ctypes.CDLL(str(_build(name, compiler, folder)))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or e
        print(f"batchllm: {what} could not be built ({detail}); the slower torch path runs",
              file=sys.stderr)
        return None
