"""Compile every Triton kernel of the CUDA path for real GPU targets, without a GPU.

    python scripts/compile_check.py                    # the full matrix, sm_90 and sm_80
    python scripts/compile_check.py --caps 90 --dtypes bfloat16 --groups 1,7 --page-sizes 16

A variant is one row of the matrix COLUMNS spans (dtype, head size, query heads per KV head, KV
heads, page size, step kind). Each becomes the launches the CUDA path makes for one layer of
such a step, built by the launchers' own plan_* functions on meta tensors (step_plans.py), so
this check and a real launch cannot drift. Each distinct specialisation (the kernel's binder
decides, as at a real launch) is compiled by Triton's compiler and its bundled ptxas for each
target; `ptxas -v` gives registers and spills. One line per compiled kernel variant, the summary
last. Exit 1 on a compile error, shared memory over the target's limit, a spill in bfloat16 or
float16 (float32 spills are reported), or a kernel of kernels/triton/ that no variant reaches
(checked when every step kind is in the matrix).

A new kernel parameter is one more entry of COLUMNS (and its name in step_plans.PAGED_COLUMNS /
PREFIX_COLUMNS when an attention launcher takes it as a keyword, as the sliding window and the
soft cap are).
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # real kernels, not the interpreter's
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # today's default, stated
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import triton
from step_plans import STEPS, kernel_names, step_plans
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

# The matrix: column -> the values the full check runs (the command line narrows each).
COLUMNS: dict[str, tuple] = {
    "dtype": ("bfloat16", "float16", "float32"),
    "head_dim": (64, 128),
    "group": (1, 3, 4, 7, 8),  # query heads per KV head
    "kv_heads": (2, 8),  # 2: Qwen2.5-0.5B's; 8: the Llama 3 models' (hidden sizes up to 8192)
    "page_size": (1, 16, 32),
    "step": STEPS,  # decode-only, mixed prefill + decode, prefill-only, shared-prefix groups
    "window": (0, 4096),  # a sliding window (0: none); the shared-prefix step ignores it
    "softcap": (0.0, 50.0),  # soft-capped scores (0: none)
    "kv_cache": ("auto", "fp8"),  # the model's dtype, or FP8 (e4m3 bits, scaled per KV head)
}
SHARED_LIMIT = {90: 232_448, 80: 166_912}  # bytes of shared memory a block may use (opt-in)
ARCH = {90: "sm_90a", 80: "sm_80"}
_PTXAS = re.compile(r"Used (\d+) registers|(\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--caps", default="90,80", help="compute capabilities, e.g. 90,80")
    for name, values in COLUMNS.items():  # --dtypes, --head-dims, --kv-heads, ...
        flag = name.replace("_", "-") + ("" if name.endswith("s") else "s")
        ap.add_argument(f"--{flag}", dest=name,
                        default=",".join(map(str, values)), help=f"default {values}")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiling processes")
    return ap.parse_args(argv)


def variants(args: argparse.Namespace) -> list[dict]:
    """Every combination of the chosen column values."""
    chosen = {}
    for name, values in COLUMNS.items():
        kind = type(values[0])
        chosen[name] = [kind(x) for x in getattr(args, name).split(",")]
    return [dict(zip(chosen, combo)) for combo in itertools.product(*chosen.values())]


def binder_key(launch, cap: int) -> tuple:
    """The specialisation a real launch of `launch` gets on `cap`: the kernel's own binder."""
    kernel = launch.kernel
    _, spec, options = _binder(kernel, cap)(*launch.args, **launch.constexprs)
    return (kernel.fn.__name__, cap, repr(spec), repr(sorted(options.items())))


_BINDERS: dict = {}


def _binder(kernel, cap: int):
    if (kernel, cap) not in _BINDERS:
        backend = make_backend(GPUTarget("cuda", cap, 32))
        _BINDERS[kernel, cap] = create_function_from_signature(kernel.signature, kernel.params,
                                                               backend)
    return _BINDERS[kernel, cap]


def compile_one(launch, cap: int) -> dict:
    """Compile for `cap` as JITFunction.run would, then ptxas -v -> shared, registers, spills."""
    kernel = launch.kernel
    target = GPUTarget("cuda", cap, 32)
    backend = make_backend(target)
    try:
        bound, spec, opts = _binder(kernel, cap)(*launch.args, **launch.constexprs)
        options, signature, constexprs, attrs = kernel._pack_args(backend, launch.constexprs,
                                                                  bound, spec, opts)
        compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                                  options=options.__dict__)
        regs, spills = _ptxas_v(compiled.asm["ptx"], cap)
    except Exception as error:  # noqa: BLE001 - every failure is a line of the report
        return {"error": _reason(error)}
    return {"shared": compiled.metadata.shared, "regs": regs, "spills": spills}


