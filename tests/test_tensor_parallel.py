"""engine.tensor_parallel: 2 over gloo (two processes on this machine): the same greedy tokens
as transformers (and so as tensor_parallel: 1, which test_engine_equivalence checks against the
same reference) on tiny random models, with sharing on and off, chunked prefill and
preemption; the mixture-of-experts families with each expert split over the ranks, against
tensor_parallel: 1 and transformers. One process group at a time: each case builds its own
engine."""

from __future__ import annotations

import pytest
import torch
from hf_reference import assert_tokens_match, tiny_model_folder
from test_engine_equivalence import MAX_TOKENS, nested_prompts, reference

from batchllm import LLM, SamplingParams
from batchllm.engine import tensor_parallel

pytestmark = pytest.mark.slow  # the fast lane leaves it out (README: Run the tests)


def run_tp2(kind: str, **settings) -> dict:
    settings.setdefault("kv_cache_memory", 64 << 20)
    llm = LLM(str(tiny_model_folder(kind)), dtype="float32", device="cpu", tensor_parallel=2,
              **settings)
    outs = llm.generate(nested_prompts(), SamplingParams(max_tokens=MAX_TOKENS))
    for i, (out, (tokens, gaps)) in enumerate(zip(outs, reference(kind))):
        assert out.finish_reason in ("stop", "length"), out.error
        assert_tokens_match(out.token_ids, tokens, gaps, row=i)
    return llm.last_metrics


@pytest.mark.parametrize("kind", ["llama3", "qwen3", "gemma2", "mistral"])
@pytest.mark.parametrize("sharing", [True, False])
def test_tp2_greedy_matches_transformers(kind: str, sharing: bool) -> None:
    # mistral: one KV head, replicated on both ranks
    run_tp2(kind, prefix_sharing=sharing)


