"""The batchllm setting: the engine on the bench's token ids, with prefix sharing on or off."""

from __future__ import annotations

import time


def run_batchllm(settings: dict) -> dict:
    """batchllm.LLM(model, **engine_kwargs).generate(prompt token ids, per-row SamplingParams):
    the same token ids the baselines get. Timed: generate, which includes its planning."""
    import batchllm

    llm = batchllm.LLM(settings["model"], **settings["engine_kwargs"])
    params = [batchllm.SamplingParams(max_tokens=m, temperature=0.0,
                                      ignore_eos=not settings["eos"],
                                      json_schema=settings.get("json_schema"))
              for m in settings["max_tokens"]]
    start = time.perf_counter()
    outs = llm.generate(settings["prompts"], params)
    wall = time.perf_counter() - start
    metrics = dict(getattr(llm, "last_metrics", None) or {})
    prompt_tokens = sum(o.prompt_tokens for o in outs)
    note = ""
    if settings.get("json_schema") is not None:
        stops = sum(o.finish_reason == "stop" for o in outs)
        note = f"JSON schema on every row: {stops} of {len(outs)} finished it; "
    if prompt_tokens != settings["prompt_tokens"]:
        note += f"prompt tokens differ: batchllm {prompt_tokens}, bench {settings['prompt_tokens']}"
    return {"wall_s": wall, "output_tokens": sum(len(o.token_ids) for o in outs),
            "prefill_tokens": metrics.get("prefill_tokens"),
            "kv_pages_peak": metrics.get("kv_pages_peak"), "note": note, "metrics": metrics}
