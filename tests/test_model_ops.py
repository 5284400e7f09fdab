"""The one place that picks the forward's ops (batchllm/model/ops.py): which kernel serves which
device, dtype and head shape, and the switch that turns the C kernels off; and the model's
refusal of a family it does not implement."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, LlamaConfig

from batchllm.model.decoder import model_shape
from batchllm.model.errors import ModelError
from batchllm.model.ops import pick_ops
from batchllm_kernels.cpu import attention as cpu_attention
from batchllm_kernels.cpu import decode as cpu_decode
from batchllm_kernels.cpu import linear as cpu_linear
from batchllm_kernels.cpu import ops as cpu_ops
from batchllm_kernels.cpu import prefill as cpu_prefill
from batchllm_kernels.reference.paged_attention import paged_attention_ref
from batchllm_kernels.reference.pointwise import TORCH_OPS
from batchllm_kernels.reference.store_kv import store_kv_ref

CPU = torch.device("cpu")


def built() -> None:
    if any(load() is None for load in (cpu_decode.load, cpu_prefill.load, cpu_ops.load,
                                       cpu_linear.load)):
        pytest.skip("the C kernels could not be built here")


def assert_twins_only(ops) -> None:
    assert ops.paged_attention is paged_attention_ref and ops.store_kv is store_kv_ref
    assert ops.prefix_attention_into is None and ops.pointwise is TORCH_OPS
    assert ops.indexes_steps and ops.gathers_decodes and ops.gathers_chunks
    assert ops.projection != "panels"


def test_cpu_float32_runs_every_c_kernel():
    built()
    ops = pick_ops(CPU, torch.float32, 9, 64)
    assert ops.paged_attention is cpu_attention.paged_attention_cpu
    assert ops.prefix_attention_into is cpu_prefill.prefix_attention_into
    assert not ops.gathers_decodes and not ops.gathers_chunks
    assert ops.store_kv is cpu_ops.store_kv_c and ops.pointwise is cpu_ops.C_OPS
    assert ops.projection == "panels"


def test_the_switch_turns_off_kernels_already_loaded(monkeypatch):
    built()  # the loaders hold their libraries; the picking place still says no
    monkeypatch.setenv("BATCHLLM_CPU_KERNEL", "0")
    assert_twins_only(pick_ops(CPU, torch.float32, 9, 64))


def test_a_head_size_the_prefill_kernel_cannot_take():
    built()
    ops = pick_ops(CPU, torch.float32, 4, 24)  # 24: not a multiple of 16
    assert ops.paged_attention is cpu_attention.paged_attention_cpu  # decodes still in C
    assert not ops.gathers_decodes and ops.gathers_chunks
    assert ops.prefix_attention_into is None


def test_other_dtypes_on_the_cpu_run_the_twins():
    ops = pick_ops(CPU, torch.bfloat16, 9, 64)
    assert_twins_only(ops)
    assert ops.projection == "dense"


def test_cuda_runs_the_triton_kernels():
    pytest.importorskip("triton")
    from batchllm_kernels.triton import (
        gated_mul,
        grouped_matmul,
        merge_states,
        paged_attention,
        prefix_attention,
        rms_norm,
        rotary,
        store_kv,
    )

    ops = pick_ops(torch.device("cuda"), torch.bfloat16, 9, 64)  # picks; touches no GPU
    assert ops.store_kv is store_kv.store_kv and ops.merge_states is merge_states.merge_states
    assert ops.paged_attention is paged_attention.paged_attention
    assert ops.prefix_attention is prefix_attention.prefix_attention
    assert ops.prefix_attention_into is prefix_attention.prefix_attention_into
    assert ops.rope_store is rotary.rope_store
    assert not ops.indexes_steps and ops.tiles_decodes and ops.device_steps
    assert ops.pointwise == (rms_norm.add_rms_norm, rotary.rope_, gated_mul.silu_mul,
                            gated_mul.gelu_tanh_mul)
    assert ops.grouped_matmul is grouped_matmul.grouped_matmul
    assert ops.projection == "dense"


def test_an_unsupported_model_type_is_a_model_error():
    with pytest.raises(ModelError, match="model.path: model type 'gpt2' is not supported; "
                                         "supported: llama, mistral, qwen2, qwen3, gemma2, "
                                         "gemma3_text, phi3, mixtral, qwen2_moe, qwen3_moe, "
                                         "olmoe"):
        model_shape(GPT2Config())
    assert model_shape(LlamaConfig(num_attention_heads=4, hidden_size=64)).head_dim == 16
