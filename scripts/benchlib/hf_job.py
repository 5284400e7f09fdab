"""The transformers baseline as a user runs it, as one process: load the tokenizer and the model,
render each chat with the chat template, generate in static batches, write the completions.
The bench times this whole process (`--whole-process`), imports and model load included.

    python scripts/benchlib/hf_job.py WORKLOAD.parquet MODEL_FOLDER OUT.json [--rows N]
        [--batch-size 8] [--max-tokens 64] [--eos]

OUT.json: prompt_tokens, output_tokens, prefill_tokens (padded tokens fed). Only transformers,
torch and pyarrow are imported, as in a script of the user's own.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pyarrow.parquet as pq
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baselines import hf_static  # the same static batching as the in-process bench


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workload", type=Path)
    ap.add_argument("model", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--rows", type=int)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--eos", action="store_true", help="stop at end-of-sequence")
    args = ap.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    table = pq.read_table(args.workload)
    if args.rows is not None:
        table = table.slice(0, args.rows)
    data = table.to_pylist()
    chats = [r.get("messages") or [{"role": "user", "content": r["prompt"]}] for r in data]
    limits = [int(r.get("max_tokens") or args.max_tokens) for r in data]
    prompts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True,
                                             return_dict=False) for c in chats]
    gen = GenerationConfig.from_pretrained(args.model)
    eos = gen.eos_token_id if gen.eos_token_id is not None else tokenizer.eos_token_id
    eos_ids = {eos} if isinstance(eos, int) else set(eos)
    if tokenizer.eos_token_id is not None:
        eos_ids.add(tokenizer.eos_token_id)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    r = hf_static(model, prompts, limits, pad, args.batch_size, eos_ids if args.eos else None)
    args.out.write_text(json.dumps({"prompt_tokens": sum(len(p) for p in prompts),
                                    "output_tokens": r["output_tokens"],
                                    "prefill_tokens": r["prefill_tokens"]}))


if __name__ == "__main__":
    main()
