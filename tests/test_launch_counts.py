"""Launches per decode step of a 30-layer model on the CUDA path (BATCHLLM_BACKEND=triton).

Triton launches are counted where every launcher hands them over (kernels/triton/launch.run,
replaced by a counter that launches nothing: the step computes garbage, which is fine for
counting); torch's ops by a TorchDispatchMode, less those that launch no kernel (views,
allocations). Counted per decode step of the runner, sampling excluded (one argmax, then the
step's one device-to-host copy; on the graph path the argmax of these greedy steps is in the
graph, and counted).

Before issue 14 (torch's pointwise chains, a store kernel; page tables and metadata from Python
lists in 8 pageable copies, which do not show on the CPU), counted the same way on that code
(0644151): 1,122 per decode step, 60 Triton launches and 1,062 torch ops (37 per layer). Now:
eagerly 308 (10 per layer: 5 Triton, 5 torch; and 8 once); the graph path 339 (the keys of its
few sequences split: a combine per layer; the greedy argmax), of which all but the two staging
copies are the forward, lm_head and argmax that CUDA replays as one graph: 3 launches a step.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hf_reference import tiny_model_folder
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="counts the same code on the CPU; on CUDA the decode forward is a graph replay")

from batchllm import LLM, SamplingParams

LAYERS = 30
# aten ops that launch no kernel on CUDA: views (reshape: of the attention's contiguous output)
# and allocations
_NO_KERNEL = {"view", "_unsafe_view", "reshape", "chunk", "split", "slice", "select", "t",
              "transpose", "permute",
              "expand", "as_strided", "unsqueeze", "squeeze", "detach", "alias", "empty",
              "empty_like", "empty_strided", "new_empty", "lift_fresh", "lift_fresh_copy"}


class _TorchOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in _NO_KERNEL:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def count_decode_steps(monkeypatch, cuda_graphs: bool) -> list[dict]:
    """Per decode step of a short run: Triton launches, torch ops (outside and inside what a
    CUDA graph captures)."""
    monkeypatch.setenv("BATCHLLM_BACKEND", "triton")
    from batchllm_kernels.triton import launch

    llm = LLM(str(tiny_model_folder("llama-30")), dtype="float32", device="cpu",
              kv_cache_memory=32 << 20, cuda_graphs=cuda_graphs)
    runner = llm.runtime.engine.runner
    steps: list[dict] = []
    current: dict = {}

    def count_launches(launches) -> None:
        for x in launches:
            current["triton"][x.kernel.fn.__name__] += 1

    def counted_step(seqs, counts, wants, *rest):
        current.update(triton=Counter(), graph=Counter())
        mode = _TorchOps()
        with mode:
            out = forward_step(seqs, counts, wants, *rest)
        current["torch"] = mode.ops
        current["decode"] = all(n == 1 for n in counts)
        steps.append(dict(current))
        return out

    forward_step = runner.forward_step
    monkeypatch.setattr(launch, "run", count_launches)
    monkeypatch.setattr(runner, "forward_step", counted_step)
    llm.generate([list(range(10, 30)), list(range(40, 47))],
                 SamplingParams(max_tokens=4, ignore_eos=True))
    return [s for s in steps if s["decode"]]


@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["graph-path", "eager"])
def test_launches_per_decode_step(monkeypatch, cuda_graphs):
    steps = count_decode_steps(monkeypatch, cuda_graphs)
    assert len(steps) == 3  # 4 tokens: the first from the prefill, 3 decode steps
    for step in steps:
        triton, ops = step["triton"], step["torch"]
        # Per layer: add+RMSNorm twice, rope+store, attention (the graph path splits the keys
        # of its few sequences: their combine), SiLU-and-multiply; and the final norm.
        split = triton["_combine_splits_kernel"] // LAYERS
        assert dict(triton) == {"_add_rms_norm_kernel": 2 * LAYERS + 1,
                                "_rope_store_kernel": LAYERS, "_paged_attention_kernel": LAYERS,
                                "_gated_mul_kernel": LAYERS,
                                **({"_combine_splits_kernel": LAYERS} if split else {})}
        assert split == cuda_graphs  # the graph path plans splits for max_model_len
        # Per layer: the four projections and the residual add; once: lm_head, the embedding
        # and the sampled rows (index), the page table gathered (index_select), one staging
        # copy per dtype (copy_), the logits to float32 (to); new page-table entries only when
        # a sequence enters a new page (index_put_; not in these steps). The graph path: these
        # greedy steps' argmax in the graph (eagerly it is the sampler's, not counted).
        assert dict(ops) == {"linear": 4 * LAYERS + 1, "add_": LAYERS, "index": 2,
                             "index_select": 1, "copy_": 2, "to": 1,
                             **({"argmax": 1} if cuda_graphs else {})}, ops
        total = sum(triton.values()) + sum(ops.values())
        assert total == (11 * LAYERS + 9 if split else 10 * LAYERS + 8)
        print(f"decode step ({'graph path, eagerly' if cuda_graphs else 'eager'}): "
              f"{sum(triton.values())} Triton launches + {sum(ops.values())} torch ops = {total}")
