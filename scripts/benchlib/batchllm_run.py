"""The batchllm setting: the engine on the bench's token ids, with prefix sharing on or off."""

from __future__ import annotations

import time


def run_batchllm(settings: dict) -> dict:
    """batchllm.LLM(model, **engine_kwargs).generate(prompt token ids, per-row SamplingParams):
    the same token ids the baselines get. Timed: generate, which includes its planning."""
    import batchllm

    llm = batchllm.LLM(settings["model"], **settings["engine_kwargs"])
    schema = settings.get("json_schema")
    params = [batchllm.SamplingParams(max_tokens=m, temperature=0.0,
                                      ignore_eos=not settings["eos"], json_schema=schema)
              for m in settings["max_tokens"]]
    outs, wall = _generate(llm, settings["prompts"], params)
    metrics = dict(getattr(llm, "last_metrics", None) or {})
    prompt_tokens = sum(o.prompt_tokens for o in outs)
    note, extra = "", {}
    if schema is not None:
        stops = sum(o.finish_reason == "stop" for o in outs)
        note = f"JSON schema on every row: {stops} of {len(outs)} finished it; "
        extra = _same_tokens_unconstrained(llm, settings["prompts"], params, outs, wall)
    if prompt_tokens != settings["prompt_tokens"]:
        note += f"prompt tokens differ: batchllm {prompt_tokens}, bench {settings['prompt_tokens']}"
    return {"wall_s": wall, "output_tokens": sum(len(o.token_ids) for o in outs),
            "prefill_tokens": metrics.get("prefill_tokens"),
            "kv_pages_peak": metrics.get("kv_pages_peak"), "note": note, "metrics": metrics,
            **extra}


def _generate(llm, prompts, params) -> tuple[list, float]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return outs, time.perf_counter() - start


def _same_tokens_unconstrained(llm, prompts, params, outs, wall: float) -> dict:
    """The structured-output cost at equal work: a constrained row ends when its grammar does,
    so it generates fewer tokens than an unconstrained one, and a step with fewer rows left costs
    more per token. Here the same engine runs the rows unconstrained with each row's max_tokens
    set to its constrained length (end-of-sequence ignored: exactly that many tokens), between
    the constrained run and a second constrained run (whose wall time is averaged with the
    first, so that neither side gets the warmer engine)."""
    import dataclasses

    same = [dataclasses.replace(p, json_schema=None, max_tokens=max(1, len(o.token_ids)),
                                ignore_eos=True) for p, o in zip(params, outs)]
    plain, plain_wall = _generate(llm, prompts, same)
    again, again_wall = _generate(llm, prompts, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs], "constrained runs differ"
    return {"constrained_wall_s": (wall + again_wall) / 2, "same_tokens_wall_s": plain_wall,
            "same_tokens_output_tokens": sum(len(o.token_ids) for o in plain)}
