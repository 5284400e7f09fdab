"""The logprobs column of a part (DESIGN.md "Output Parquet": list<struct<token_id, logprob,
top: list<struct<token_id, logprob>>>>) built from the rows' arrays (TokenLogprobs, as the engine
hands them over): a few numpy and Arrow calls per row written, no Python object per token.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from batchllm.rows.record import TokenLogprob, TokenLogprobs
from batchllm.rows.samples import LOGPROBS_TYPE


def logprobs_column(values: list[TokenLogprobs | list[TokenLogprob] | None]) -> pa.Array:
    """The lines' log-probabilities as one LOGPROBS_TYPE column, built from their arrays (a
    list of TokenLogprob is taken too; None: null). Alternatives at -inf are left out."""
    rows = [v if v is None or isinstance(v, TokenLogprobs) else _arrays(v) for v in values]
    held = [v for v in rows if v is not None]
    lengths = np.array([len(v) for v in held], dtype=np.int32)
    offsets = np.zeros(len(rows) + 1, dtype=np.int32)
    offsets[1:][[v is not None for v in rows]] = lengths
    offsets = np.cumsum(offsets, dtype=np.int32)
    keep = [v.top_lp != -np.inf for v in held]  # [G, k] each
    top_offsets = np.concatenate([[0], np.cumsum(np.concatenate(
        [k.sum(axis=1) for k in keep] or [np.zeros(0, dtype=np.int64)]))]).astype(np.int32)

    def flat(name: str, dtype, top: bool = False) -> np.ndarray:
        parts = [getattr(v, name)[k] if top else getattr(v, name) for v, k in zip(held, keep)]
        return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype=dtype)

    top_type = LOGPROBS_TYPE.value_type.field("top").type
    top = pa.ListArray.from_arrays(pa.array(top_offsets), pa.StructArray.from_arrays(
        [pa.array(flat("top_id", np.int32, True)), pa.array(flat("top_lp", np.float32, True))],
        fields=list(top_type.value_type)))
    records = pa.StructArray.from_arrays(
        [pa.array(flat("token_id", np.int32)), pa.array(flat("logprob", np.float32)), top],
        fields=list(LOGPROBS_TYPE.value_type))
    mask = pa.array([v is None for v in rows])
    return pa.ListArray.from_arrays(pa.array(offsets), records, mask=mask).cast(LOGPROBS_TYPE)


def _arrays(records: list[TokenLogprob]) -> TokenLogprobs:
    """TokenLogprob records as arrays (a missing alternative: -inf)."""
    k = max((len(r.top) for r in records), default=0)
    top_id = np.zeros((len(records), k), dtype=np.int64)
    top_lp = np.full((len(records), k), -np.inf, dtype=np.float32)
    for i, r in enumerate(records):
        for j, (t, v) in enumerate(r.top):
            top_id[i, j], top_lp[i, j] = t, v
    return TokenLogprobs(np.array([r.token_id for r in records], dtype=np.int64),
                         np.array([r.logprob for r in records], dtype=np.float32), top_id, top_lp)