def _reason(error: BaseException) -> str:
    """One line: where the compiler stopped and the innermost cause (a CompilationError's own
    text is a source excerpt; the reason is in its __cause__ chain)."""
    chain = [error]
    while chain[-1].__cause__ is not None and len(chain) < 20:
        chain.append(chain[-1].__cause__)
    lines = [line.strip() for line in str(chain[-1]).strip().splitlines() if line.strip()]
    where = str(error).strip().splitlines()[0] if str(error).strip() else ""
    cause = f"{type(chain[-1]).__name__}: {lines[-1] if lines else ''}"
    if len(chain) > 1 and where.startswith("at "):
        cause = f"{type(error).__name__} {where.rstrip(':')} <- {cause}"
    return cause[:400]


def _ptxas_v(ptx: str, cap: int) -> tuple[int, int]:
    """(registers, spill bytes stored + loaded) from the bundled ptxas's -v report."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as src:
        src.write(ptx)
        src.flush()
        out = subprocess.run([get_ptxas(cap).path, "-v", f"--gpu-name={ARCH[cap]}", src.name,
                              "-o", os.devnull], capture_output=True, text=True, check=True)
    regs = spills = 0
    for m in _PTXAS.finditer(out.stderr):
        if m.group(1):
            regs = max(regs, int(m.group(1)))
        else:
            spills += int(m.group(2)) + int(m.group(3))
    return regs, spills


_JOBS: list = []  # (key, launch) to compile, shared with the forked workers


def _work(i: int) -> tuple[int, dict]:
    key, launch = _JOBS[i]
    return i, compile_one(launch, key[1])


def describe(variant: dict, launch) -> str:
    cx = " ".join(f"{k}={v}" for k, v in launch.constexprs.items()
                  if k not in ("num_warps", "num_stages"))
    return f"{variant['dtype']} {launch.kernel.fn.__name__}[{variant['step']}] {cx}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    caps = [int(c) for c in args.caps.split(",")]
    start = time.perf_counter()
    rows = variants(args)
    seen: dict[tuple, int] = {}  # specialisation -> index into _JOBS
    uses: list[int] = []
    first_variant: list[dict] = []
    _JOBS.clear()
    reached = set()
    for variant in rows:
        for launch in step_plans(variant):
            reached.add(launch.kernel.fn.__name__)
            for cap in caps:
                if launch.constexprs.get("FP8_DOT") and cap < 89:
                    continue  # FP8 products: sm_89 and later (sm_80 takes the W8A16 launch)
                key = binder_key(launch, cap)
                if key not in seen:
                    seen[key] = len(_JOBS)
                    _JOBS.append((key, launch))
                    uses.append(0)
                    first_variant.append(variant)
                uses[seen[key]] += 1
    jobs = max(1, min(args.jobs, len(_JOBS)))
    if jobs > 1:
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            results = dict(pool.imap_unordered(_work, range(len(_JOBS))))
    else:
        results = dict(map(_work, range(len(_JOBS))))
    failures, worst = [], {"shared": (0, ""), "regs": (0, ""), "spills": (0, "")}
    spilled_fp32 = 0
    for i, ((name, cap, _, _), launch) in enumerate(_JOBS):
        r, variant = results[i], first_variant[i]
        what = f"sm_{cap} {describe(variant, launch)}"
        if "error" in r:
            print(f"{what}  ERROR {r['error']}")
            failures.append(f"{what}: {r['error']}")
            continue
        print(f"{what}  shared {r['shared']} B  regs {r['regs']}  spills {r['spills']} B  "
              f"(variants {uses[i]})")
        for field in worst:
            if r[field] > worst[field][0]:
                worst[field] = (r[field], f"{name} sm_{cap} {variant['dtype']}")
        if r["shared"] > SHARED_LIMIT[cap]:
            failures.append(f"{what}: shared memory {r['shared']} B > {SHARED_LIMIT[cap]} B")
        if r["spills"] and variant["dtype"] != "float32":
            failures.append(f"{what}: {r['spills']} B of spills in {variant['dtype']}")
        spilled_fp32 += bool(r["spills"] and variant["dtype"] == "float32")
    # Every kernel of kernels/triton/ must be reached (by a run over every step kind).
    every_step = {v["step"] for v in rows} == set(STEPS)
    missing = sorted(set(kernel_names()) - reached) if every_step else []
    failures += [f"{name}: reached by no variant" for name in missing]
    for line in failures:
        print(f"FAIL {line}")
    targets = ", ".join(f"sm_{c}" for c in caps)
    print(f"compile_check: {len(rows)} variants x {len(caps)} targets ({targets})"
          f" -> {len(_JOBS)} kernel specialisations of {len(reached)} kernels in "
          f"{time.perf_counter() - start:.0f} s; max shared {worst['shared'][0]} B "
          f"({worst['shared'][1]}), max registers {worst['regs'][0]} ({worst['regs'][1]}), "
          f"max spills {worst['spills'][0]} B ({worst['spills'][1] or '-'}; float32 "
          f"specialisations with spills: {spilled_fp32}); "
          + ("OK" if not failures else f"{len(failures)} FAILED"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
