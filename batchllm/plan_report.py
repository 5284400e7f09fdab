"""`batchllm plan`: what a run would do, from the tokenized input and the prefix tree alone.
With engine.workers > 1 it also shows the shards (planning is local: no Ray instance starts)."""

from __future__ import annotations

from batchllm.config import load_job
from batchllm.job import partitioned
from batchllm.model.weights import load_tokenizer, resolve_model
from batchllm.rows.reader import read_input
from batchllm.rows.requests import build_rows
from batchllm.scale.assign import describe, partition_job, plan_rows
from batchllm.scale.assign import shard_job as _shard_job


def plan_job(job: str, overrides: list[str]) -> dict[str, object]:
    cfg = load_job(job, overrides)
    rows = read_input(cfg.input)
    tokenizer = load_tokenizer(resolve_model(cfg.model.path))
    inputs, _ = build_rows(tokenizer, cfg.input, cfg.sampling, rows, list(range(rows.num_rows)))
    partition = partitioned(cfg)
    if cfg.engine.workers > 1:
        cut = partition_job if partition else _shard_job
        sharded = cut(inputs, cfg, cfg.engine.workers)
        plan, good = sharded.plan, sharded.planned
    else:
        plan, good = plan_rows(inputs, cfg)
    s = plan.stats()
    report: dict[str, object] = {
        "job": cfg.name,
        "rows": rows.num_rows,
        "rows_with_errors": rows.num_rows - len(good),
        "prompt_tokens": s["prompt_tokens"],
        "tree_tokens": s["tree_tokens"],
        "predicted_prefill_tokens": s["predicted_prefill_tokens"],
        "sharing_ratio": f"{s['sharing_ratio']:.3f}",
        "groups": s["groups"],
        "levels": s["levels"],
        "predicted_peak_kv_pages": plan.predict_peak_pages(
            cfg.engine.page_size, cfg.engine.max_num_seqs),
        "page_size": cfg.engine.page_size,
    }
    if cfg.engine.workers > 1:
        report["sharding"] = ("partition (rows cut by leading tokens; at run time Ray tasks "
                              "cut them, by row groups)") if partition else "tree"
        report.update(describe(sharded))
    return report
