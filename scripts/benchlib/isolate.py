"""Each setting in a fresh process, one after the other, --repeat rounds in alternating order."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from .settings import setting_names


def isolated(args: argparse.Namespace, script: Path, argv: list[str]) -> tuple[list[dict], dict,
                                                                            dict[str, list[dict]]]:
    """Run `script` (the bench) once per setting and round, with the command line `argv` less
    --json and --repeat, plus --only SETTING: no setting inherits another's heap, threads or
    caches. With --repeat N, N rounds in alternating order (A B C D, D C B A, ...), so that a
    machine that drifts slower or faster during the run favours no setting; each setting's
    figures are then the mean over its runs. Returns (the means, the environment, every run)."""
    child_args = [a for a in argv if not a.startswith(("--json=", "--repeat="))]
    for flag in ("--json", "--repeat"):
        if flag in child_args:
            i = child_args.index(flag)
            del child_args[i : i + 2]
    names = setting_names(args)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    env: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.repeat):
            for name in names if round_ % 2 == 0 else names[::-1]:
                out = Path(tmp) / f"{name}-{round_}.json"
                subprocess.run([sys.executable, str(script), *child_args, "--only", name,
                                "--json", str(out)], check=True)
                data = json.loads(out.read_text())
                runs[name] += data["results"]
                env = data["env"]
    env.update(isolated=True, repeat=args.repeat)
    return [mean_of(runs[n]) for n in names], env, runs


def mean_of(runs: list[dict]) -> dict:
    """One setting's runs as one result: mean wall time, tokens/s from it, each wall in the note."""
    timed = [r for r in runs if "wall_s" in r]
    if len(runs) == 1 or not timed:
        return runs[0]
    r = dict(timed[0])
    r["wall_s"] = sum(t["wall_s"] for t in timed) / len(timed)
    r["output_tok_s"] = r["output_tokens"] / r["wall_s"]
    r["total_tok_s"] = (r["prompt_tokens"] + r["output_tokens"]) / r["wall_s"]
    for key in ("constrained_wall_s", "same_tokens_wall_s"):  # batchllm-json's paired runs
        if all(key in t for t in timed):
            r[key] = sum(t[key] for t in timed) / len(timed)
    walls = ", ".join(f"{t['wall_s']:.1f}" for t in timed)
    r["note"] = f"mean of {len(timed)} runs ({walls} s)" + (f"; {r['note']}" if r.get("note")
                                                             else "")
    return r
