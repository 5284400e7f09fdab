"""The forward the CUDA path captures in graphs synchronises with nothing (issue 28 item 3): no
op of it waits for the device or reads a size back to the host, dense and mixture-of-experts.

Two guards, one per machine:
  CPU   the known synchronising torch ops (bincount, item, tolist, nonzero, cpu, unique,
        masked_select, a boolean index, a tensor's truth or int value...) patched to raise when
        our code calls them, during model.hidden / logits / greedy of real engine steps on the
        CUDA path's ops (BATCHLLM_BACKEND=triton: the Triton kernels in the interpreter; the
        interpreter's own host copies stand in for the device and are let through);
  CUDA  torch.cuda.set_sync_debug_mode("error") around the same calls on the device.
The sampling and the step planning after the forward may read to the host: they are not inside
the guard. The CPU path's own expert loop (no grouped launch: one C-kernel projection per
expert) reads the run bounds to the host, where there is no device to wait for; it is not the
code a graph holds, so not guarded here."""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch
from hf_reference import tiny_model_folder
from test_engine_equivalence import nested_prompts
from triton_interpreter import CUDA, load

from batchllm import LLM, SamplingParams
from batchllm.model.experts import group_by_expert

pytestmark = pytest.mark.slow  # the Triton interpreter (the fast lane leaves it out)


class SyncCalled(AssertionError):
    """Our code called an op that synchronises on CUDA."""


def _caller_allowed() -> bool:
    """Triton's interpreter copies tensors to the host in place of a launch: allowed."""
    return sys._getframe(2).f_globals.get("__name__", "").startswith("triton.")


def _boolean_index(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


def _guarded(name: str, original, when=lambda *a, **k: True):
    def guard(*args, **kwargs):
        if not _caller_allowed() and when(*args, **kwargs):
            raise SyncCalled(f"{name} called in the forward: it synchronises on CUDA")
        return original(*args, **kwargs)
    return guard


SYNC_OPS = {  # (owner, attribute, raise only when)
    "torch.bincount": (torch, "bincount", None),
    "torch.nonzero": (torch, "nonzero", None),
    "torch.argwhere": (torch, "argwhere", None),
    "torch.unique": (torch, "unique", None),
    "torch.masked_select": (torch, "masked_select", None),
    "torch.where(cond)": (torch, "where", lambda *a, **k: len(a) + len(k) == 1),
    "torch.repeat_interleave": (torch, "repeat_interleave",
                                lambda *a, **k: "output_size" not in k),
    "Tensor.bincount": (torch.Tensor, "bincount", None),
    "Tensor.nonzero": (torch.Tensor, "nonzero", None),
    "Tensor.unique": (torch.Tensor, "unique", None),
    "Tensor.masked_select": (torch.Tensor, "masked_select", None),
    "Tensor.item": (torch.Tensor, "item", None),
    "Tensor.tolist": (torch.Tensor, "tolist", None),
    "Tensor.cpu": (torch.Tensor, "cpu", None),
    "Tensor.numpy": (torch.Tensor, "numpy", None),
    "Tensor.__bool__": (torch.Tensor, "__bool__", None),
    "Tensor.__int__": (torch.Tensor, "__int__", None),
    "Tensor.__float__": (torch.Tensor, "__float__", None),
    "Tensor.__index__": (torch.Tensor, "__index__", None),
    "a boolean index": (torch.Tensor, "__getitem__", lambda self, index: _boolean_index(index)),
}


@contextlib.contextmanager
def sync_guard():
    """The ops of SYNC_OPS raise SyncCalled while inside (and, on CUDA, any synchronisation)."""
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in SYNC_OPS.values()]
    try:
        for name, (owner, attr, when) in SYNC_OPS.items():
            setattr(owner, attr, _guarded(name, getattr(owner, attr),
                                          when or (lambda *a, **k: True)))
        if CUDA:
            torch.cuda.set_sync_debug_mode("error")
        yield
    finally:
        if CUDA:
            torch.cuda.set_sync_debug_mode("default")
        for owner, attr, original in saved:
            setattr(owner, attr, original)


