"""A bfloat16 checkpoint of a model: its weights rounded to bfloat16 and saved as one, with its
config (dtype bfloat16), tokenizer and templates, so that the benchmark can run the shape most
published checkpoints have (`python scripts/bench.py --model OUT`; the default model is a GGUF
file whose layers dequantize to 16 significant bits, not bfloat16).

  python scripts/bf16_checkpoint.py /tmp/smollm2-bf16 [--model smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from batchllm.model.resolve import resolve_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the folder to write (created)")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    args = parser.parse_args()
    source = resolve_model(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.suffix in (".json", ".jinja", ".txt", ".model") and f.name != "batchllm_cache.json":
            shutil.copy(f, args.out / f.name)
    for shard in sorted(source.glob("*.safetensors")):
        tensors = load_file(shard)
        save_file({k: v.bfloat16().contiguous() for k, v in tensors.items()},
                  args.out / shard.name, metadata={"format": "pt"})
    config_path = args.out / "config.json"
    config = json.loads(config_path.read_text())
    config.pop("torch_dtype", None)
    config["dtype"] = "bfloat16"
    config_path.write_text(json.dumps(config, indent=2))
    print(f"{args.out}: {args.model} in bfloat16")


if __name__ == "__main__":
    main()
