"""Planner scale benchmark: synthetic prompts as flat int32 tokens + offsets, then make_plan.

Each prompt is template header + document + question stem + distinct question + template footer
(a document always uses the same template), ~500 token ids. Prints the wall time of each stage,
the peak RSS (whole process, and of the planning stage alone where Linux lets us reset the
high-water mark), tree_tokens and groups.

    python scripts/bench_planner.py              # 1,000,000 rows
    python scripts/bench_planner.py --rows 20000 # quick run
"""

from __future__ import annotations

import argparse
import resource
import time

import numpy as np

from batchllm.plan.arrays import concat_ranges
from batchllm.plan.peak_pages import predict_peak_pages
from batchllm.plan.planner import make_plan
from batchllm.plan.tree import PrefixTree


def synthetic(rows: int, docs: int, templates: int = 4, seed: int = 0, vocab: int = 49152):
    """(tokens [T] int32, offsets [rows + 1] int64, max_tokens [rows] int32)."""
    rng = np.random.default_rng(seed)
    stems = 16
    lens = np.concatenate((
        rng.integers(30, 61, templates),  # headers
        rng.integers(350, 451, docs),  # documents
        np.full(stems, 4),  # question stems
        rng.integers(5, 16, templates),  # footers
    ))
    pool_off = np.concatenate(([0], np.cumsum(lens)))
    pool = rng.integers(0, vocab, pool_off[-1], dtype=np.int32)
    doc = rng.integers(0, docs, rows)
    tmpl, stem = doc % templates, rng.integers(0, stems, rows)
    qlen = rng.integers(30, 71, rows)
    pieces = np.stack((tmpl, templates + doc, templates + docs + stem,  # [rows, 4] pool pieces
                       templates + docs + stems + tmpl), axis=1)
    plen = lens[pieces]
    row_len = plen.sum(1) + qlen
    offsets = np.concatenate(([0], np.cumsum(row_len)))
    tokens = np.empty(offsets[-1], np.int32)
    for lo in range(0, rows, 20000):  # bounded temporaries
        hi = min(lo + 20000, rows)
        p, pl, off = pieces[lo:hi], plen[lo:hi], offsets[lo:hi]
        dst = off[:, None] + np.concatenate((np.zeros((hi - lo, 1), np.int64),
                                              np.cumsum(pl[:, :2], axis=1)), axis=1)
        dst = np.concatenate((dst, (dst[:, 2] + pl[:, 2])[:, None]), axis=1)  # question start
        q = dst[:, 3].copy()
        dst[:, 3] = q + qlen[lo:hi]  # footer follows the question
        tokens[concat_ranges(dst.ravel(), pl.ravel())] = pool[
            concat_ranges(pool_off[p.ravel()], pl.ravel())]
        qi = concat_ranges(q, qlen[lo:hi])
        tokens[qi] = rng.integers(0, vocab, len(qi), dtype=np.int32)
    max_tokens = rng.integers(16, 257, rows).astype(np.int32)
    return tokens, offsets, max_tokens


def _rss_mib(field: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--docs", type=int, default=None, help="default: rows // 20")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--check", action="store_true", help="also run tree.check() and plan.check()")
    args = ap.parse_args()
    docs = args.docs or max(1, args.rows // 20)

    t0 = time.perf_counter()
    tokens, offsets, max_tokens = synthetic(args.rows, docs)
    t1 = time.perf_counter()
    print(f"data: {args.rows:,} rows, {len(tokens):,} tokens ({tokens.nbytes / 2**30:.2f} GiB), "
          f"{docs:,} documents, generated in {t1 - t0:.1f} s; RSS {_rss_mib('VmRSS'):.0f} MiB")
    reset = _reset_peak()

    clock = [(time.perf_counter(), time.process_time())]
    tree = PrefixTree.build(tokens, offsets)
    clock.append((time.perf_counter(), time.process_time()))
    plan = make_plan(tree, max_tokens, prefix_sharing=True, order="prefix-tree")
    clock.append((time.perf_counter(), time.process_time()))
    peak_pages = predict_peak_pages(plan, args.page_size, args.max_num_seqs)
    clock.append((time.perf_counter(), time.process_time()))
    hwm = _rss_mib("VmHWM")
    stats = plan.stats()

    def took(a: int, b: int) -> str:
        return (f"{clock[b][0] - clock[a][0]:7.1f} s wall {clock[b][1] - clock[a][1]:7.1f} s CPU")

    print(f"tree build      {took(0, 1)}  ({tree.num_nodes:,} tree nodes)")
    print(f"make_plan       {took(1, 2)}")
    print(f"peak pages sim  {took(2, 3)}  -> {peak_pages:,} pages "
          f"(page_size {args.page_size}, max_num_seqs {args.max_num_seqs})")
    print(f"total planning  {took(0, 3)}")
    print(f"peak RSS        {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:7.0f} MiB "
          "(process, ru_maxrss)")
    if reset and hwm is not None:
        print(f"peak RSS        {hwm:7.0f} MiB (planning stage, data included)")
    for key in ("rows", "prompt_tokens", "tree_tokens", "predicted_prefill_tokens",
                "sharing_ratio", "groups", "levels"):
        print(f"{key:26s}{stats[key]:,}" if key != "sharing_ratio"
              else f"{key:26s}{stats[key]:.4f}")
    if args.check:
        t5 = time.perf_counter()
        tree.check()
        plan.check()
        print(f"checks passed in {time.perf_counter() - t5:.1f} s")


if __name__ == "__main__":
    main()
