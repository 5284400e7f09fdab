"""The settings run in this process: the workload tokenized once, each setting timed in turn."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from batchllm.model.hf_cache import load_config
from batchllm.model.resolve import resolve_model
from batchllm.model.tokenizer import eos_token_ids, load_tokenizer

from .baselines import has_continuous_batching, hf_continuous, hf_static, load_hf_model
from .batchllm_run import run_batchllm
from .schema import load_schema
from .vllm_run import run_vllm
from .workload import read_workload, workload_file

# batchllm-json: prefix sharing on, every row constrained to --json-schema (only when given);
# the -nographs settings: engine.cuda_graphs off (--graphs off or both)
SETTINGS = ("hf-static", "hf-continuous", "vllm", "batchllm-sharing", "batchllm-no-sharing",
            "batchllm-sharing-nographs", "batchllm-no-sharing-nographs", "batchllm-json")


# --weights / --isa: the batchllm settings again with a GGUF model's float32 conversion instead
# of its blocks (model/gguf_blocks.py), or with the C kernels' AVX2 build; a variant is a suffix
# of the setting's name and the environment its process runs with
WEIGHTS = {"blocks": ("", {"BATCHLLM_GGUF_BLOCKS": "1"}),
           "float32": ("+f32", {"BATCHLLM_GGUF_BLOCKS": "0"})}
ISAS = {"native": ("", {"BATCHLLM_CPU_ISA": None}), "avx2": ("+avx2", {"BATCHLLM_CPU_ISA": "avx2"})}


def _chosen(value: str, choices: dict) -> list[str]:
    return list(choices) if value == "both" else [value]


def variants(args: argparse.Namespace) -> dict[str, dict[str, str | None]]:
    """Each batchllm variant's name suffix -> its environment (None: unset)."""
    out = {}
    for w in _chosen(getattr(args, "weights", "blocks"), WEIGHTS):
        for i in _chosen(getattr(args, "isa", "native"), ISAS):
            out[WEIGHTS[w][0] + ISAS[i][0]] = {**WEIGHTS[w][1], **ISAS[i][1]}
    return out


def setting_names(args: argparse.Namespace) -> list[str]:
    """The settings the command line runs, the batchllm ones once per variant."""
    skip = skipped(args)
    names = []
    for n in SETTINGS:
        if not skip[n]:
            names += [n + v for v in variants(args)] if n.startswith("batchllm") else [n]
    return names


def _set_env(env: dict[str, str | None]) -> None:
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _with_env(env: dict[str, str | None], fn: Callable[[], dict]) -> Callable[[], dict]:
    """fn run with `env` set (None: unset), the environment as it was afterwards."""
    def run() -> dict:
        saved = {k: os.environ.get(k) for k in env}
        _set_env(env)
        try:
            return fn()
        finally:
            _set_env(saved)
    return run


def skipped(args: argparse.Namespace) -> dict[str, bool]:
    """Per setting: whether the command line skips it (vllm runs only with --vllm-python)."""
    return {"hf-static": args.skip_hf or args.skip_hf_static,
            "hf-continuous": args.skip_hf or args.skip_hf_continuous,
            "vllm": args.vllm_python is None,
            **{f"batchllm-{s}{g}": (args.skip_batchllm or args.graphs == ("on" if g else "off")
                                    or args.sharing == ("off" if s == "sharing" else "on"))
               for s in ("sharing", "no-sharing") for g in ("", "-nographs")},
            "batchllm-json": args.skip_batchllm or args.json_schema is None}