@pytest.mark.parametrize("name", list(SYNC_OPS))
def test_the_guard_catches_each_sync_op(name: str) -> None:
    """Each patched op raises inside the guard when called from outside Triton's interpreter."""
    x = torch.tensor([1, 0, 2, 2])
    calls = {
        "torch.bincount": lambda: torch.bincount(x), "Tensor.bincount": lambda: x.bincount(),
        "torch.nonzero": lambda: torch.nonzero(x), "Tensor.nonzero": lambda: x.nonzero(),
        "torch.argwhere": lambda: torch.argwhere(x), "torch.unique": lambda: torch.unique(x),
        "Tensor.unique": lambda: x.unique(), "torch.masked_select": lambda: torch.masked_select(
            x, x > 0), "Tensor.masked_select": lambda: x.masked_select(x > 0),
        "torch.where(cond)": lambda: torch.where(x > 0),
        "torch.repeat_interleave": lambda: torch.repeat_interleave(x, x),
        "Tensor.item": lambda: x[0].item(), "Tensor.tolist": lambda: x.tolist(),
        "Tensor.cpu": lambda: x.cpu(), "Tensor.numpy": lambda: x.numpy(),
        "Tensor.__bool__": lambda: bool(x[0]), "Tensor.__int__": lambda: int(x[0]),
        "Tensor.__float__": lambda: float(x[0]), "Tensor.__index__": lambda: [0, 1][x[1]],
        "a boolean index": lambda: x[x > 0],
    }
    call = calls[name]
    call()  # fine outside
    with sync_guard():
        _ = torch.where(x > 0, x, x) + x[x.long()]  # the sync-free forms pass
        with pytest.raises(SyncCalled, match=name.split("(")[0]):
            call()


def test_group_by_expert_under_the_guard() -> None:
    chosen = torch.tensor([[2, 0], [0, 2], [3, 0]])
    with sync_guard():
        order, offsets = group_by_expert(chosen, 4)
    assert offsets.tolist() == [0, 3, 3, 5, 6] and order.tolist() == [1, 2, 5, 0, 3, 4]


def _guard_forward(model) -> list[str]:
    """model.hidden / logits / greedy each run inside sync_guard; the names of the calls made."""
    calls = []
    for name in ("hidden", "logits", "greedy"):
        original = getattr(model, name)

        def guarded(*args, _original=original, _name=name):
            calls.append(_name)
            with sync_guard():
                return _original(*args)
        setattr(model, name, guarded)
    return calls


@pytest.mark.parametrize("kind", ["llama3", "mixtral", "qwen2_moe"])
def test_the_forward_of_the_cuda_path_never_synchronises(kind: str, monkeypatch) -> None:
    """Prefill chunks, decodes, mixed steps, a shared prefix: every forward of a real run."""
    for name in ("store_kv", "paged_attention", "prefix_attention", "merge_states",
                 "grouped_matmul", "rms_norm", "rotary", "gated_mul"):
        load(f"batchllm_kernels.triton.{name}")  # made for the interpreter before the ops pick them
    if not CUDA:
        monkeypatch.setenv("BATCHLLM_BACKEND", "triton")
    llm = LLM(str(tiny_model_folder(kind)), dtype="float32", device="cuda" if CUDA else "cpu",
              kv_cache_memory=16 << 20, max_batched_tokens=40, prefix_sharing=True)
    model = llm.runtime.loaded.model
    assert model.ops.grouped_matmul is not None
    calls = _guard_forward(model)
    outs = llm.generate(nested_prompts()[:4], SamplingParams(max_tokens=3))
    assert all(out.finish_reason == "length" for out in outs), [o.error for o in outs]
    assert calls.count("hidden") >= 3


@pytest.mark.skipif(not CUDA, reason="torch.cuda.set_sync_debug_mode needs a CUDA device; "
                    "the CPU guard above runs the same forward on the CUDA path's ops")
def test_moe_layer_is_captured_in_a_cuda_graph() -> None:
    llm = LLM(str(tiny_model_folder("mixtral")), dtype="float32", device="cuda",
              kv_cache_memory=16 << 20)
    moe = llm.runtime.loaded.model.layers[0].mlp
    x = torch.randn(8, moe.router.in_features, device="cuda")
    act = llm.runtime.loaded.model.act_mul
    eager = moe(x, act)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe(x, act)
    graph.replay()
    torch.testing.assert_close(captured, eager)
