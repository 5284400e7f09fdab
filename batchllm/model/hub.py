"""Hub ids (model.path: org/name, model.revision: a branch, tag or commit) resolved through
huggingface_hub's own cache ($HF_HOME/hub: models--org--name/snapshots/<commit>/, refs/<branch>):
only the files the engine reads are fetched — config, tokenizer and chat template, the
safetensors index, then the shards it names (or model.safetensors) — from the local cache when
HF_HUB_OFFLINE is set or the Hub cannot be reached, downloaded otherwise."""

from __future__ import annotations

import functools
import re
from pathlib import Path

from batchllm.model.errors import ModelNotFoundError
from batchllm.model.shards import INDEX, SINGLE, weight_map

SMALL_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "tokenizer.model", "special_tokens_map.json", "added_tokens.json",
               "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", INDEX]
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def is_hub_id(path: str) -> bool:
    """Whether `path` has the form of a Hub repository id, org/name."""
    return _HUB_ID.fullmatch(path) is not None and ".." not in path


@functools.cache
def hub_folder(repo_id: str, revision: str | None = None, config_only: bool = False) -> Path:
    """The snapshot folder of `repo_id` at `revision` (default: main) holding the files a run
    reads (only config.json where `config_only`), fetched where missing unless offline.
    Resolved once a process."""
    from huggingface_hub import constants, snapshot_download

    kwargs = {"revision": revision, "cache_dir": constants.HF_HUB_CACHE,
              "local_files_only": bool(constants.HF_HUB_OFFLINE)}
    try:
        folder = Path(snapshot_download(
            repo_id, allow_patterns=["config.json"] if config_only else SMALL_FILES, **kwargs))
        if config_only:
            return folder
        kwargs["revision"] = folder.name  # the commit just resolved, should the branch move
        names = weight_map(folder)
        shards = sorted(set(names.values())) if names is not None else [SINGLE]
        if all((folder / s).is_file() for s in shards):  # a commit's files never change
            return folder
        folder = Path(snapshot_download(repo_id, allow_patterns=shards, **kwargs))
        if names is None and not (folder / SINGLE).is_file():  # weights under another name
            folder = Path(snapshot_download(repo_id, allow_patterns=["*.safetensors"], **kwargs))
    except (OSError, ValueError) as e:  # huggingface_hub's errors (HFValidationError: a ValueError)
        raise ModelNotFoundError(_not_found(repo_id, revision, config_only, e,
                                             constants)) from e
    return folder


def _not_found(repo_id: str, revision: str | None, config_only: bool, error: Exception,
               constants) -> str:
    """What was looked for, where, and why it was not found, in one line."""
    from huggingface_hub import errors

    offline = bool(constants.HF_HUB_OFFLINE)
    if isinstance(error, errors.GatedRepoError):
        why = "a gated repository: accept its terms on the Hub and log in (hf auth login)"
    elif isinstance(error, errors.RepositoryNotFoundError):
        why = "no such repository on the Hugging Face Hub (or a private one: log in)"
    elif isinstance(error, errors.RevisionNotFoundError):
        why = f"the repository has no revision {revision!r}"
    elif isinstance(error, getattr(errors, "IncompleteSnapshotError", ())):
        why = "the cached copy is incomplete"
    elif isinstance(error, errors.LocalEntryNotFoundError):
        why = "not in the cache" if offline else "the Hub could not be reached, not in the cache"
    else:
        why = " ".join(str(error).split())
    files = "config.json" if config_only else "config.json, the tokenizer and the weights"
    where = f"the Hugging Face cache {constants.HF_HUB_CACHE}"
    where += " (HF_HUB_OFFLINE is set: no download)" if offline else f" and {constants.ENDPOINT}"
    return (f"model.path: {repo_id} (revision {revision or 'main'}): {why}; looked for {files} "
            f"in {where}; no local folder {repo_id} either")