def run_settings(args: argparse.Namespace) -> tuple[list[dict], dict]:
    """Every setting the command line asks for (only args.only, when set), one after the other in
    this process. Returns (one result per setting, the run's environment)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = resolve_model(args.model)
    tokenizer = load_tokenizer(folder)
    with tempfile.TemporaryDirectory() as tmp:
        path = workload_file(args.workload, Path(tmp))
        work = read_workload(path, tokenizer, args.rows, args.max_tokens)
    prompts, max_tokens, prompt_tokens = work.prompts, work.max_tokens, work.prompt_tokens
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    # --eos: stop at the tokens the engine stops at (generation_config's and the tokenizer's)
    eos = eos_token_ids(folder, load_config(folder), tokenizer) if args.eos else None
    load = os.getloadavg()[0]
    if load > (os.cpu_count() or 1):
        print(f"bench: WARNING load average {load:.1f} > {os.cpu_count()} cores: other processes "
              "are running, figures will be unreliable", file=sys.stderr)
    ends = "end-of-sequence honoured" if args.eos else "end-of-sequence ignored"
    print(f"workload: {len(prompts)} rows, {prompt_tokens} prompt tokens, at most "
          f"{sum(max_tokens)} output tokens ({ends}), model {args.model}, device {args.device}, "
          f"threads "
          f"{torch.get_num_threads()}", file=sys.stderr)

    wanted = ({args.only.split("+")[0]} if args.only is not None else set(SETTINGS))
    skip = skipped(args)
    runs: list[tuple[str, Callable[[], dict]]] = []
    # --hf-rows N: the transformers baselines on the first N rows only (their rates compare)
    hf_n = min(args.hf_rows or len(prompts), len(prompts))
    hf_prompts, hf_limits = prompts[:hf_n], max_tokens[:hf_n]
    if not args.skip_hf and wanted & {"hf-static", "hf-continuous"}:
        model = load_hf_model(folder, args.device, args.dtype)
        if not skip["hf-static"]:
            runs.append(("hf-static",
                         lambda: hf_static(model, hf_prompts, hf_limits, pad_id,
                                           args.batch_size, eos)))
        if not skip["hf-continuous"] and has_continuous_batching(model):
            runs.append(("hf-continuous",
                         lambda: hf_continuous(model, hf_prompts, hf_limits, pad_id, eos)))
    if not skip["vllm"] and "vllm" in wanted:
        job = {"model": str(folder), "prompts": prompts, "max_tokens": max_tokens,
               "eos": args.eos}
        runs.append(("vllm", lambda: run_vllm(args.vllm_python, job)))
    schema = load_schema(args.json_schema)
    for name, sharing, graphs, constrained in (
            ("batchllm-sharing", True, True, None), ("batchllm-no-sharing", False, True, None),
            ("batchllm-sharing-nographs", True, False, None),
            ("batchllm-no-sharing-nographs", False, False, None),
            ("batchllm-json", True, True, schema)):
        if skip[name] or name not in wanted:
            continue
        settings = {"model": args.model, "prompts": prompts, "max_tokens": max_tokens,
                    "prompt_tokens": prompt_tokens, "eos": args.eos, "json_schema": constrained,
                    "engine_kwargs": {"page_size": args.page_size, "prefix_sharing": sharing,
                                      "device": args.device, "dtype": args.dtype,
                                      "cuda_graphs": graphs}}
        for suffix, env in variants(args).items():
            runs.append((name + suffix, _with_env(env, lambda s=settings: run_batchllm(s))))

    if args.only is not None:
        runs = [(name, fn) for name, fn in runs if name == args.only]
    hf_tokens = sum(len(p) for p in hf_prompts)
    results = [_timed(name, fn, hf_tokens if name.startswith("hf-") else prompt_tokens)
               for name, fn in runs]
    env = {"rows": len(prompts), "prompt_tokens": prompt_tokens, "device": args.device,
           "dtype": args.dtype, "hf_rows": hf_n,
           "load_average_at_start": load, "cpu_count": os.cpu_count(),
           "threads": torch.get_num_threads(), "torch": torch.__version__}
    return results, env


def _timed(name: str, fn: Callable[[], dict], prompt_tokens: int) -> dict:
    """One setting's result with its token rates; a failure is a note, not an exception."""
    print(f"running {name} ...", file=sys.stderr, flush=True)
    try:
        r = fn()
    except ImportError as exc:
        r = {"note": f"skipped: cannot import batchllm ({exc})"}
    except Exception as exc:  # noqa: BLE001 - one failed setting must not hide the others
        r = {"note": f"failed: {type(exc).__name__}: {exc}"}
    r = {"setting": name, "prompt_tokens": prompt_tokens, **r}
    if "wall_s" in r:
        r["output_tok_s"] = r["output_tokens"] / r["wall_s"]
        r["total_tok_s"] = (prompt_tokens + r["output_tokens"]) / r["wall_s"]
    print(f"  {name}: {r.get('wall_s', float('nan')):.1f} s {r.get('note', '')}",
          file=sys.stderr, flush=True)
    return r
