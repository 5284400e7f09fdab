"""Range partitioning of a job's rows by their leading tokens, for jobs too large to plan on one
machine: tasks sample their blocks, the driver picks N-1 cut keys, each worker plans its range.

Sorting the prompts' token sequences yields a depth-first order of the prefix tree, so a range of
that order is a run of whole subtrees: a cut separates two rows' shared prefix only where it falls
inside a subtree, and the tokens computed twice are exactly the longest common prefix of the rows
on either side of the cut. (A hash of the first page would send every row of a job that starts
with one system prompt to the same worker.)

Keys are the first KEY_TOKENS token ids as big-endian uint32 bytes, so byte order is token order
and a prefix sorts before its extensions. Rows that cannot run have the empty key (partition 0):
the rows given here must have been admitted (rows/admission.py), so that their error says so.
Torch-free and Ray-free.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from batchllm.rows.record import Row

KEY_TOKENS = 1024  # rows equal in their first 1024 tokens always land on the same worker
SAMPLES = 32768  # keys the driver receives from all blocks together (each at most 4 KiB)


def row_key(prompt_ids: np.ndarray | None) -> bytes:
    if prompt_ids is None:
        return b""
    return np.asarray(prompt_ids[:KEY_TOKENS], dtype=">u4").tobytes()


def common_tokens(a: bytes, b: bytes) -> int:
    """Length of the longest common prefix of two keys, in tokens."""
    n = min(len(a), len(b)) // 4
    x = np.frombuffer(a, ">u4", count=n)
    y = np.frombuffer(b, ">u4", count=n)
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if len(diff) else n


@dataclass
class BlockSample:
    """A block's rows in key order, summarized: keys[i] is a row's key, weights[i] the predicted
    cost of the block's rows after keys[i-1] up to keys[i] (tokens the block's own prefix tree
    adds for them, plus their max_tokens)."""

    keys: list[bytes]  # [S] sorted
    weights: np.ndarray  # [S] int64


def sample_block(rows: Sequence[Row], max_samples: int) -> BlockSample:
    """Every ceil(n / max_samples)-th runnable row of the block in key order, with the cost of the
    rows up to it."""
    good = [r for r in rows if r.ok]
    if not good:
        return BlockSample([], np.zeros(0, np.int64))
    keys = [row_key(r.prompt_ids) for r in good]
    order = sorted(range(len(good)), key=keys.__getitem__)
    cost = np.empty(len(order), np.int64)
    prev = b""
    for j, i in enumerate(order):
        r = good[i]
        cost[j] = len(r.prompt_ids) - common_tokens(prev, keys[i]) + r.sampling.max_tokens
        prev = keys[i]
    step = -(-len(order) // max_samples)
    ends = list(range(step - 1, len(order), step))
    if ends[-1] != len(order) - 1:
        ends.append(len(order) - 1)
    sums = np.add.reduceat(cost, [0] + [e + 1 for e in ends[:-1]])
    return BlockSample([keys[order[e]] for e in ends], sums.astype(np.int64))


def samples_per_block(num_blocks: int) -> int:
    """Each block's share of SAMPLES (at least 16)."""
    return max(16, SAMPLES // max(1, num_blocks))


def choose_cuts(samples: Sequence[BlockSample], num_parts: int,
                tolerance: float = 0.1) -> list[bytes]:
    """Up to num_parts - 1 increasing upper keys: a row goes to the first part whose upper key is
    >= its key (the last part takes the rest). The k-th cut is, among the sample boundaries
    within `tolerance` * total / num_parts of k / num_parts of the total cost, the one whose
    neighbours share the fewest tokens, the nearest among equals; with none there, the nearest.
    Equal keys are never cut apart."""
    pairs = sorted((k, int(w)) for s in samples for k, w in zip(s.keys, s.weights.tolist()))
    keys = [k for k, _ in pairs]
    cum = np.cumsum([w for _, w in pairs], dtype=np.float64)  # cost up to and with sample i
    total = float(cum[-1]) if len(cum) else 0.0
    window = tolerance * total / num_parts
    cuttable = [i for i in range(len(keys) - 1) if keys[i] != keys[i + 1]]
    at = np.asarray(cuttable, np.int64)
    uppers: list[bytes] = []
    last = -1
    for k in range(1, num_parts):
        target = total * k / num_parts
        after = at[at > last]
        if len(after) == 0:
            break  # fewer distinct keys than parts: the last parts stay empty
        off = np.abs(cum[after] - target)
        inside = after[off <= window]
        if len(inside):
            shared = [common_tokens(keys[i], keys[i + 1]) for i in inside.tolist()]
            pick = min(range(len(inside)),
                       key=lambda j: (shared[j], abs(cum[inside[j]] - target)))
            last = int(inside[pick])
        else:
            last = int(after[int(np.argmin(off))])
        uppers.append(_upper(keys[last], keys[last + 1]))
    return uppers


def _upper(left: bytes, right: bytes) -> bytes:
    """The largest key of the subtree that holds `left` just below its common prefix with
    `right` (left < right): unsampled rows sharing more than that prefix with `left` go with it,
    so the cut splits no deeper than the common prefix. Token ids are < 2**31, so a row's next
    token after the prefix always sorts below four 0xff bytes."""
    shared = common_tokens(left, right)
    if 4 * shared == len(left):  # left is a prefix of right: only left's own rows go left
        return left
    return left[: 4 * (shared + 1)] + b"\xff" * 4


def route(rows: Sequence[Row], uppers: Sequence[bytes]) -> np.ndarray:
    """[n] int32 part of each row: the first part whose upper key is >= the row's key."""
    return np.asarray([bisect.bisect_left(uppers, row_key(r.prompt_ids)) if r.ok else 0
                       for r in rows], np.int32)
