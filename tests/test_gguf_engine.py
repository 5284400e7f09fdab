"""The default model, SmolLM2-135M-Instruct's Q4_1 GGUF, runs on the CPU's C path from its own
blocks (model/gguf_blocks.py, kernels/cpu/blocks.c): every projection and the tied lm_head
(Q8_0) as the file holds them, in the one-call layers; and it gives what the float32 conversion
(BATCHLLM_GGUF_BLOCKS=0) gives, bit for bit: the same tokens and the same log-probabilities,
the block kernel's sums being the panel kernel's over the same dequantized values. (Against
transformers: test_engine_equivalence.py's SmolLM2 test, whose rule holds as for float32.)"""

import pytest

from batchllm import LLM, SamplingParams
from batchllm.model.cpu_layers import CpuLayers

PROMPTS = ["The capital of France is", "List three prime numbers:", "def fib(n):",
           "The capital of France is a city that"]


def run(monkeypatch, blocks: bool):
    monkeypatch.setenv("BATCHLLM_GGUF_BLOCKS", "1" if blocks else "0")
    llm = LLM("smollm2-135m-instruct", dtype="float32", device="cpu")
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, logprobs=3))
    return llm.runtime.loaded.model, outs


@pytest.mark.slow  # loads the real SmolLM2 model twice
def test_smollm2_runs_from_its_blocks_as_its_float32_conversion(monkeypatch):
    model, outs = run(monkeypatch, blocks=True)
    projections = [p for layer in model.layers
                   for p in (layer.attn.qkv, layer.attn.o, layer.mlp.gate_up, layer.mlp.down)]
    assert {p.kind for p in projections} == {"Q4_1"}
    assert all(p.panels is None for p in projections)  # no float32 weight laid out
    assert model.lm_head.kind == "Q8_0"
    assert CpuLayers.of(model) is not None  # the one-call layers run the blocks
    dense_model, dense = run(monkeypatch, blocks=False)
    assert dense_model.lm_head.blocks is None and dense_model.lm_head.panels is not None
    assert [o.token_ids for o in outs] == [o.token_ids for o in dense]
    assert [o.logprobs for o in outs] == [o.logprobs for o in dense]  # exactly equal values
