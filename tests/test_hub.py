"""Sharded checkpoints and hub ids (model/shards.py, model/hub.py, model/resolve.py).

A tiny random Qwen2 (biases, an untied lm_head) saved by transformers in 4 MB shards with its
index, beside a consolidated.safetensors of other tensor names (as Mistral's repositories ship
one): the index decides what is read, and the folder gives transformers' greedy tokens. The
same files in a Hugging Face cache layout (models--org--name/blobs, snapshots/<commit>/ links,
refs/main) as huggingface_hub's cache (its constants patched: HF_HOME is read at its import),
offline: `batchllm run` with model.path org/name gives
the plain folder's tokens; revisions by commit and by tag; what is missing is named.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hf_reference import assert_tokens_match, hf_greedy_reference, hf_model, tiny_model_folder
from job_files import run_in_process
from safetensors.torch import save_file
from test_engine_equivalence import MAX_TOKENS, nested_prompts

from batchllm import LLM, SamplingParams
from batchllm.model import hub
from batchllm.model.errors import ModelNotFoundError
from batchllm.model.resolve import resolve_model
from batchllm.model.shards import INDEX, tensor_files, weight_files
from batchllm.model.weights import load_weights

REPO, COMMIT = "acme/tiny-qwen2", "0123456789abcdef0123456789abcdef01234567"
PROMPTS = ["The parties agree that", "Who pays the fees?", "The parties agree that the term",
           "Notice must be given"]


@functools.cache
def sharded_folder() -> Path:
    """The tiny Qwen2 saved by transformers in shards of at most 4 MB, its tokenizer and
    generation config, and a consolidated.safetensors that no load may read."""
    source = tiny_model_folder("qwen2")
    root = Path(tempfile.mkdtemp(prefix="batchllm-sharded-"))
    atexit.register(shutil.rmtree, root, True)
    folder = root / "tiny-qwen2"
    hf_model(source).save_pretrained(folder, max_shard_size="4MB")
    for f in source.iterdir():
        if not f.name.endswith(".safetensors") and not (folder / f.name).exists():
            shutil.copy(f, folder / f.name)
    save_file({"tok_embeddings.weight": torch.zeros(8, 4), "layers.0.attention.wq.weight":
               torch.zeros(4, 4)}, folder / "consolidated.safetensors")
    return folder


def hub_cache(hf_home: Path, folder: Path, repo: str = REPO, commit: str = COMMIT,
              tags: tuple[str, ...] = (), skip: tuple[str, ...] = ()) -> Path:
    """`folder`'s files in huggingface_hub's cache layout under hf_home/hub, as a download
    leaves them: blobs named by their digest, the snapshot's files links to them, refs/main
    (and refs/<tag>) holding the commit. Files named in `skip` are left out."""
    repo_dir = hf_home / "hub" / ("models--" + repo.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / commit
    (repo_dir / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in sorted(folder.iterdir()):
        if f.name in skip or f.name == "consolidated.safetensors":  # a download would skip it
            continue
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy(f, repo_dir / "blobs" / digest)
        (snapshot / f.name).symlink_to(Path("../../blobs") / digest)
    (repo_dir / "refs").mkdir(exist_ok=True)
    for ref in ("main", *tags):
        (repo_dir / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def offline_cache(tmp_path: Path, monkeypatch) -> Path:
    """HF_HOME's hub cache at tmp_path/hub, offline, for this process's huggingface_hub."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub.hub_folder.cache_clear()
    yield tmp_path
    hub.hub_folder.cache_clear()


