"""The C pointwise kernels (kernels/cpu/ops.c) against Hugging Face's own Llama modules (RMSNorm,
apply_rotary_pos_emb, SiLU) in float64, and their torch twins (kernels/reference/pointwise.py)
likewise; sizes that are not multiples of the 8-wide vectors exercise the tails."""

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from batchllm_kernels.cpu import ops as cpu_ops
from batchllm_kernels.reference import pointwise


def c_ops():
    if cpu_ops.load() is None:
        pytest.skip("the C pointwise kernels could not be built here")
    return cpu_ops.C_OPS


IMPLS = {"c": c_ops, "torch": lambda: pointwise.TORCH_OPS}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("with_delta", [False, True])
@pytest.mark.parametrize("t, hidden", [(1, 576), (5, 37), (70, 64)])
def test_add_rms_norm_matches_llama_rms_norm(impl, with_delta, t, hidden):
    ops = IMPLS[impl]()
    gen = torch.Generator().manual_seed(t + hidden)
    h = torch.randn(t, hidden, generator=gen) * 3
    delta = torch.randn(t, hidden, generator=gen) if with_delta else None
    weight = torch.randn(hidden, generator=gen)
    expected_h = h.double() + (delta.double() if with_delta else 0)
    norm = LlamaRMSNorm(hidden, eps=1e-5).double()
    norm.weight.data.copy_(weight)
    expected = norm(expected_h)
    out = ops.add_rms_norm(h, delta, weight, 1e-5)
    torch.testing.assert_close(h.double(), expected_h, rtol=1e-6, atol=1e-6)  # h += delta
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("head_dim", [64, 18])
def test_rope_matches_apply_rotary_pos_emb(impl, head_dim):
    ops = IMPLS[impl]()
    from batchllm.model.rotary import rope_tables

    config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                         max_position_embeddings=300, rope_theta=10000.0)
    cos, sin = rope_tables(config, 300, torch.device("cpu"))[""]  # [300, D]
    gen = torch.Generator().manual_seed(head_dim)
    t, hq, hkv = 7, 4, 2
    qkv = torch.randn(t, (hq + 2 * hkv) * head_dim, generator=gen)
    positions = torch.tensor([0, 1, 5, 17, 100, 298, 299])
    before = qkv.clone()
    ops.rope_(qkv, positions, cos, sin, hq + hkv)
    q = before[:, : hq * head_dim].view(t, hq, head_dim).transpose(0, 1)[None].double()
    k = before[:, hq * head_dim : (hq + hkv) * head_dim].view(t, hkv, head_dim)
    k = k.transpose(0, 1)[None].double()
    eq, ek = apply_rotary_pos_emb(q, k, cos[positions][None].double(),
                                  sin[positions][None].double())
    got_q = qkv[:, : hq * head_dim].view(t, hq, head_dim).transpose(0, 1)[None]
    got_k = qkv[:, hq * head_dim : (hq + hkv) * head_dim].view(t, hkv, head_dim)
    torch.testing.assert_close(got_q.double(), eq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k.transpose(0, 1)[None].double(), ek, rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv[:, (hq + hkv) * head_dim :], before[:, (hq + hkv) * head_dim :])  # v


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("t, inter", [(1, 1536), (9, 13)])
def test_silu_mul_matches_silu(impl, t, inter):
    ops = IMPLS[impl]()
    gen = torch.Generator().manual_seed(t * inter)
    gate_up = torch.randn(t, 2 * inter, generator=gen) * 6  # deep into both tails of SiLU
    gate_up[0, :2] = torch.tensor([-120.0, 95.0])
    expected = F.silu(gate_up[:, :inter].double()) * gate_up[:, inter:].double()
    out = ops.silu_mul(gate_up.clone())
    assert out.shape == (t, inter)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_gelu_tanh_mul_matches_transformers_gelu_tanh(impl):
    from transformers.activations import ACT2FN

    ops = IMPLS[impl]()
    gate_up = torch.randn(9, 26, generator=torch.Generator().manual_seed(2)) * 4
    expected = ACT2FN["gelu_pytorch_tanh"](gate_up[:, :13].double()) * gate_up[:, 13:].double()
    torch.testing.assert_close(ops.gelu_tanh_mul(gate_up).double(), expected, rtol=1e-5,
                               atol=1e-6)


def test_non_contiguous_rows_are_refused():
    c_ops()
    with pytest.raises(ValueError, match="contiguous float32"):
        cpu_ops.C_OPS.silu_mul(torch.randn(4, 16)[:, ::2])


def test_rope_refuses_positions_outside_the_table():
    c_ops()
    table = torch.zeros(8, 4)
    with pytest.raises(IndexError, match="outside the table"):
        cpu_ops.C_OPS.rope_(torch.zeros(2, 8), torch.tensor([3, 8]), table, table, 2)
