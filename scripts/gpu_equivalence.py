"""batchllm against transformers on one model in bfloat16, greedy, under the team's bfloat16 rule
(README, Correctness; tests/hf_reference.assert_tokens_match_bf16): scripts/gpu_check.sh's
correctness run on the random-weight models. Exit 1 on any row that breaks the rule.

    python scripts/gpu_equivalence.py MODEL_FOLDER [--prompts 8] [--tokens 32] [--device cuda] [--kv-cache-memory 0.3]
                                      [--tensor-parallel 2]

transformers runs first, one prompt at a time on the device, and is freed before batchllm sizes
its KV pool; batchllm runs every prompt in one generate (prefix sharing on, CUDA graphs on;
with --tensor-parallel N the model split over cuda:0..N-1, NCCL, graphs off).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import numpy as np
import torch
from hf_reference import assert_tokens_match_bf16


@torch.no_grad()
def reference(folder: Path, prompts: list[list[int]], tokens: int,
              device: str) -> list[tuple[list[int], torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device).eval()
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=tokens, min_new_tokens=tokens, eos_token_id=[],
                             pad_token_id=0, return_dict_in_generate=True, output_logits=True)
        out.append((gen.sequences[0, len(prompt):].tolist(), torch.cat(gen.logits).float().cpu()))
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--kv-cache-memory", default="0.3", help="a fraction (0.3) or bytes (an int)")
    ap.add_argument("--tensor-parallel", type=int, default=1)
    args = ap.parse_args()
    from batchllm import LLM, SamplingParams
    from batchllm.model.hf_cache import load_config

    vocab = load_config(args.folder).vocab_size
    rng = np.random.default_rng(1)
    head = rng.integers(3, vocab, 48).tolist()  # half the prompts share it: groups, cascade
    prompts = [(head if i % 2 else []) + rng.integers(3, vocab, int(rng.integers(5, 60))).tolist()
               for i in range(args.prompts)]
    ref = reference(args.folder, prompts, args.tokens, args.device)
    kv = float(args.kv_cache_memory) if "." in args.kv_cache_memory else int(args.kv_cache_memory)
    llm = LLM(str(args.folder), dtype="bfloat16", device=args.device, kv_cache_memory=kv,
              tensor_parallel=args.tensor_parallel)
    outs = llm.generate(prompts, SamplingParams(max_tokens=args.tokens, ignore_eos=True))
    failed, diverged = [], 0
    for i, (out, (tokens, logits)) in enumerate(zip(outs, ref)):
        try:
            diverged += assert_tokens_match_bf16(out.token_ids, tokens, logits, row=i)
        except AssertionError as error:
            failed.append(str(error))
    name = args.folder.name
    for line in failed:
        print(f"MISMATCH {name}: {line}")
    print(f"equivalence {name} (tensor_parallel {args.tensor_parallel}): {len(prompts)} prompts x {args.tokens} tokens, bfloat16: "
          f"{len(prompts) - diverged - len(failed)} equal, {diverged} diverged at a near tie, "
          f"{len(failed)} broke the rule" + (" -> FAILED" if failed else " -> OK"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
