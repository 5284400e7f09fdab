"""The memory plan (model/memory_plan.py, `batchllm plan --memory-only`) of two published
models from their config.json alone (the values as published on the Hub, written here), onto
1x H200, 2x H200 and 8x H100, in bfloat16 with the job defaults: kv_cache_memory 0.9,
max_batched_tokens 8192, max_num_seqs 256, page_size 16. Every figure is worked out by hand in
the comments (GiB = 2^30; H200 = 143166 MiB = 150,120,431,616 B, H100 = 81091 MiB =
85,030,076,416 B: torch's total_memory, 139.81 and 79.19 GiB; runtime 1 GiB = 1,073,741,824).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from job_files import run_in_process

from batchllm.model.errors import ModelError
from batchllm.model.hf_cache import load_config
from batchllm.model.memory_plan import Devices, Settings, alternatives, parse_devices, plan_memory

LLAMA3_70B = {  # meta-llama/Meta-Llama-3-70B-Instruct
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128009, "hidden_act": "silu", "hidden_size": 8192,
    "initializer_range": 0.02, "intermediate_size": 28672, "max_position_embeddings": 8192,
    "model_type": "llama", "num_attention_heads": 64, "num_hidden_layers": 80,
    "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.40.0.dev0", "use_cache": True, "vocab_size": 128256}
MIXTRAL_8X7B = {  # mistralai/Mixtral-8x7B-Instruct-v0.1
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
    "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral",
    "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.36.0.dev0", "use_cache": True, "vocab_size": 32000}


def config_of(tmp_path: Path, values: dict):
    folder = tmp_path / values["model_type"]
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(values))
    return load_config(folder)


def settings(max_model_len: int, **changes) -> Settings:
    base = Settings(dtype_bytes=2, kv_bytes=2, fp8_weights=False, tensor_parallel=1,
                    kv_cache_memory=0.9, max_batched_tokens=8192, max_num_seqs=256,
                    page_size=16, max_model_len=max_model_len)
    return replace(base, **changes)


def test_devices_are_parsed() -> None:
    assert parse_devices("2xH200") == Devices("H200", 2, 143166 << 20)
    assert parse_devices("8xh100") == Devices("H100", 8, 81091 << 20)
    assert parse_devices("H200").count == 1
    assert parse_devices("4x80GiB") == Devices("80GiB", 4, 80 << 30)
    with pytest.raises(ModelError, match="--devices: '3xH99': unknown device 'H99'"):
        parse_devices("3xH99")


def test_llama3_70b(tmp_path: Path) -> None:
    config = config_of(tmp_path, LLAMA3_70B)
    s = settings(8192)
    # Parameters. A layer: q and o 8192 x 8192 = 67,108,864 each; k and v 1024 x 8192 =
    # 8,388,608 each; the MLP 3 x 8192 x 28672 = 704,643,072; two norms 16,384: 855,654,400.
    # 80 layers 68,452,352,000 + embedding and lm_head 2 x 128256 x 8192 = 2,101,346,304 + the
    # final norm 8,192 = 70,553,706,496; bfloat16: 141,107,412,992 B (131.42 GiB).
    # Activations: attention 8192 x (3 x 8192 + (128 + 16) x 128) = 352,321,536, the MLP
    # 8192 x (3 x 8192 + 3 x 28672) = 905,969,664 values, x 2 B = 1,811,939,328, + logits
    # 256 x 128256 x (2 + 4) = 197,001,216: 2,008,940,544.
    # KV per token: 2 x 80 x 8 x 128 x 2 = 327,680 B.
    for devices in (parse_devices("1xH200"), parse_devices("2xH200")):  # tp 1: per device alike
        p = plan_memory(config, devices, s)
        assert (p.parameters, p.weights, p.activations) == (
            70_553_706_496, 141_107_412_992, 2_008_940_544)
        # left: 150,120,431,616 - 141,107,412,992 - 2,008,940,544 - 1,073,741,824 =
        # 5,930,336,256; pool 0.9 x = 5,337,302,630; pages 5,337,302,630 // (327,680 x 16) =
        # 1018: 16,288 tokens; a row of 8192 takes 512 pages: 1 row. It fits, barely: the
        # 70B's 131.4 GiB of weights leave ~5 GiB of KV on an H200's 139.8.
        assert (p.left, p.kv_pool, p.kv_per_token) == (5_930_336_256, 5_337_302_630, 327_680)
        assert (p.kv_tokens, p.rows_at_max_len, p.fits) == (16_288, 1, True)
        alt = alternatives(config, devices, s)
        # fp8 KV: 163,840 B a token, 2036 pages, 32,576 tokens, 3 rows.
        assert (alt["fp8 KV cache"].kv_tokens, alt["fp8 KV cache"].rows_at_max_len) == (
            32_576, 3)
        # fp8 weights: the projections 68,451,041,280 values at 1 B + embedding, lm_head and
        # norms 2,102,665,216 at 2 B = 72,656,371,712; left 74,381,377,536, pool
        # 66,943,239,782, 12,768 pages: 204,288 tokens, 24 rows.
        fp8 = alt["fp8 weights"]
        assert (fp8.weights, fp8.kv_tokens, fp8.rows_at_max_len) == (72_656_371_712, 204_288, 24)
        assert "tensor_parallel 2" not in alt  # it fits: no wider split asked for
    h100 = parse_devices("8xH100")
    p = plan_memory(config, h100, s)
    # 141.1 GB of weights > 85.0 GB: nothing left, no pool.
    assert (p.left, p.kv_pool, p.kv_tokens, p.fits) == (0, 0, 0, False)
    wider = alternatives(config, h100, s)["tensor_parallel 2"]
    # tp 2: every projection and the vocabulary halved, norms whole: 70,555,025,408 B;
    # activations 8192 x (3 x 8192 + 3 x 14336) x 2 = 1,107,296,256 + logits 197,001,216 =
    # 1,304,297,472; left 85,030,076,416 - 70,555,025,408 - 1,304,297,472 - 1,073,741,824 =
    # 12,097,011,712, pool 10,887,310,540; 4 KV heads a rank: 163,840 B a token, 4153 pages,
    # 66,448 tokens, 8 rows.
    assert (wider.weights, wider.activations, wider.left) == (
        70_555_025_408, 1_304_297_472, 12_097_011_712)
    assert (wider.kv_per_token, wider.kv_tokens, wider.rows_at_max_len) == (163_840, 66_448, 8)


def test_mixtral_8x7b(tmp_path: Path) -> None:
    config = config_of(tmp_path, MIXTRAL_8X7B)
    s = settings(32768)
    # A layer: q, o 4096 x 4096 = 16,777,216 each; k, v 1024 x 4096 = 4,194,304 each; 8
    # experts x 3 x 4096 x 14336 = 1,409,286,144; router 8 x 4096 = 32,768; norms 8,192:
    # 1,451,270,144. 32 layers 46,440,644,608 + embedding and lm_head 2 x 32000 x 4096 =
    # 262,144,000 + 4,096 = 46,702,792,704; bfloat16 93,405,585,408 B (86.99 GiB).
    # Activations: attention 8192 x (12288 + 80 x 128) = 184,549,376; experts 8192 x 12288 +
    # 16384 x (8192 + 43008) + 8192 x 8 = 939,589,632 values, x 2 = 1,879,179,264, + logits
    # 256 x 32000 x 6 = 49,152,000: 1,928,331,264. KV: 2 x 32 x 8 x 128 x 2 = 131,072 B.
    for devices in (parse_devices("1xH200"), parse_devices("2xH200")):
        p = plan_memory(config, devices, s)
        assert (p.parameters, p.weights, p.activations, p.kv_per_token) == (
            46_702_792_704, 93_405_585_408, 1_928_331_264, 131_072)
        # left 150,120,431,616 - 93,405,585,408 - 1,928,331,264 - 1,073,741,824 =
        # 53,712,773,120; pool 48,341,495,808; 23,051 pages: 368,816 tokens; a row of 32768
        # takes 2048 pages: 11 rows.
        assert (p.left, p.kv_tokens, p.rows_at_max_len, p.fits) == (
            53_712_773_120, 368_816, 11, True)
        # fp8 KV: 46,102 pages, 737,632 tokens, 22 rows.
        assert alternatives(config, devices, s)["fp8 KV cache"].kv_tokens == 737_632
    h100 = parse_devices("8xH100")
    assert not plan_memory(config, h100, s).fits  # 93.4 GB of weights > 85.0 GB
    alt = alternatives(config, h100, s)
    # fp8 weights on one H100: 46,439,333,888 projection values at 1 B + (262,410,240 +
    # 1,048,576 routers) x 2 = 46,966,251,520; left 35,061,751,808, pool 31,555,576,627,
    # 15,046 pages: 240,736 tokens, 7 rows.
    fp8 = alt["fp8 weights"]
    assert (fp8.weights, fp8.kv_tokens, fp8.rows_at_max_len) == (46_966_251_520, 240_736, 7)
    # tp 2: 46,704,107,520 B (routers and norms whole); activations 8192 x 12288 + 16384 x
    # (8192 + 21504) + 65,536 = 587,268,096 values x 2 + 49,152,000 = 1,223,688,192; left
    # 36,028,538,880, pool 32,425,684,992; 65,536 B a token: 30,923 pages, 494,768 tokens,
    # 15 rows.
    wider = alt["tensor_parallel 2"]
    assert (wider.weights, wider.activations, wider.left) == (
        46_704_107_520, 1_223_688_192, 36_028_538_880)
    assert (wider.kv_tokens, wider.rows_at_max_len) == (494_768, 15)


def config_only_job(tmp_path: Path, config: dict) -> Path:
    """A job whose model folder holds config.json alone, and whose input does not exist."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps({"model": {"path": str(folder)},
                               "input": {"path": str(tmp_path / "absent.parquet")},
                               "output": {"path": str(tmp_path / "out.parquet")},
                               "sampling": {"max_tokens": 64}}))
    return job


