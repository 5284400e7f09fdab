"""Host memory of a model load: the peak resident set while load_model runs, against what the
loaded model holds, in a fresh child process per load.

    python scripts/measure_load_rss.py [--gb 1.0] [--dtype float32] [--saved float32] [--out DIR]

builds (once, under --out) a random Llama of about --gb GB in the --saved dtype with transformers
(fixed seed, save_pretrained, one file: the worst case for a whole-file mapping), then loads it
twice in children (a fresh panel cache, then warm) and prints one JSON line per load:

  baseline_mb  resident set before load_model (imports, config and tokenizer already made)
  after_mb     after it, the model alive;  peak_mb: the highest resident set in between
  held_mb      the bytes of every tensor the model holds (unique storages)
  largest_mb   the largest of them;  checkpoint_mb: the safetensors files' size

The goal (issue 29): peak - baseline <= held + largest + a small constant, and after - baseline
<= held + that constant (tests/test_streaming_load.py asserts both on a smaller model).
`child FOLDER DTYPE` is the measuring child itself.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MB = 1 << 20


def _status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile of this process, in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


def held_tensors(root: object) -> dict[int, int]:
    """Storage address -> bytes of every tensor reachable from `root` through attributes, lists,
    tuples and dicts (each storage once)."""
    import torch

    seen: set[int] = set()
    storages: dict[int, int] = {}
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            s = obj.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
        elif isinstance(obj, (list, tuple, set)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif hasattr(obj, "__dict__") and type(obj).__module__.startswith(
                ("batchllm", "batchllm_kernels")):
            stack.extend(vars(obj).values())
    return storages


def child(folder: str, dtype: str) -> dict:
    """Load `folder` on the CPU as a run does (engine/runtime.py: glibc kept from trimming, then
    load_model) and measure."""
    from batchllm.engine.cpu_allocator import keep_freed_memory
    from batchllm.model import tokenizer
    from batchllm.model.hf_cache import load_config
    from batchllm.model.loader import load_model

    keep_freed_memory()
    load_config(Path(folder))
    tokenizer.load(Path(folder))
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from here
    before = _status()
    loaded = load_model(folder, dtype, "cpu")
    after = _status()
    held = held_tensors(loaded.model)
    files = sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))
    return {"dtype": dtype, "panel_cache": loaded.panel_cache,
            "layout": loaded.model.ops.projection,
            "baseline_mb": before["VmRSS"] / MB, "after_mb": after["VmRSS"] / MB,
            "peak_mb": after["VmHWM"] / MB, "after_file_mb": after["RssFile"] / MB,
            "held_mb": sum(held.values()) / MB, "largest_mb": max(held.values()) / MB,
            "checkpoint_mb": files / MB}


def measure(folder: Path, dtype: str, cache: Path) -> dict:
    """child() in a fresh interpreter whose batchllm cache is `cache`."""
    env = {**os.environ, "BATCHLLM_CACHE": str(cache), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, __file__, "child", str(folder), dtype], env=env,
                         capture_output=True, text=True, check=True, timeout=900)
    return json.loads(out.stdout.strip().splitlines()[-1])


def random_llama(folder: Path, hidden: int, layers: int, vocab: int, saved: str) -> Path:
    """A random Llama (GQA 4:1, MLP 4x hidden, untied) saved by transformers in one file
    (`saved`: its dtype's name), with a tokenizer made offline."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    sys.path.insert(0, str(ROOT / "tests"))
    from hf_reference import offline_tokenizer

    if (folder / "config.json").is_file():
        return folder
    torch.manual_seed(0)
    heads = max(4, hidden // 64)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads // 4,
                         vocab_size=vocab, max_position_embeddings=2048, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, saved))
    model.save_pretrained(folder, max_shard_size="100GB")
    offline_tokenizer(vocab).save_pretrained(folder)
    return folder


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "child":
        print(json.dumps(child(sys.argv[2], sys.argv[3])))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gb", type=float, default=1.0)
    p.add_argument("--dtype", default="float32", help="the run's dtype")
    p.add_argument("--saved", default="float32", help="the checkpoint's dtype")
    p.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "batchllm-rss")
    args = p.parse_args()
    hidden, vocab = 1024, 32000
    per_layer = 29 * hidden * hidden // 2  # values of a layer: q, o h^2; k, v h^2 / 4; MLP 12 h^2
    layers = max(1, round((args.gb * 1e9 / 4 - 2 * vocab * hidden) / per_layer))
    folder = random_llama(args.out / f"llama-{args.gb}gb-{args.saved}", hidden, layers, vocab,
                          args.saved)
    cache = Path(tempfile.mkdtemp(prefix="rss-cache-", dir=args.out))
    for _ in ("cold", "warm"):
        print(json.dumps(measure(folder, args.dtype, cache)))


if __name__ == "__main__":
    main()