def test_the_index_decides_which_files_are_read() -> None:
    folder = sharded_folder()
    shards = sorted(folder.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 3 and (folder / INDEX).is_file()
    assert weight_files(folder) == shards  # not consolidated.safetensors
    assert set(tensor_files(folder).values()) == set(shards)
    _, state = load_weights(folder, torch.float32, "cpu")
    reference = hf_model(folder).state_dict()
    assert sorted(state) == sorted(reference)
    for name, tensor in state.items():
        assert torch.equal(tensor, reference[name]), name


def test_a_sharded_folder_gives_transformers_tokens() -> None:
    folder, prompts = sharded_folder(), nested_prompts()
    outs = LLM(str(folder), dtype="float32", device="cpu", kv_cache_memory=32 << 20).generate(
        prompts, SamplingParams(max_tokens=MAX_TOKENS))
    reference = hf_greedy_reference(folder, prompts, MAX_TOKENS)
    for i, (out, (tokens, gaps)) in enumerate(zip(outs, reference, strict=True)):
        assert_tokens_match(out.token_ids, tokens, gaps, row=i)


def test_a_missing_shard_is_named(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    shutil.copytree(sharded_folder(), folder)
    lost = sorted(folder.glob("model-*.safetensors"))[1]
    lost.unlink()
    with pytest.raises(ModelNotFoundError, match=f"{INDEX} names {lost.name}, missing from"):
        resolve_model(str(folder))


def test_hub_ids_resolve_from_the_cache_offline(offline_cache: Path) -> None:
    snapshot = hub_cache(offline_cache, sharded_folder(), tags=("v1",))
    assert resolve_model(REPO) == snapshot
    assert resolve_model(REPO, revision=COMMIT) == snapshot
    assert resolve_model(REPO, revision="v1") == snapshot
    assert resolve_model(REPO, config_only=True) == snapshot
    assert weight_files(snapshot) == sorted(snapshot.glob("model-*.safetensors"))


def test_a_missing_hub_model_names_what_and_where(offline_cache: Path) -> None:
    hub_cache(offline_cache, sharded_folder())
    cache = offline_cache / "hub"
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model("acme/no-such-model")
    assert str(err.value) == (
        f"model.path: acme/no-such-model (revision main): not in the cache; looked for "
        f"config.json, the tokenizer and the weights in the Hugging Face cache {cache} "
        f"(HF_HUB_OFFLINE is set: no download); no local folder acme/no-such-model either")
    with pytest.raises(ModelNotFoundError, match=r"acme/tiny-qwen2 \(revision v9\): not in the "
                                                 "cache"):
        resolve_model(REPO, revision="v9")


def test_an_incomplete_snapshot_names_the_missing_shard(offline_cache: Path) -> None:
    lost = min(sharded_folder().glob("model-*.safetensors")).name
    hub_cache(offline_cache, sharded_folder(), skip=(lost,))
    with pytest.raises(ModelNotFoundError, match=f"{INDEX} names {lost}, missing from"):
        resolve_model(REPO)


def test_a_revision_is_refused_for_a_local_folder() -> None:
    with pytest.raises(ModelNotFoundError, match="model.revision: main: only a hub id"):
        resolve_model(str(sharded_folder()), revision="main")


def _job(tmp: Path, name: str, model: str, **model_fields) -> Path:
    data = tmp / "in.parquet"
    if not data.exists():
        pq.write_table(pa.table({"prompt": PROMPTS}), data)
    job = {"name": name, "model": {"path": model, "device": "cpu", **model_fields},
           "input": {"path": str(data), "chat_template": False},
           "output": {"path": str(tmp / name / "out.parquet"), "include_token_ids": True},
           "sampling": {"max_tokens": 12}, "engine": {"kv_cache_memory": "32MiB"}}
    path = tmp / f"{name}.yaml"
    path.write_text(json.dumps(job))
    return path


def _run(job: Path) -> subprocess.CompletedProcess:
    """`batchllm run JOB --quiet` in this process (job_files.run_in_process), huggingface_hub's
    cache and offline flag as the offline_cache fixture set them."""
    return run_in_process("run", str(job), "--quiet")


def test_a_hub_id_runs_offline_with_the_plain_folders_tokens(offline_cache: Path) -> None:
    tmp = offline_cache
    hub_cache(tmp, sharded_folder())
    plain = _run(_job(tmp, "plain", str(sharded_folder())))
    by_id = _run(_job(tmp, "hub", REPO, revision=COMMIT))
    assert plain.returncode == 0 and by_id.returncode == 0, plain.stderr + by_id.stderr
    tokens = [pq.read_table(tmp / n / "out.parquet").column("token_ids").to_pylist()
              for n in ("plain", "hub")]
    assert tokens[0] == tokens[1] and all(len(t) > 0 for t in tokens[0])
    missing = _run(_job(tmp, "missing", "acme/no-such-model"))
    assert missing.returncode == 2
    assert missing.stderr.strip() == (
        f"batchllm: error: model.path: acme/no-such-model (revision main): not in the cache; "
        f"looked for config.json, the tokenizer and the weights in the Hugging Face cache "
        f"{tmp / 'hub'} (HF_HUB_OFFLINE is set: no download); no local folder "
        f"acme/no-such-model either")