def memory_only(job: Path, devices: str) -> dict[str, str]:
    """`batchllm plan JOB --memory-only --devices DEVICES`, its lines as a dict."""
    proc = run_in_process("plan", str(job), "--memory-only", "--devices", devices)
    assert proc.returncode == 0, proc.stderr
    return dict(line.split(None, 1) for line in proc.stdout.strip().splitlines())


def test_plan_memory_only_needs_just_config_json(tmp_path: Path) -> None:
    job = config_only_job(tmp_path, LLAMA3_70B)
    report = memory_only(job, "8xH100")
    assert report["model_family"] == "llama"
    assert report["devices"].startswith("8x H100, 79.19 GiB each; tensor_parallel 1, 8 copies")
    assert report["weights"] == "131.42 GiB (70.55 B parameters in all)"
    assert report["kv_bytes_per_token"] == "327680"
    assert report["kv_bytes_per_token_is"] == "2 x 80 layers x 8 KV heads x 128 x 2 bytes"
    assert report["fits"].startswith("no: the weights (131.42 GiB)")
    # 8 devices: tp 2 needs no more than there are
    assert report["with_tensor_parallel_2"] == "65.71 GiB weights, 66448 tokens, 8 rows at once"
    bad = run_in_process("plan", str(job), "--memory-only", "--devices", "3xH99")
    assert bad.returncode == 2 and "--devices: '3xH99': unknown device" in bad.stderr


def test_an_fp8_checkpoints_plan_counts_its_fp8_projections(tmp_path: Path) -> None:
    """A checkpoint whose config.json says its projections are FP8 (llm-compressor's
    compressed-tensors) is planned as it loads: fp8 weights, 67.67 GiB (72,656,371,712 B, as
    test_llama3_70b's alternative), not the model dtype's 131.42 GiB."""
    fp8 = {**LLAMA3_70B, "quantization_config": {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}}},
        "ignore": ["lm_head"]}}
    report = memory_only(config_only_job(tmp_path, fp8), "1xH200")
    assert "; fp8 weights, bfloat16 KV cache" in report["devices"]
    assert report["weights"] == "67.67 GiB (70.55 B parameters in all)"
