"""The two jobs of scripts/gpu_check.sh, as token-id Parquets scripts/bench.py reads
(id, prompt_token_ids, max_tokens), for random-weight models (no text, no tokenizer).

    python scripts/gpu_workloads.py OUT_DIR [--vocab 128256] [--tiny]

  no_sharing.parquet      nano-vllm's benchmark: 256 sequences of 100-1,024 random tokens, each
                          with 100-1,024 output tokens (random, seed 0)
  shared_prefix.parquet   4,096 rows: one 200-token system prompt, 64 documents of 700 tokens,
                          64 questions of 20-40 tokens under each; 32-128 output tokens
--tiny: the same shapes, small enough for the Triton interpreter (a smoke run on the CPU).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def write(path: Path, prompts: list[list[int]], max_tokens: list[int]) -> Path:
    pq.write_table(pa.table({
        "id": np.arange(len(prompts), dtype=np.int64),
        "prompt_token_ids": pa.array(prompts, type=pa.list_(pa.int32())),
        "max_tokens": pa.array(max_tokens, type=pa.int32()),
    }), path)
    return path


def no_sharing(rng: np.random.Generator, seqs: int, longest: int, vocab: int):
    prompts = [rng.integers(0, min(vocab, 10_000), int(rng.integers(100 if longest > 100 else 4,
                                                                     longest + 1))).tolist()
               for _ in range(seqs)]
    outs = [int(rng.integers(100 if longest > 100 else 2, longest + 1)) for _ in range(seqs)]
    return prompts, outs


def shared_prefix(rng: np.random.Generator, docs: int, questions: int, doc_len: int,
                  system_len: int, max_out: int, vocab: int):
    def toks(n: int) -> list[int]:
        return rng.integers(3, vocab, n).tolist()

    system = toks(system_len)
    prompts, outs = [], []
    for _ in range(docs):
        doc = toks(doc_len)
        for _ in range(questions):
            prompts.append(system + doc + toks(int(rng.integers(20, 41))))
            outs.append(int(rng.integers(max(2, max_out // 4), max_out + 1)))
    return prompts, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    if args.tiny:
        a = no_sharing(rng, 4, 12, args.vocab)
        b = shared_prefix(rng, 2, 3, 12, 8, 6, args.vocab)
    else:
        a = no_sharing(rng, 256, 1024, args.vocab)
        b = shared_prefix(rng, 64, 64, 700, 200, 128, args.vocab)
    for name, (prompts, outs) in (("no_sharing", a), ("shared_prefix", b)):
        path = write(args.out / f"{name}.parquet", prompts, outs)
        print(f"{path}: {len(prompts)} rows, {sum(map(len, prompts))} prompt tokens, "
              f"{sum(outs)} output tokens")


if __name__ == "__main__":
    main()
