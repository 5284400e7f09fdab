"""BATCHLLM_BACKEND=triton: the CUDA path end to end on this machine, in Triton's interpreter.

The same engine as on a GPU: the Triton kernels (attention, the fused pointwise steps, the
rotary embedding with the KV store) and the CUDA path's step loop (the device page table, the
step buffers, the decode graphs' static path run eagerly, or the eager decode path), on the
tiny random Llama, in float32 and bfloat16, with prefix sharing and chunked prefill, and without
sharing under preemption. Greedy tokens against transformers in the same dtype, one prompt at a
time: float32 under DESIGN.md's rule; bfloat16 under the team's (README, Correctness).
No C kernel and no torch twin of an attention or pointwise op may run: the ops record holds
only Triton launchers, every kernel expected is launched, and a TorchDispatchMode sees none of
the torch ops the twins are made of.
"""

from __future__ import annotations

import functools
from collections import Counter

import numpy as np
import pytest
import torch
from hf_reference import (
    assert_tokens_match,
    assert_tokens_match_bf16,
    hf_greedy_logits,
    hf_greedy_reference,
    tiny_model_folder,
)
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton")

from batchllm import LLM, SamplingParams

pytestmark = pytest.mark.slow  # the fast lane leaves it out (README: Run the tests)

MAX_TOKENS = 6
# On a GPU the same test runs compiled, its decode graphs captured and replayed.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# What the twins and the torch pointwise chains run, and the Triton path never does.
TWIN_OPS = {"rsqrt", "silu", "silu_", "pow", "_scaled_dot_product_flash_attention_for_cpu",
            "index_copy_", "exp", "exp_", "softmax", "_softmax", "cat", "amax"}


def prompts() -> list[list[int]]:
    """Two documents under one system prompt, two questions each; a duplicate; an outsider."""
    rng = np.random.default_rng(7)

    def toks(n: int) -> list[int]:
        return rng.integers(5, 4000, n).tolist()

    system = toks(13)
    rows = [system + doc + toks(int(rng.integers(2, 6)))
            for doc in (toks(9), toks(12)) for _ in range(2)]
    return [*rows, list(rows[1]), toks(9)]


@functools.cache
def reference(dtype: str) -> list[tuple[list[int], object]]:
    """transformers' greedy tokens per prompt, in `dtype`, with what the dtype's rule needs:
    the top-two gaps (float32) or the logits (bfloat16)."""
    if dtype == "float32":
        return hf_greedy_reference(tiny_model_folder("llama"), prompts(), MAX_TOKENS)
    return hf_greedy_logits(tiny_model_folder("llama"), prompts(), MAX_TOKENS, torch.bfloat16)


class _TwinOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in TWIN_OPS:
            self.seen[name] += 1
        return func(*args, **(kwargs or {}))


def kv_bytes(pages: int, page_size: int, dtype: str) -> int:
    # the tiny Llama: 2 layers x 2 KV heads x 16, K and V
    itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return pages * page_size * 2 * 2 * 2 * 16 * itemsize


