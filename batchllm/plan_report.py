"""`batchllm plan`: what a run would do, from the tokenized input and the prefix tree alone.
With engine.workers > 1 it also shows the shards (planning is local: no Ray instance starts)."""

from __future__ import annotations

from batchllm.config import load_job
from batchllm.model.loader import describe_model, job_model
from batchllm.rows.build import build_rows
from batchllm.rows.reader import read_input
from batchllm.scale.assign import describe, job_plan, partition_job, partitioned, shard_job
from batchllm.scale.cluster import require_ray


def plan_job(job: str, overrides: list[str]) -> dict[str, object]:
    cfg = load_job(job, overrides)
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
        "predicted_peak_kv_pages": plan.predict_peak_pages(
            cfg.engine.page_size, cfg.engine.max_num_seqs),
        "page_size": cfg.engine.page_size,
        **describe_model(cfg.model.path, cfg.model.dtype, cfg.model.device, cfg.model.revision),
    }
    if cfg.engine.workers > 1:
        report["sharding"] = ("partition (rows cut by leading tokens; at run time Ray tasks "
                              "cut them, by row groups)") if partition else "tree"
        report.update(describe(sharded))
    return report
