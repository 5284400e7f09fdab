"""The vLLM setting: vllm_job.py run by the Python of vLLM's own environment, on the bench's token
ids, prefix caching on (vLLM's default)."""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_vllm(python: Path, job: dict) -> dict:
    """vLLM's figures for `job` (model folder, prompts, max_tokens, eos); prefill_tokens: the
    prompt tokens it computed (not taken from its prefix cache)."""
    with tempfile.TemporaryDirectory() as tmp:
        inp, out = Path(tmp) / "in.json", Path(tmp) / "out.json"
        inp.write_text(json.dumps(job))
        subprocess.run([str(python), str(HERE / "vllm_job.py"), str(inp), str(out)], check=True)
        got = json.loads(out.read_text())
    return {"wall_s": got["wall_s"], "output_tokens": got["output_tokens"],
            "prefill_tokens": got["prompt_tokens"] - got["cached_tokens"],
            "token_ids": got["token_ids"], "note": "vLLM offline LLM.generate, prefix caching on"}
