"""The bench's workload: the team's contract workload, or a Parquet of chats or prompts, read and
tokenized by batchllm.rows exactly as a job reads and tokenizes its input."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[2]
CONTRACT_SCRIPTS = (REPO / "shared/bench/contract_workload.py",
                    REPO.parent / "shared/bench/contract_workload.py")


@dataclass(frozen=True)
class Workload:
    """The rows the bench runs: prompt token ids (chat template applied) and max_tokens each."""

    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def contract_script() -> Path:
    """shared/bench/contract_workload.py, in the checkout or beside it; SystemExit if neither."""
    script = next((p for p in CONTRACT_SCRIPTS if p.is_file()), None)
    if script is None:
        raise SystemExit("bench: the contract workload script is not at "
                         f"{' or '.join(map(str, CONTRACT_SCRIPTS))}; pass --workload W.parquet")
    return script


def contract_workload(out: Path) -> Path:
    """Write the team's contract workload (64 chat prompts) to `out` with its own script."""
    subprocess.run([sys.executable, str(contract_script()), str(out)], check=True)
    return out


def workload_file(name: Path | None, tmp: Path) -> Path:
    """The Parquet the bench runs: a file given by --workload, or a built-in one written into
    `tmp`: the contract workload (none given) or `short` (benchlib/short_workload.py)."""
    if name is None:
        return contract_workload(tmp / "contract.parquet")
    if str(name) == "short":
        from .short_workload import write_short_workload

        return write_short_workload(tmp / "short.parquet")
    return name


def read_workload(path: Path, tokenizer, rows: int | None, default_max_tokens: int) -> Workload:
    """The first `rows` rows (all: None) of a Parquet with id, messages | prompt, max_tokens.

    Read by batchllm.rows.reader, a `prompt` becomes one user message, each chat goes through the
    model's chat template and the tokenizer without extra special tokens: a job's tokens. A
    Parquet with a `prompt_token_ids` column (scripts/gpu_workloads.py: random-token jobs for
    random-weight models) gives its token ids as they are."""
    if "prompt_token_ids" in pq.read_schema(path).names:
        table = pq.read_table(path).to_pydict()
        keep = range(len(table["prompt_token_ids"]) if rows is None
                     else min(rows, len(table["prompt_token_ids"])))
        limits = table.get("max_tokens") or [None] * len(table["prompt_token_ids"])
        return Workload([list(table["prompt_token_ids"][i]) for i in keep],
                        [int(limits[i] or default_max_tokens) for i in keep])
    from batchllm.config import InputConfig
    from batchllm.rows.prompts import conversation, render_chats, tokenize
    from batchllm.rows.reader import read_input

    chats = "messages" in pq.read_schema(path).names
    read = read_input(InputConfig(path=str(path), messages_column="messages" if chats else None))
    keep = range(read.num_rows if rows is None else min(rows, read.num_rows))
    conversations = [read.messages[i] if chats else conversation(read.prompts[i], None)
                     for i in keep]
    limits = read.overrides.get("max_tokens") or [None] * read.num_rows
    ids = tokenize(tokenizer, render_chats(tokenizer, conversations), add_special_tokens=False)
    return Workload([t.tolist() for t in ids], [int(limits[i] or default_max_tokens) for i in keep])
