"""How far apart batchllm's CUDA path and transformers honestly are in bfloat16: the measurement
behind the bfloat16 rule (README, Correctness; tests/test_triton_engine.py applies it).

    BATCHLLM_BACKEND=triton python scripts/measure_bf16.py [--prompts 48] [--tokens 16]

Runs the tiny random models of tests/hf_reference.py through batchllm (the Triton kernels; in the
interpreter without a GPU) and through transformers `generate`, both in bfloat16, greedy, one
prompt at a time for transformers. At each row's first differing token it records the
reference's top-two gap and the reference's deficit of our token (its top logit minus its logit
for the token we chose), in logits and in bfloat16 ulps of the top logit. Prints a summary.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("BATCHLLM_BACKEND", "triton")
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import numpy as np
import torch
from hf_reference import hf_model, tiny_model_folder
from measure_fp8 import prompts

from batchllm import LLM, SamplingParams


@torch.no_grad()
def reference(folder: Path, prompt: list[int], tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens in bfloat16 and its logits at each of them [N, V] fp32."""
    model = hf_model(folder, torch.bfloat16)
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=tokens, min_new_tokens=tokens, eos_token_id=[],
                         pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).float()


def ulp(x: float) -> float:
    """The spacing of bfloat16 numbers at |x| (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(max(abs(x), 1e-30))) - 7)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--kinds", default="llama,qwen2")
    args = ap.parse_args()
    for kind in args.kinds.split(","):
        folder = tiny_model_folder(kind)
        rows = prompts(args.prompts, seed=len(kind))
        llm = LLM(str(folder), dtype="bfloat16", device="cpu", kv_cache_memory=64 << 20)
        outs = llm.generate(rows, SamplingParams(max_tokens=args.tokens, ignore_eos=True))
        same, gaps, deficits, in_ulps, positions, ranks = 0, [], [], [], [], []
        all_gaps = []
        for prompt, out in zip(rows, outs):
            ref, logits = reference(folder, prompt, args.tokens)
            top2 = logits.topk(2, dim=-1).values
            all_gaps += (top2[:, 0] - top2[:, 1]).tolist()
            pos = next((p for p, (a, b) in enumerate(zip(out.token_ids, ref)) if a != b), None)
            if pos is None:
                same += 1
                continue
            row = logits[pos]
            ours = out.token_ids[pos]
            positions.append(pos)
            gaps.append(float(top2[pos, 0] - top2[pos, 1]))
            deficits.append(float(row.max() - row[ours]))
            in_ulps.append(deficits[-1] / ulp(float(row.max())))
            ranks.append(int((row > row[ours]).sum()))
        n = len(rows)
        print(f"{kind}: {n} prompts x {args.tokens} tokens, bfloat16: {same}/{n} rows equal; "
              f"reference top-two gaps over all {len(all_gaps)} positions: median "
              f"{np.median(all_gaps):.3f}, {sum(g <= 0.25 for g in all_gaps)} <= 0.25, "
              f"{sum(g == 0 for g in all_gaps)} exact ties")
        for p, g, d, u, r in zip(positions, gaps, deficits, in_ulps, ranks):
            print(f"  diverged at token {p}: reference top-two gap {g:.4f}, our token's deficit "
                  f"{d:.4f} = {u:.1f} bf16 ulps of the top logit, our token's rank {r + 1}")


if __name__ == "__main__":
    main()
