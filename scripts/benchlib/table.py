"""The bench's output: one table of the settings, and the JSON file."""

from __future__ import annotations

import json
from pathlib import Path


def table(results: list[dict]) -> str:
    """One line per setting; ratios against hf-static where it ran."""
    head = ("setting", "wall s", "out tok/s", "total tok/s", "vs hf-static", "prefill/prompt",
            "kv_pages_peak", "note")
    base = next((r for r in results if r["setting"] == "hf-static" and "wall_s" in r), None)
    lines = []
    for r in results:
        if "wall_s" not in r:
            lines.append((r["setting"], "-", "-", "-", "-", "-", "-", r["note"]))
            continue
        ratio = f"{r['output_tok_s'] / base['output_tok_s']:.2f}x" if base else "-"
        prefill = r.get("prefill_tokens")
        pages = r.get("kv_pages_peak")
        lines.append((r["setting"], f"{r['wall_s']:.1f}", f"{r['output_tok_s']:.1f}",
                      f"{r['total_tok_s']:.1f}", ratio,
                      "-" if prefill is None else f"{prefill / r['prompt_tokens']:.3f}",
                      "-" if pages is None else str(pages), r.get("note", "")))
    widths = [max(len(str(x[i])) for x in [head, *lines]) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*x).rstrip() for x in [head, *lines]] + _json_cost(results))


def _json_cost(results: list[dict]) -> list[str]:
    """The structured-output figure: batchllm-json's output tokens/s against batchllm-sharing's."""
    timed = {r["setting"]: r for r in results if "wall_s" in r}
    if not {"batchllm-json", "batchllm-sharing"} <= set(timed):
        return []
    json_run = timed["batchllm-json"]
    ratio = json_run["output_tok_s"] / timed["batchllm-sharing"]["output_tok_s"]
    lines = [(f"structured output (JSON schema on every row): {ratio:.1%} of batchllm-sharing's "
              f"output tok/s (cost {1 - ratio:+.1%}; its rows end with their grammar, so fewer "
              "tokens per step)")]
    if "same_tokens_wall_s" in json_run:  # the same rows and token counts, unconstrained
        cost = json_run["constrained_wall_s"] / json_run["same_tokens_wall_s"] - 1
        lines.append(f"structured output at equal work: {json_run['constrained_wall_s']:.2f} s "
                     f"constrained against {json_run['same_tokens_wall_s']:.2f} s unconstrained "
                     f"for the same {json_run['same_tokens_output_tokens']} output tokens (each "
                     f"row its constrained length; cost {cost:+.1%})")
    return lines


def write_json(path: Path, data: dict) -> None:
    """`data` ({"env", "results", ...}) as indented JSON at `path`, its folder made if needed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str))
