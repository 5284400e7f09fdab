"""The CPU path's one-call layers (batchllm/model/cpu_layers.py, kernels/cpu/layers.c) give
decoder.py's loop over the layers its values bit for bit, on every kind of step; the models that
are not plain keep the loop. (Against transformers, the engine's own tests cover both: the
one-call layers are the default path of the plain families.)"""

from __future__ import annotations

import pytest
import torch
from hf_reference import tiny_model_folder
from test_engine_equivalence import nested_prompts

from batchllm import LLM, SamplingParams
from batchllm.model import decoder
from batchllm.model.cpu_layers import CpuLayers

PLAIN = ("llama", "qwen2", "mistral", "llama3", "phi3")
NOT_PLAIN = ("qwen3", "mistral_window", "gemma2", "gemma3", "mixtral", "qwen2_moe", "qwen3_moe",
             "olmoe")


def _llm(kind: str, **settings) -> LLM:
    return LLM(str(tiny_model_folder(kind)), dtype="float32", device="cpu",
               kv_cache_memory=64 << 20, **settings)


@pytest.mark.parametrize("kind", PLAIN)
def test_one_call_layers_give_the_loops_values_bit_for_bit(kind: str, monkeypatch) -> None:
    """Each step runs both ways: the final norm of its sampled rows and the keys and values it
    stored (every row's) must be the same bits. Steps of 13 tokens mix prefill chunks with
    decodes and cascade groups; MLP blocks of 5 rows make several blocks a step."""
    llm = _llm(kind, max_batched_tokens=13, page_size=4)
    model = llm.runtime.loaded.model
    layers = model.cpu_layers
    assert layers is not None, f"{kind}: its layers are plain"
    monkeypatch.setattr(decoder, "_mlp_rows", lambda x, width: 5)  # both paths take it
    hidden = model.hidden
    seen = {"decodes": 0, "chunks": 0, "cascade": 0, "mixed": 0}

    def both_ways(input_ids, positions, attention, sample_rows):
        m = attention.meta
        slots = m.slot_mapping
        outs = []
        for path in (None, layers):
            model.cpu_layers = path
            out = hidden(input_ids, positions, attention, sample_rows)
            kv = [c.flatten(1, 2)[:, slots].clone() for c in (attention.k_cache,
                                                               attention.v_cache)]
            outs.append((out, kv))
        (loop, loop_kv), (fused, fused_kv) = outs
        assert torch.equal(loop, fused), "final norms differ"
        assert all(torch.equal(a, b) for a, b in zip(loop_kv, fused_kv)), "stored k, v differ"
        queries = (m.cu_q[1:] - m.cu_q[:-1]).tolist()
        decodes, chunks = queries.count(1), sum(q > 1 for q in queries)
        seen["decodes"] += decodes > 0
        seen["chunks"] += chunks > 0
        seen["mixed"] += decodes > 0 and chunks > 0
        seen["cascade"] += m.cascade_rows > 0
        return fused

    monkeypatch.setattr(model, "hidden", both_ways)
    outs = llm.generate(nested_prompts(), SamplingParams(max_tokens=6, ignore_eos=True))
    assert all(len(o.token_ids) == 6 for o in outs)
    assert all(seen.values()), seen  # every kind of step was compared


@pytest.mark.parametrize("kind", NOT_PLAIN)
def test_models_that_are_not_plain_keep_the_loop(kind: str) -> None:
    model = _llm(kind).runtime.loaded.model
    assert model.cpu_layers is None
    assert CpuLayers.of(model) is None


def test_a_position_outside_the_rotary_tables_is_the_loops_index_error() -> None:
    """The C driver stops at the first layer whose tables a position lies outside of, and the
    error is the loop's (rope_c's)."""
    llm = _llm("llama")
    model = llm.runtime.loaded.model
    for layer in model.layers:  # tables cut to 8 positions: a prompt of 20 tokens falls outside
        layer.attn.cos, layer.attn.sin = layer.attn.cos[:8].clone(), layer.attn.sin[:8].clone()
    fused = CpuLayers.of(model)  # its records take the cut tables
    assert fused is not None
    for path in (None, fused):
        model.cpu_layers = path
        with pytest.raises(IndexError, match="positions outside the table of 8"):
            llm.generate([list(range(5, 25))], SamplingParams(max_tokens=2))
