"""The transformers baselines: static batches through `generate`, and transformers' own
continuous batching. Both get the bench's token ids; timed: generation only."""

from __future__ import annotations

import time

import torch


def load_hf_model(folder, device: str):
    """The transformers model of `folder`, float32, in eval mode (loading is not timed)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device)
    model.eval()
    return model


def has_continuous_batching(model) -> bool:
    """Whether this transformers has the continuous batching manager."""
    return hasattr(model, "continuous_batching_context_manager")


def hf_static(model, prompts: list[list[int]], max_tokens: list[int], pad_id: int,
              batch_size: int) -> dict:
    """transformers generate over fixed batches in input order, left padded, run to the batch's
    largest max_tokens; each row counts only its own max_tokens as output."""
    device = model.device
    fed = 0
    start = time.perf_counter()
    for lo in range(0, len(prompts), batch_size):
        batch, limits = prompts[lo:lo + batch_size], max_tokens[lo:lo + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)  # (B, T) left padded
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for r, p in enumerate(batch):
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        steps = max(limits)
        with torch.no_grad():
            model.generate(ids.to(device), attention_mask=mask.to(device), do_sample=False,
                           max_new_tokens=steps, min_new_tokens=steps, pad_token_id=pad_id)
        fed += len(batch) * width
    return {"wall_s": time.perf_counter() - start, "output_tokens": sum(max_tokens),
            "prefill_tokens": fed, "note": f"batch {batch_size}, padded prompt tokens fed"}


def hf_continuous(model, prompts: list[list[int]], max_tokens: list[int], pad_id: int) -> dict:
    """transformers' continuous batching manager (what generate_batch uses), one request per row
    with its own max_new_tokens, end-of-sequence disabled (eos -1)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    page = 32
    cb_config = ContinuousBatchingConfig(page_size=page)
    if model.device.type == "cpu":  # its memory sizing reads the accelerator's free memory
        total = sum(len(p) + m for p, m in zip(prompts, max_tokens, strict=True))
        cb_config = ContinuousBatchingConfig(page_size=page, num_blocks=total // page + len(prompts)
                                             + 8, max_batch_tokens=2048)
    gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=pad_id,
                           max_new_tokens=max(max_tokens))
    start = time.perf_counter()
    done: dict[str, list[int]] = {}
    with model.continuous_batching_context_manager(generation_config=gen, warmup=False,
                                                   continuous_batching_config=cb_config) as cb:
        ids = [cb.add_request(p, max_new_tokens=m, eos_token_id=-1)
               for p, m in zip(prompts, max_tokens, strict=True)]
        while len(done) < len(ids):
            result = cb.get_result(timeout=1)
            if result is None and not cb.is_running():
                raise RuntimeError("transformers continuous batching stopped early")
            if result is not None and result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"request {result.request_id}: {result.error}")
                done[result.request_id] = result.generated_tokens
    return {"wall_s": time.perf_counter() - start,
            "output_tokens": sum(len(t) for t in done.values()),
            "note": f"page {page}, block sharing on (transformers default)"}
