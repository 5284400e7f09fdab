"""scripts/gpu_check.sh's one table: every bench run of every model and job, the contract checks
and the issue's goals. Exit 1 on a mismatch.

    python scripts/gpu_table.py MODEL:JOB:RESULTS.json ...

Per step (where the metrics file has them): host ms (step_host_seconds / steps), device ms
(step_device_seconds, CUDA events), replayed/eager steps. A setting that crashed (a note that is
not "skipped") is a failure, named CRASHED.
Mismatches: the batchllm settings of one model and job generating different numbers of tokens
(end-of-sequence is ignored: every row runs to its max_tokens), or prefix sharing on without
prefill_tokens == tree_tokens (each distinct prompt token through the model once). Goals (the
Qwen2.5-0.5B shape, bfloat16): >= 25,000 output tokens/s on the no-sharing job; on the
shared-prefix job >= 5x transformers' generate_batch (continuous batching), in output tokens/s;
on CUDA with graphs on, at least half of the shared-prefix job's steps replayed (every model).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

GOAL_TOKENS_S, GOAL_RATIO = 25_000, 5.0


def per_step(m: dict) -> tuple[str, str, str, str]:
    """steps, host and device ms per step (step_host_seconds; step_device_seconds from CUDA
    events), replayed/eager steps: "-" where the metrics do not have them."""
    steps = m.get("steps")
    if not steps:
        return "-", "-", "-", "-"

    def ms(key: str) -> str:
        return "-" if m.get(key) is None else f"{1000 * m[key] / steps:.3f}"

    replayed = m.get("steps_replayed")
    return (str(steps), ms("step_host_seconds"), ms("step_device_seconds"),
            "-" if replayed is None else f"{replayed}/{steps - replayed}")


def main(argv: list[str]) -> int:
    rows, mismatches, goals = [], [], []
    for spec in argv:
        model, job, path = spec.split(":", 2)
        if not Path(path).is_file():
            mismatches.append(f"{model} {job}: no results ({path}: the run failed or timed out)")
            continue
        data = json.loads(Path(path).read_text())
        results = [r for r in data["results"] if "wall_s" in r]
        for r in data["results"]:
            n = (r.get("metrics") or {}).get("rows") or data["env"].get(
                "hf_rows" if r["setting"].startswith("hf-") else "rows", "")
            rows.append((model, job, n, r))
        for r in data["results"]:
            if "wall_s" not in r and not str(r.get("note", "")).startswith("skipped"):
                mismatches.append(f"{model} {job} {r['setting']}: CRASHED: {r.get('note', '')}")
        ours = [r for r in results if r["setting"].startswith("batchllm")]
        if len({r["output_tokens"] for r in ours}) > 1:
            mismatches.append(f"{model} {job}: batchllm settings generated different token "
                              f"counts: {[(r['setting'], r['output_tokens']) for r in ours]}")
        for r in ours:
            m = r.get("metrics") or {}
            if "-sharing" in r["setting"] and "no-sharing" not in r["setting"] and (
                    m.get("prefill_tokens") != m.get("tree_tokens")):
                mismatches.append(f"{model} {job} {r['setting']}: prefill_tokens "
                                  f"{m.get('prefill_tokens')} != tree_tokens {m.get('tree_tokens')}")
        for r in ours:  # graphs on, on CUDA: most steps replayed (rows admitted in bursts)
            m = r.get("metrics") or {}
            if job == "shared_prefix" and "nographs" not in r["setting"] and m.get(
                    "device", "").startswith("cuda") and m.get("steps"):
                share = m.get("steps_replayed", 0) / m["steps"]
                goals.append(((f"{model} shared-prefix job, {r['setting']}: "
                               f"{m.get('steps_replayed', 0)} of {m['steps']} steps replayed "
                               f"({share:.0%}; goal >= 50%)"), share >= 0.5))
        if model.startswith("qwen2.5-0.5b") and ours:
            best = max(ours, key=lambda r: r["output_tok_s"])
            if job == "no_sharing":
                goals.append(((f"{model} no-sharing job, {best['setting']}: "
                              f"{best['output_tok_s']:,.0f} output tok/s (goal >= "
                              f"{GOAL_TOKENS_S:,})"), best["output_tok_s"] >= GOAL_TOKENS_S))
            hf = next((r for r in results if r["setting"] == "hf-continuous"), None)
            if job == "shared_prefix" and hf:
                ratio = best["output_tok_s"] / hf["output_tok_s"]
                goals.append(((f"{model} shared-prefix job, {best['setting']}: {ratio:.1f}x "
                              f"transformers generate_batch (goal >= {GOAL_RATIO:.0f}x)"),
                              ratio >= GOAL_RATIO))
    head = ("model", "job", "setting", "rows", "wall s", "out tok/s", "total tok/s",
            "prefill/prompt", "kv pages peak", "steps", "host ms/step", "device ms/step",
            "replayed/eager", "note")
    lines = []
    for model, job, n, r in rows:
        if "wall_s" not in r:
            lines.append((model, job, r["setting"], str(n), *["-"] * 9, r.get("note", "")))
            continue
        prefill = r.get("prefill_tokens")
        lines.append((model, job, r["setting"], str(n),
                      f"{r['wall_s']:.1f}", f"{r['output_tok_s']:,.0f}", f"{r['total_tok_s']:,.0f}",
                      "-" if prefill is None else f"{prefill / r['prompt_tokens']:.3f}",
                      str(r.get("kv_pages_peak") or "-"), *per_step(r.get("metrics") or {}),
                      r.get("note", "")))
    widths = [max(len(str(x[i])) for x in [head, *lines]) for i in range(len(head))]
    for line in [head, *lines]:
        print("  ".join(f"{v:<{w}}" for v, w in zip(line, widths)).rstrip())
    for text, met in goals:
        print(f"GOAL {'MET' if met else 'MISSED'}: {text}")
    for text in mismatches:
        print(f"MISMATCH {text}")
    print("=== table: " + (f"{len(mismatches)} MISMATCHES" if mismatches else "no mismatch"))
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
