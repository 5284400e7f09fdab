"""`batchllm plan`: what a run would do, from the tokenized input and the prefix tree alone, and
whether the model and its KV cache fit the devices (model/memory_plan.py; from config.json
alone with --memory-only, so a 70B is planned without its weights or tokenizer). With
engine.workers > 1 it also shows the shards (planning is local: no Ray instance starts)."""

from __future__ import annotations

import os

from batchllm.config import JobConfig, load_job
from batchllm.model import memory_plan as mp
from batchllm.model.families import describe as describe_family
from batchllm.model.fp8_checkpoint import fp8_checkpoint
from batchllm.model.hf_cache import load_config
from batchllm.model.loader import job_model, model_len_limit
from batchllm.model.resolve import resolve_model
from batchllm.model.rotary import head_dim_of
from batchllm.plan.peak_pages import predict_peak_pages
from batchllm.rows.build import build_rows
from batchllm.rows.reader import read_input
from batchllm.scale.assign import describe, job_plan, partition_job, partitioned, shard_job
from batchllm.scale.cluster import require_ray


def plan_job(job: str, overrides: list[str], devices: str | None = None,
             memory_only: bool = False) -> dict[str, object]:
    """The report's lines (name -> value). `devices`: the machine to plan for (2xH200, ...),
    else the job's own; `memory_only`: the memory plan alone, from config.json alone."""
    cfg = load_job(job, overrides)
    if memory_only:
        return {"job": cfg.name, **memory_report(cfg, devices)[0]}
    require_ray(cfg)
    source = read_input(cfg.input)
    tokenizer, limit = job_model(cfg.model.path, cfg.model.max_model_len,
                                 cfg.model.revision)
    rows = build_rows(tokenizer, cfg.input, cfg.sampling, source, keep_prompt=False)
    partition = partitioned(cfg)
    if cfg.engine.workers > 1:
        cut = partition_job if partition else shard_job
        sharded = cut(rows, cfg, limit, cfg.engine.workers)
        planned = sharded.planned
    else:
        planned = job_plan(rows, cfg, limit)
    plan = planned.plan
    s = plan.stats()
    report: dict[str, object] = {
        "job": cfg.name,
        "rows": source.num_rows,
        "rows_with_errors": source.num_rows - len(planned.rows),
        "prompt_tokens": s["prompt_tokens"],
        "tree_tokens": s["tree_tokens"],
        "predicted_prefill_tokens": s["predicted_prefill_tokens"],
        "sharing_ratio": f"{s['sharing_ratio']:.3f}",
        "groups": s["groups"],
        "levels": s["levels"],
        "predicted_peak_kv_pages": predict_peak_pages(
            plan, cfg.engine.page_size, cfg.engine.max_num_seqs),
        "page_size": cfg.engine.page_size,
    }
    memory, pages = memory_report(cfg, devices)
    report.update(memory)
    peak = report["predicted_peak_kv_pages"]
    report["predicted_peak_fits"] = (
        f"yes: {peak} of {pages} pages" if peak <= pages else
        f"no: {peak} pages predicted, {pages} in the pool (rows will be preempted and recomputed)")
    if cfg.engine.workers > 1:
        report["sharding"] = ("partition (rows cut by leading tokens; at run time Ray tasks "
                              "cut them, by row groups)") if partition else "tree"
        report.update(describe(sharded))
    return report


def _job_devices(device: str) -> mp.Devices:
    import torch

    if device == "cpu" or not torch.cuda.is_available():
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return mp.Devices("CPU", 1, ram, gpu=False)
    props = torch.cuda.get_device_properties(0)
    return mp.Devices(props.name, torch.cuda.device_count(), props.total_memory)


def _settings(cfg: JobConfig, config, gpu: bool) -> mp.Settings:
    m, e = cfg.model, cfg.engine
    dtype_bytes = {"auto": 2 if gpu else 4, "float32": 4, "bfloat16": 2, "float16": 2}[m.dtype]
    return mp.Settings(
        dtype_bytes=dtype_bytes, kv_bytes=1 if e.kv_cache_dtype == "fp8" else dtype_bytes,
        fp8_weights=m.quantization == "fp8" or fp8_checkpoint(config),
        tensor_parallel=e.tensor_parallel,
        kv_cache_memory=e.kv_cache_memory, max_batched_tokens=e.max_batched_tokens,
        max_num_seqs=e.max_num_seqs, page_size=e.page_size,
        max_model_len=model_len_limit(config, m.max_model_len))


