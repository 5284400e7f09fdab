"""The transformers baselines: static batches through `generate`, and transformers' own
continuous batching. Both get the bench's token ids; timed: generation only."""

from __future__ import annotations

import time

import torch


def load_hf_model(folder, device: str, dtype: str = "float32"):
    """The transformers model of `folder` in `dtype`, in eval mode (loading is not timed)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).to(device)
    model.eval()
    return model


def has_continuous_batching(model) -> bool:
    """Whether this transformers has the continuous batching manager."""
    return hasattr(model, "continuous_batching_context_manager")


def _generated(new: list[int], limit: int, eos_ids: set[int] | None) -> int:
    """A row's output tokens: up to its own limit, through its first end-of-sequence token."""
    new = new[:limit]
    if eos_ids:
        for i, tok in enumerate(new):
            if tok in eos_ids:
                return i + 1
    return len(new)


def hf_static(model, prompts: list[list[int]], max_tokens: list[int], pad_id: int,
              batch_size: int, eos_ids: set[int] | None = None) -> dict:
    """transformers generate over fixed batches in input order, left padded, run to the batch's
    largest max_tokens (or until every row of the batch ended, with `eos_ids`); each row counts
    only its own output, up to its max_tokens (and its end-of-sequence token)."""
    device = model.device
    fed = 0
    output_tokens = 0
    stop = {} if eos_ids is None else {"eos_token_id": sorted(eos_ids)}
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
        least = {} if eos_ids is not None else {"min_new_tokens": steps}
        with torch.no_grad():
            out = model.generate(ids.to(device), attention_mask=mask.to(device), do_sample=False,
                                 max_new_tokens=steps, pad_token_id=pad_id, **least, **stop)
        fed += len(batch) * width
        output_tokens += sum(_generated(row[width:].tolist(), m, eos_ids)
                             for row, m in zip(out, limits))
    return {"wall_s": time.perf_counter() - start, "output_tokens": output_tokens,
            "prefill_tokens": fed, "note": f"batch {batch_size}, padded prompt tokens fed"}


def hf_continuous(model, prompts: list[list[int]], max_tokens: list[int], pad_id: int,
                  eos_ids: set[int] | None = None) -> dict:
    """transformers' continuous batching manager (what generate_batch uses), one request per row
    with its own max_new_tokens; end-of-sequence disabled (eos -1) unless `eos_ids` are given."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    page = 32
    cb_config = ContinuousBatchingConfig(page_size=page)
    if model.device.type == "cpu":  # its memory sizing reads the accelerator's free memory
        total = sum(len(p) + m for p, m in zip(prompts, max_tokens, strict=True))
        cb_config = ContinuousBatchingConfig(page_size=page, num_blocks=total // page + len(prompts)
                                             + 8, max_batch_tokens=2048)
    eos = -1 if eos_ids is None else sorted(eos_ids)
    gen = GenerationConfig(do_sample=False, eos_token_id=eos, pad_token_id=pad_id,
                           max_new_tokens=max(max_tokens))
    start = time.perf_counter()
    done: dict[str, list[int]] = {}
    with model.continuous_batching_context_manager(generation_config=gen, warmup=False,
                                                   continuous_batching_config=cb_config) as cb:
        ids = [cb.add_request(p, max_new_tokens=m, eos_token_id=eos)
               for p, m in zip(prompts, max_tokens, strict=True)]
        while len(done) < len(ids):
            result = cb.get_result(timeout=1)
            if result is None and not cb.is_running():
                raise RuntimeError("transformers continuous batching stopped early")
            if result is not None and result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"request {result.request_id}: {result.error}")
                done[result.request_id] = result.generated_tokens
    wall = time.perf_counter() - start
    limit = dict(zip(ids, max_tokens, strict=True))
    return {"wall_s": wall,
            "output_tokens": sum(_generated(list(t), limit[r], eos_ids) for r, t in done.items()),
            "note": f"page {page}, block sharing on (transformers default)"}