SCENARIOS = {
    # shared prefixes computed once, decodes in groups (cascade); chunks of 16 tokens; decode
    # steps through the graphs' static buffers (run eagerly: nothing to capture here)
    "sharing-chunked": {"prefix_sharing": True, "max_batched_tokens": 16},
    # each row on its own, a pool too small for the working set (preemption), pages of 4;
    # decode steps eagerly
    "preempted": {"prefix_sharing": False, "page_size": 4, "max_batched_tokens": 32,
                  "cuda_graphs": False},
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_triton_engine_matches_transformers(dtype: str, scenario: str, monkeypatch) -> None:
    monkeypatch.setenv("BATCHLLM_BACKEND", "triton")
    from batchllm.engine.device_runner import DeviceRunner
    from batchllm_kernels.triton import launch

    settings = dict(SCENARIOS[scenario])
    if scenario == "preempted":
        longest = max(map(len, prompts())) + MAX_TOKENS
        settings["kv_cache_memory"] = kv_bytes(-(-longest // 4) + 2, 4, dtype)
    else:
        settings["kv_cache_memory"] = 16 << 20
    llm = LLM(str(tiny_model_folder("llama")), dtype=dtype, device=DEVICE, **settings)
    ops = llm.runtime.loaded.model.ops
    pointwise = [*ops.pointwise, ops.rope_store, ops.store_kv, ops.paged_attention,
                 ops.prefix_attention, ops.prefix_attention_into, ops.merge_states]
    assert all(f.__module__.startswith("batchllm_kernels.triton.") for f in pointwise), pointwise
    assert ops.device_steps and ops.projection == "dense"
    runner = llm.runtime.engine.runner
    assert isinstance(runner, DeviceRunner)
    assert (runner.graphs is not None) == settings.get("cuda_graphs", True)

    launched, tiles, run = Counter(), Counter(), launch.run

    def counted(launches) -> None:
        for x in launches:
            launched[x.kernel.fn.__name__] += 1
            if "SKIP_DECODES" in x.constexprs:  # paged attention: which tile
                tiles["decode" if x.constexprs["DECODE"] else
                      "skipping decodes" if x.constexprs["SKIP_DECODES"] else "all"] += 1
        run(launches)

    monkeypatch.setattr(launch, "run", counted)
    graph_keys: list = []
    if runner.graphs is not None:
        static = runner.graphs.replay
        monkeypatch.setattr(runner.graphs, "replay", lambda key: graph_keys.append(key) or
                            static(key))
    twins = _TwinOps()
    with twins:
        outs = llm.generate(prompts(), SamplingParams(max_tokens=MAX_TOKENS))
    assert not twins.seen, f"torch twin ops ran: {dict(twins.seen)}"
    expected = {"_add_rms_norm_kernel", "_rope_store_kernel", "_paged_attention_kernel",
                "_gated_mul_kernel"}
    if settings["prefix_sharing"]:
        expected |= {"_prefix_attention_kernel", "_merge_states_kernel"}
    assert expected <= set(launched), launched
    # chunks and decodes in one step: the decodes in their own tile, the chunks' tiles skip them
    assert tiles["decode"] and tiles["skipping decodes"], tiles
    if runner.graphs is not None:  # decode steps through the graphs' static buffers, in groups
        assert any(cascade for _, cascade, _ in graph_keys), graph_keys

    for i, (out, (tokens, ref)) in enumerate(zip(outs, reference(dtype))):
        assert out.finish_reason in ("stop", "length"), out.error
        if dtype == "float32":
            assert_tokens_match(out.token_ids, tokens, ref, row=i)
        else:
            assert_tokens_match_bf16(out.token_ids, tokens, ref, row=i)
    metrics = llm.last_metrics
    if settings["prefix_sharing"]:
        assert metrics["prefill_tokens"] == metrics["tree_tokens"] < metrics["prompt_tokens"]
    else:
        assert metrics["prefill_tokens"] >= metrics["prompt_tokens"]
        assert metrics["preemptions"] > 0
    assert metrics["dtype"] == dtype


def test_the_bf16_rule() -> None:
    """Diverging where the reference's two best are within BF16_ULPS ulps passes and ends the
    comparison; diverging where its top is clearly ahead fails."""
    from hf_reference import BF16_ULPS, bf16_ulp

    near, sure = [], []
    for tokens, logits in reference("bfloat16"):
        top2 = logits.topk(2, dim=-1)
        for pos in range(len(tokens)):
            top, second = top2.values[pos].tolist()
            case = (tokens, logits, pos, int(top2.indices[pos, 1]))
            (near if top - second <= BF16_ULPS * bf16_ulp(top) else sure).append(case)
    assert near and sure
    tokens, logits, pos, runner_up = sure[0]
    with pytest.raises(AssertionError, match=f"row 3: tokens differ at position {pos}"):
        assert_tokens_match_bf16([*tokens[:pos], runner_up], tokens, logits, row=3)
    tokens, logits, pos, runner_up = near[0]
    assert assert_tokens_match_bf16([*tokens[:pos], runner_up, 5, 6], tokens, logits) is True
    assert assert_tokens_match_bf16(tokens, tokens, logits) is False


def test_a_missing_or_broken_triton_fails_when_the_ops_are_picked(monkeypatch) -> None:
    """At load (ModelError: exit 2), with the reason; not at the first layer."""
    import sys

    from batchllm.model import ops
    from batchllm.model.errors import ModelError
    from batchllm_kernels.triton import launch

    monkeypatch.setenv("BATCHLLM_BACKEND", "triton")
    if torch.cuda.is_available():
        pytest.skip("checks the CPU's interpreter path (batchllm_kernels.triton is compiled here)")
    cpu = torch.device("cpu")
    monkeypatch.setitem(sys.modules, "batchllm_kernels.triton", None)  # as if triton were not there
    with pytest.raises(ModelError, match="model.device: the cpu path runs Triton kernels, and "
                                         "triton cannot be imported"):
        ops.pick_ops(cpu, torch.float32, 4, 16)
    monkeypatch.undo()
    monkeypatch.setenv("BATCHLLM_BACKEND", "triton")

    def broken(launches) -> None:
        raise RuntimeError("ptxas: not found")

    monkeypatch.setattr(launch, "run", broken)
    ops._check_triton_runs.cache_clear()
    try:
        with pytest.raises(ModelError, match="the Triton kernels cannot run on cpu "
                                             r"\(RuntimeError: ptxas: not found\)"):
            ops.pick_ops(cpu, torch.float32, 4, 16)
    finally:
        ops._check_triton_runs.cache_clear()
    monkeypatch.setenv("BATCHLLM_BACKEND", "cuda-please")
    with pytest.raises(ModelError, match="BATCHLLM_BACKEND: expected auto or triton"):
        ops.pick_ops(cpu, torch.float32, 4, 16)
