"""`batchllm plan`: what a run would do, from the tokenized input and the prefix tree alone."""

from __future__ import annotations

import numpy as np

from batchllm.config import load_job
from batchllm.model.weights import load_tokenizer, resolve_model
from batchllm.plan.planner import make_plan
from batchllm.rows.reader import read_input
from batchllm.rows.requests import build_rows


def plan_job(job: str, overrides: list[str]) -> dict[str, object]:
    cfg = load_job(job, overrides)
    rows = read_input(cfg.input)
    tokenizer = load_tokenizer(resolve_model(cfg.model.path))
    inputs, _ = build_rows(tokenizer, cfg.input, cfg.sampling, rows, list(range(rows.num_rows)))
    good = [r for r in inputs if r.error is None and r.sampling.problem() is None]
    plan = make_plan(
        [r.prompt_ids for r in good],
        np.asarray([r.sampling.max_tokens for r in good], dtype=np.int32),
        prefix_sharing=cfg.engine.prefix_sharing,
        order=cfg.planner.order,
    )
    s = plan.stats()
    return {
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
