"""How far apart batchllm's FP8 formats and transformers are: the measurement behind the FP8
rules (README, Correctness; tests/test_fp8_kv_engine.py and tests/test_fp8_weights_engine.py
apply them).

    python scripts/measure_fp8.py kv [--prompts 48] [--tokens 16] [--kinds smollm2,llama]
    python scripts/measure_fp8.py weights [--scheme channel] [--backend cpu|triton]

Models: "smollm2" is SmolLM2-135M-Instruct (the default model, a trained one) on the first
--prompts rows of data/legal/prompts.parquet (the held-in prompts: the repository's own
workload, rendered with the chat template); any other kind is a tiny random model of
tests/hf_reference.py on random token prompts.

kv: batchllm with engine.kv_cache_dtype fp8 (scales 1.0) against plain transformers, float32:
    what rounding keys and values to e4m3 costs, and against transformers whose attention
    reads the same e4m3 keys and values (tests/fp8_reference.py), where only the order of the
    sums differs.
weights: batchllm on an FP8 checkpoint (tests/fp8_checkpoints.py builds it) against
    transformers running its weights dequantized; --backend triton runs the CUDA path's
    kernels (in the interpreter without a GPU), whose activations are quantized per token.
At each row's first differing token: the reference's top-two gap and its deficit of our token
(its top logit minus its logit of ours), and our token's rank. Prints a summary per model.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import numpy as np
import torch


def prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts of 8-60 random tokens, every third sharing a 20-token head with the one before
    (scripts/measure_bf16.py's too)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        own = rng.integers(5, 4000, int(rng.integers(8, 60))).tolist()
        out.append(out[-1][:20] + own if i % 3 == 2 else own)
    return out


def workload(kind: str, n: int) -> tuple[Path, list[list[int]]]:
    """The model folder and the prompts' token ids of `kind` (module docstring)."""
    from hf_reference import smollm2_folder, tiny_model_folder

    if kind != "smollm2":
        return tiny_model_folder(kind), prompts(n, seed=len(kind))
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    folder = smollm2_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    texts = pq.read_table(ROOT / "data/legal/prompts.parquet").column("prompt").to_pylist()[:n]
    rendered = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                              add_generation_prompt=True) for t in texts]
    return folder, [tokenizer(r, add_special_tokens=False)["input_ids"] for r in rendered]


def summarize(name: str, rows: list[list[int]], outs, refs) -> list[float]:
    """One line per model and one per diverged row; returns the deficits."""
    from hf_reference import first_divergence

    same, deficits = 0, []
    for out, (ref, logits) in zip(outs, refs):
        pos = first_divergence(out.token_ids, ref)
        if pos is None:
            same += 1
            continue
        row = logits[pos]
        top2 = row.topk(2).values
        ours = out.token_ids[pos]
        deficits.append(float(row.max() - row[ours]))
        print(f"  diverged at token {pos}: reference top-two gap {float(top2[0] - top2[1]):.4f}, "
              f"our token's deficit {deficits[-1]:.4f}, rank {int((row > row[ours]).sum()) + 1}")
    worst = max(deficits, default=0.0)
    print(f"{name}: {same}/{len(rows)} rows equal, {len(deficits)} diverged; deficit at the "
          f"first difference: max {worst:.4f}, median {np.median(deficits or [0]):.4f}")
    return deficits


def measure_kv(args: argparse.Namespace) -> None:
    from fp8_reference import greedy_logits, hf_fp8_kv_model
    from hf_reference import hf_model

    from batchllm import LLM, SamplingParams

    for kind in args.kinds.split(","):
        folder, rows = workload(kind, args.prompts)
        llm = LLM(str(folder), dtype="float32", device="cpu", kv_cache_memory=64 << 20,
                  kv_cache_dtype="fp8")
        outs = llm.generate(rows, SamplingParams(max_tokens=args.tokens, ignore_eos=True))
        plain = greedy_logits(hf_model(folder), rows, args.tokens, [])
        summarize(f"{kind}, fp8 KV vs plain transformers", rows, outs, plain)
        same_kv = greedy_logits(hf_fp8_kv_model(folder), rows, args.tokens, [])
        summarize(f"{kind}, fp8 KV vs transformers reading e4m3 KV", rows, outs, same_kv)


def measure_weights(args: argparse.Namespace) -> None:
    from fp8_checkpoints import fp8_checkpoint
    from fp8_reference import greedy_logits, hf_w8a8_model
    from hf_reference import hf_model

    from batchllm import LLM, SamplingParams

    if args.backend == "triton":
        os.environ["BATCHLLM_BACKEND"] = "triton"
    for kind in args.kinds.split(","):
        source, rows = workload(kind, args.prompts)
        folder, dequantized = fp8_checkpoint(source, args.scheme)
        llm = LLM(str(folder), dtype="float32", device="cpu", kv_cache_memory=64 << 20)
        outs = llm.generate(rows, SamplingParams(max_tokens=args.tokens, ignore_eos=True))
        refs = greedy_logits(hf_model(dequantized), rows, args.tokens, [])
        path = os.environ.get("BATCHLLM_FP8_MATMUL", "w8a8") if args.backend == "triton" \
            else "reference"
        summarize(f"{kind}, FP8 weights ({args.scheme}, {path}) vs transformers on the "
                  "dequantized weights", rows, outs, refs)
        if path == "w8a8":
            refs = greedy_logits(hf_w8a8_model(dequantized), rows, args.tokens, [])
            summarize(f"{kind}, FP8 weights ({args.scheme}, w8a8) vs transformers on the "
                      "dequantized weights, inputs rounded per token", rows, outs, refs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["kv", "weights"])
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--kinds", default="smollm2,llama,qwen2")
    ap.add_argument("--scheme", default="channel", help="tensor, channel or block (weights)")
    ap.add_argument("--backend", default="cpu", choices=["cpu", "triton"])
    args = ap.parse_args()
    torch.manual_seed(0)
    (measure_kv if args.what == "kv" else measure_weights)(args)


if __name__ == "__main__":
    main()