def _gib(n: int) -> str:
    return f"{n / mp.GIB:.2f} GiB"


def memory_report(cfg: JobConfig, devices: str | None = None) -> tuple[dict[str, object], int]:
    """The memory plan's lines for the job's model on `devices` (or the job's own), and the
    pages of its KV pool."""
    config = load_config(resolve_model(cfg.model.path, cfg.model.revision, config_only=True))
    where = mp.parse_devices(devices) if devices else _job_devices(cfg.model.device)
    gpu = where.gpu
    s = _settings(cfg, config, gpu)
    cpu_pool = 0
    if not gpu:
        import torch

        from batchllm.engine.kv_budget import kv_budget_bytes

        cpu_pool = kv_budget_bytes(s.kv_cache_memory, torch.device("cpu"))
    p = mp.plan_memory(config, where, s, cpu_pool)
    size = f", {_gib(where.memory)} each" if gpu else f", {_gib(where.memory)} of RAM"
    copies = where.count // s.tensor_parallel
    dtype = cfg.model.dtype if cfg.model.dtype != "auto" else "bfloat16" if gpu else "float32"
    hkv = max(1, (config.num_key_value_heads or config.num_attention_heads) // s.tensor_parallel)
    report: dict[str, object] = {
        "model_family": describe_family(config).summary(),
        "devices": f"{where.count}x {where.name}{size}; tensor_parallel {s.tensor_parallel}"
                   + (f", {copies} copies of the model (engine.workers)" if copies > 1 else "")
                   + f"; {'fp8' if s.fp8_weights else dtype} weights, "
                   f"{'fp8' if s.kv_bytes == 1 else dtype} KV cache (figures below: one device)",
        "weights": f"{_gib(p.weights)} ({p.parameters / 1e9:.2f} B parameters in all)",
        "activations_peak": f"{_gib(p.activations)} (estimate: a step of "
                            f"{s.max_batched_tokens} tokens, {s.max_num_seqs} rows' logits)",
        "kv_pool": _gib(p.kv_pool) + (
            f" ({s.kv_cache_memory} of the {_gib(p.left)} left after the weights, the "
            f"activations and {_gib(p.runtime)} of CUDA runtime)"
            if gpu and isinstance(s.kv_cache_memory, float) else
            "" if gpu else " (the engine's CPU budget: a fraction of the RAM available, at most "
            "8 GiB)"),
        "kv_bytes_per_token": p.kv_per_token,
        "kv_bytes_per_token_is": f"2 x {config.num_hidden_layers} layers x {hkv} KV heads x "
                                 f"{head_dim_of(config)} x {s.kv_bytes} bytes",
        "kv_tokens_at_once": f"{p.kv_tokens} ({p.kv_tokens // s.page_size} pages of "
                             f"{s.page_size})",
        "rows_at_once": f"{p.rows_at_max_len} at max_model_len {s.max_model_len} "
                        f"(engine.max_num_seqs {s.max_num_seqs})",
        "fits": "yes" if p.fits else _why_not(p, where),
    }
    for name, alt in mp.alternatives(config, where, s).items():
        more = alt.settings.tensor_parallel > where.count
        report["with_" + name.replace(" ", "_")] = (
            f"{_gib(alt.weights)} weights, {alt.kv_tokens} tokens, {alt.rows_at_max_len} rows "
            f"at once" + (f" (needs {alt.settings.tensor_parallel} devices)" if more else "")
            + ("" if alt.fits else ": does not fit"))
    return report, p.kv_tokens // s.page_size


def _why_not(p: mp.MemoryPlan, where: mp.Devices) -> str:
    if p.left == 0:
        return (f"no: the weights ({_gib(p.weights)}), the activations and the runtime leave "
                f"nothing for the KV cache on a device of {_gib(where.memory)}")
    return f"no: the KV pool holds no row of {p.settings.max_model_len} tokens"
