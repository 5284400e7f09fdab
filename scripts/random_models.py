"""Random-weight models shaped like real ones, built with transformers from their configs (no hub,
no internet), for scripts/gpu_check.sh's speed and correctness runs.

    python scripts/random_models.py OUT_DIR [--models qwen2.5-0.5b,llama-3.2-1b,llama-3.1-8b]
                                    [--device cuda]

Each becomes OUT_DIR/NAME: config, safetensors (bfloat16), generation config and a tokenizer made
offline (one word per token id: the jobs are token ids, the text only decodes). Initialised as
transformers does, then the final norm x8 so that greedy logits have a spread (few exact ties).
`llama-3.1-8b` keeps the 8B's real widths (hidden 4,096, MLP 14,336, 32/8 heads, vocabulary
128,256) in 4 of its 32 layers: the per-layer kernels and the lm_head at their real size, in a
fraction of the check's time. `tiny`: a 2-layer model for a smoke run on the CPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from hf_reference import offline_tokenizer


def _llama3_rope(factor: float) -> dict:
    return {"rope_type": "llama3", "rope_theta": 500000.0, "factor": factor,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}


# The public configs' shapes (max_position_embeddings cut to 8192: the jobs need ~2,000).
SHAPES: dict[str, dict] = {
    "qwen2.5-0.5b": {"model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 24,
                         "num_attention_heads": 14, "num_key_value_heads": 2, "intermediate_size": 4864,
                         "vocab_size": 151936, "tie_word_embeddings": True, "rms_norm_eps": 1e-6,
                         "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
    "llama-3.2-1b": {"model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 16,
                         "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 8192,
                         "vocab_size": 128256, "tie_word_embeddings": True, "rms_norm_eps": 1e-5,
                         "head_dim": 64, "rope_parameters": _llama3_rope(32.0)},
    "llama-3.1-8b": {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 4,
                         "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
                         "vocab_size": 128256, "tie_word_embeddings": False, "rms_norm_eps": 1e-5,
                         "rope_parameters": _llama3_rope(8.0)},
    "tiny": {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 4096,
                 "tie_word_embeddings": True, "rms_norm_eps": 1e-5,
                 "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
}
BOS, EOS = 1, 2  # as offline_tokenizer's t1, t2


def build(name: str, out: Path, device: str) -> Path:
    """OUT/NAME, made unless it is there already."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    folder = out / name
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return folder
    shape = dict(SHAPES[name])
    config = AutoConfig.for_model(shape.pop("model_type"), **shape, max_position_embeddings=8192,
                                  bos_token_id=BOS, eos_token_id=EOS, pad_token_id=EOS)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        model.model.norm.weight.mul_(8.0)
    model.save_pretrained(folder)
    GenerationConfig(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=EOS).save_pretrained(folder)
    offline_tokenizer(config.vocab_size).save_pretrained(folder)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--models", default="qwen2.5-0.5b,llama-3.2-1b,llama-3.1-8b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    for name in args.models.split(","):
        start = time.perf_counter()
        folder = build(name, args.out, args.device)
        print(f"{name}: {folder} ({time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