@pytest.mark.parametrize("kind", ["llama3", "qwen3", "gemma2"])
def test_tp2_chunked_prefill_and_preemption(kind: str) -> None:
    probe = LLM(str(tiny_model_folder(kind)), dtype="float32", device="cpu",
                kv_cache_memory=64 << 20)
    per_token = probe.runtime.engine.bytes_per_token // 2  # a rank holds half the KV heads
    longest = max(map(len, nested_prompts())) + MAX_TOKENS
    pages = -(-longest // 16) + 2
    metrics = run_tp2(kind, kv_cache_memory=pages * 16 * per_token, max_batched_tokens=13)
    assert metrics["kv_pages_total"] == pages
    assert metrics["preemptions"] > 0


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_tp2_moe_greedy_matches_tp1_and_transformers(kind: str) -> None:
    """Each expert's gate/up and down split over the ranks (qwen2_moe: its shared expert too,
    and a dense layer); the same routing on both ranks, one all-reduce per MoE layer. olmoe:
    its q/k norms over all heads, of each rank's slices, the mean squares summed over both."""
    tokens, width = {}, 0
    for n in (1, 2):
        llm = LLM(str(tiny_model_folder(kind)), dtype="float32", device="cpu",
                  tensor_parallel=n, kv_cache_memory=64 << 20, max_batched_tokens=29)
        moe = llm.runtime.loaded.model.layers[0].mlp
        if n == 1:
            width = moe.experts.gate_up[0].out_features
        else:  # every expert on every rank, half of each
            assert moe.inner.experts.num_experts == 4
            assert moe.inner.experts.gate_up[0].out_features == width // 2
        outs = llm.generate(nested_prompts(), SamplingParams(max_tokens=MAX_TOKENS))
        tokens[n] = [out.token_ids for out in outs]
    for i, (tp1, tp2, (ref, gaps)) in enumerate(zip(tokens[1], tokens[2], reference(kind))):
        near_tie = assert_tokens_match(tp1, ref, gaps, row=i)
        near_tie |= assert_tokens_match(tp2, ref, gaps, row=i)
        assert near_tie or tp2 == tp1, f"row {i}: tensor_parallel 2 {tp2} != 1 {tp1}"


def test_tp2_splits_transformers_fused_experts(tmp_path) -> None:
    """A checkpoint in transformers' fused layout (experts.gate_up_proj [E, 2I, H], gate rows
    then up rows; experts.down_proj [E, H, I]): each rank reads its rows of both halves."""
    import shutil

    from safetensors.torch import load_file, save_file

    source = tiny_model_folder("mixtral")
    state = load_file(source / "model.safetensors")
    layers = {int(name.split(".")[2]) for name in state if name.startswith("model.layers.")}
    for i in layers:
        p = f"model.layers.{i}.block_sparse_moe.experts."
        w = {n: [state.pop(f"{p}{e}.{n}.weight") for e in range(4)] for n in ("w1", "w3", "w2")}
        state[p + "gate_up_proj"] = torch.stack([torch.cat(gu) for gu in zip(w["w1"], w["w3"])])
        state[p + "down_proj"] = torch.stack(w["w2"])
    shutil.copytree(source, tmp_path / "fused", ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(state, tmp_path / "fused" / "model.safetensors", metadata={"format": "pt"})
    llm = LLM(str(tmp_path / "fused"), dtype="float32", device="cpu", tensor_parallel=2,
              kv_cache_memory=64 << 20)
    outs = llm.generate(nested_prompts(), SamplingParams(max_tokens=MAX_TOKENS))
    for i, (out, (tokens, gaps)) in enumerate(zip(outs, reference("mixtral"))):
        assert_tokens_match(out.token_ids, tokens, gaps, row=i)


def test_tp_refuses_experts_that_do_not_divide() -> None:
    from hf_reference import _config

    from batchllm.model.errors import ModelError
    from batchllm.model.tensor_parallel import shard_config

    with pytest.raises(ModelError, match="experts' intermediate size 32 and the shared "
                                         "expert's 48 must divide by 3"):
        shard_config(_config("qwen2_moe"), 3)


def test_tp2_a_rank_dying_fails_with_one_line() -> None:
    llm = LLM(str(tiny_model_folder("llama3")), dtype="float32", device="cpu",
              kv_cache_memory=64 << 20, tensor_parallel=2)
    tensor_parallel._current.procs[0].kill()
    with pytest.raises(tensor_parallel.RankFailed, match=r"rank 1 exited with code -9"):
        llm.generate(nested_prompts(), SamplingParams(max_tokens=MAX_TOKENS))


def test_batchllm_run_with_tensor_parallel_2_writes_the_tp1_file(tmp_path) -> None:
    """The command a user runs: the job's process is rank 0 and spawns rank 1; the output's
    completions, finish reasons and token counts are those of tensor_parallel: 1."""
    import pyarrow.parquet as pq
    from job_files import run_cli, tiny_job

    prompts = [f"Question {i}: what does clause {i} of the lease say about rent?" for i in range(8)]
    tables = {}
    for n in (1, 2):
        job = tiny_job(tmp_path, f"tp{n}", "tp", prompts, {"max_tokens": MAX_TOKENS},
                       {"tensor_parallel": n, "kv_cache_memory": "64MiB"})
        proc = run_cli("run", str(job), "--quiet")
        assert proc.returncode == 0, proc.stderr
        tables[n] = pq.read_table(tmp_path / f"tp{n}" / "out.parquet").select(
            ["id", "completion", "finish_reason", "prompt_tokens", "completion_tokens"])
    assert tables[2].equals(tables[1])


# The CLI whose rank 1 is killed (SIGKILL) once rank 0 has written N checkpoint parts: the rank
# dies mid-job, between two steps, and the run carries on until its next collective.
_RANK_DIES_AFTER_PARTS = """
import sys
from batchllm.engine import tensor_parallel
from batchllm.rows.writer import CheckpointWriter
after, write, written = int(sys.argv.pop(1)), CheckpointWriter._write_part, []
def write_then_kill_rank_1(self, rows):
    write(self, rows)
    written.append(len(rows))
    if len(written) == after:
        rank_1 = tensor_parallel._current.procs[0]
        rank_1.kill()
        rank_1.join()
CheckpointWriter._write_part = write_then_kill_rank_1
from batchllm.cli import app
app()
"""


def test_tp2_rank_dying_mid_job_fails_in_one_line_keeps_parts_and_resumes(tmp_path) -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    import pyarrow.parquet as pq
    from job_files import run_cli, tiny_job

    prompts = [f"Clause {i % 5} of lease {i}: who pays the rent in month {i % 12}?"
               for i in range(30)]
    engine = {"kv_cache_memory": "64MiB", "max_num_seqs": 4}
    jobs = {name: tiny_job(tmp_path, name, "tp-dies", prompts, {"max_tokens": MAX_TOKENS},
                           {**engine, "tensor_parallel": n}) for name, n in (("tp1", 1),
                                                                              ("tp2", 2))}
    done = run_cli("run", str(jobs["tp1"]), "--quiet")
    assert done.returncode == 0, done.stderr
    out = tmp_path / "tp2" / "out.parquet"
    cut = subprocess.run([sys.executable, "-c", _RANK_DIES_AFTER_PARTS, "2", "run",
                          str(jobs["tp2"]), "--quiet"], check=False, capture_output=True,
                         text=True, timeout=600, env=dict(os.environ, BATCHLLM_CHECKPOINT_ROWS="6"))
    lines = [line for line in cut.stderr.splitlines() if line.strip()]
    assert cut.returncode != 0 and not out.exists()
    assert len(lines) == 1 and "rank 1 exited with code -9" in lines[0], cut.stderr
    kept = sorted(Path(str(out) + ".parts").glob("part-*.parquet"))
    assert len(kept) >= 2 and sum(pq.read_metadata(p).num_rows for p in kept) < len(prompts)
    resumed = run_cli("run", str(jobs["tp2"]), "--quiet", "--set", "output.mode=resume")
    assert resumed.returncode == 0, resumed.stderr
    columns = ["id", "completion", "finish_reason", "prompt_tokens", "completion_tokens"]
    assert (pq.read_table(out).select(columns)
            .equals(pq.read_table(tmp_path / "tp1" / "out.parquet").select(columns)))


# Rank 0's process SIGKILLs itself once its rank 1 is spawned: "joined", after the group has
# formed (rank 1 waits in a collective); "joining", before rank 0 joins it (rank 1 waits for
# the rendezvous, up to its 600 s timeout, where nothing but its watch on rank 0 ends it).
_RANK_0_KILLED = """
import multiprocessing, os, signal, sys
from batchllm import LLM
from batchllm.engine import tensor_parallel
def die(*args):
    print(*[p.pid for p in multiprocessing.active_children()], flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
if sys.argv[2] == "joining":
    tensor_parallel._init = die
LLM(sys.argv[1], dtype="float32", device="cpu", kv_cache_memory=16 << 20, tensor_parallel=2)
die()
"""


def _running(pid: int) -> bool:
    """Whether pid is a live process (a zombie, exited but not yet reaped, is not)."""
    from pathlib import Path

    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


@pytest.mark.parametrize("when", ["joined", "joining"])
def test_a_rank_exits_when_rank_0_is_killed(when: str) -> None:
    """Rank 0's process SIGKILLed (as Ray kills a worker's actor): rank 1 does not wait on
    (holding its device, on a GPU) until a collective's timeout; it exits."""
    import subprocess
    import sys
    import time

    proc = subprocess.run([sys.executable, "-c", _RANK_0_KILLED,
                           str(tiny_model_folder("llama3")), when], check=False,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr
    (rank_1,) = map(int, proc.stdout.split())
    deadline = time.monotonic() + 60  # a bound on the wait, not a timing: it exits in ~0.5 s
    while _running(rank_1) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(rank_1), f"rank 1 (pid {rank_1}) still runs after rank 0 died"


def test_a_cuda_rank_takes_its_own_device_or_says_which_is_missing() -> None:
    """Each rank's weights on cuda:rank (two ranks on one GPU break NCCL); on the CPU the device
    as asked; a rank beyond the visible GPUs named in one line."""
    from batchllm.model.errors import ModelError
    from batchllm.model.loader import rank_device

    assert rank_device(torch.device("cpu"), 1) == torch.device("cpu")
    if torch.cuda.device_count() > 1:
        assert rank_device(torch.device("cuda"), 1) == torch.device("cuda", 1)
    missing = torch.cuda.device_count()
    with pytest.raises(ModelError, match=f"rank {missing} needs CUDA device {missing}"):
        rank_device(torch.device("cuda"), missing)


def test_a_rank_dying_while_loading_stops_the_start_at_once(monkeypatch) -> None:
    """Rank 1 killed (as the OOM killer would) before the ranks meet: the start stops within
    seconds naming it, where rank 0 waited in the rendezvous for its 600 s timeout."""
    import multiprocessing
    import time

    load = tensor_parallel.load_model

    def rank_1_killed_first(*args, **kwargs):
        for child in multiprocessing.active_children():
            child.kill()
        return load(*args, **kwargs)

    monkeypatch.setattr(tensor_parallel, "load_model", rank_1_killed_first)
    started = time.monotonic()
    with pytest.raises(tensor_parallel.RankFailed,
                       match=r"rank 1 exited with code -9 while loading its shard"):
        LLM(str(tiny_model_folder("llama3")), dtype="float32", device="cpu",
            kv_cache_memory=64 << 20, tensor_parallel=2)
    assert time.monotonic() - started < 120


def test_an_fp8_checkpoint_is_refused_by_tensor_parallel_before_its_weights_load() -> None:
    from fp8_checkpoints import fp8_checkpoint

    from batchllm.model.errors import ModelError

    folder, _ = fp8_checkpoint(tiny_model_folder("llama"))
    with pytest.raises(ModelError, match=r"engine.tensor_parallel: FP8 weights \(model."
                                         r"quantization: fp8, or an FP8 checkpoint\) are not "
                                         r"split yet"):
        LLM(str(folder), dtype="float32", device="cpu", kv_cache_memory=64 << 20,
            tensor_parallel=2)
