"""Benchmark: batchllm against transformers baselines, same model, data and machine, one run.

    python scripts/bench.py                       # the contract workload (64 chat prompts)
    python scripts/bench.py --rows 8 --skip-hf    # quick run
    python scripts/bench.py --workload W.parquet --json out/bench.json
    python scripts/bench.py --repeat 2 --skip-hf-continuous   # A B C, C B A: drift cancels

Settings: hf-static (transformers `generate`, batches of 8, left padding: the seed's static
batching), hf-continuous (transformers' own continuous batching, where installed), batchllm with
prefix sharing on and off. All greedy, end-of-sequence ignored, so every row yields exactly its
max_tokens. Timed: generation only (model loading and tokenization for the baselines excluded;
batchllm's generate includes its planning). Each setting runs in a fresh process, one after the
other, so that none inherits another's heap or threads (--in-process: all in this one).

Figures are only meaningful on an otherwise idle machine: with other processes on the cores,
torch's OpenMP threads spin-wait and a 2-thread run can get 3-5x slower (the script warns when the
load average exceeds the core count; OMP_WAIT_POLICY=PASSIVE softens it, --threads 1 too).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from batchllm.model.weights import load_tokenizer, resolve_model

REPO = Path(__file__).resolve().parents[1]
CONTRACT_SCRIPTS = (REPO / "shared/bench/contract_workload.py",
                    REPO.parent / "shared/bench/contract_workload.py")


def contract_workload(out: Path) -> Path:
    """Write the team's contract workload (64 chat prompts) to `out`: with its own script when
    the checkout has it, else with the copy below."""
    script = next((p for p in CONTRACT_SCRIPTS if p.is_file()), None)
    if script is not None:
        subprocess.run([sys.executable, str(script), str(out)], check=True)
    else:
        pq.write_table(_contract_table(), out)
    return out


def _contract_table() -> pa.Table:
    """Same rows as shared/bench/contract_workload.py (keep the two identical)."""
    template = (
        'MASTER SERVICES AGREEMENT. This Master Services Agreement (the "Agreement") is entered '
        "into as of the Effective Date by and between the Provider and the Client (each a "
        '"Party" and together the "Parties"). 1. DEFINITIONS. "Confidential Information" means '
        "any non-public information disclosed by one Party to the other, whether orally or in "
        "writing, that is designated as confidential or that reasonably should be understood to "
        "be confidential given the nature of the information and the circumstances of "
        "disclosure. 2. SERVICES. Provider shall perform the services described in each "
        'Statement of Work executed by the Parties (the "Services"). 3. PAYMENT. Client shall '
        "pay all undisputed invoices within thirty (30) days of receipt. Late payments shall "
        "accrue interest at the lesser of one percent (1%) per month or the maximum rate "
        "permitted by law. 4. TERM AND TERMINATION. This Agreement commences on the Effective "
        "Date and continues for a period of three (3) years unless terminated earlier. Either "
        "Party may terminate this Agreement for material breach upon thirty (30) days written "
        "notice if the breach remains uncured. 5. CONFIDENTIALITY. Each Party shall protect the "
        "Confidential Information of the other Party using at least the same degree of care it "
        "uses to protect its own confidential information, but in no event less than reasonable "
        "care. 6. LIMITATION OF LIABILITY. Except for breaches of confidentiality or "
        "indemnification obligations, neither Party shall be liable for any indirect, "
        "incidental, special or consequential damages, and each Party's total liability shall "
        "not exceed the Fees paid in the twelve (12) months preceding the claim. 7. GOVERNING "
        "LAW. This Agreement is governed by the laws of the State of Delaware, without regard to "
        "its conflict of laws principles. You are a careful legal assistant. Answer questions "
        "about this agreement briefly and precisely."
    )
    subjects = ["a software vendor", "a hospital", "a bakery", "a law firm", "a university",
                "a trucking company", "a game studio", "a bank", "a farm cooperative",
                "a shipping line", "a museum", "a hotel chain"]
    asks = [("How many days does the Client have to pay an invoice, and what happens if it pays "
             "late?"),
            "Can the Provider terminate the agreement early, and what notice is required?",
            "Which state's law governs this agreement and why does that matter?",
            "What is the cap on liability and which claims are excluded from it?",
            "Summarize the confidentiality obligation in one sentence.",
            "What standard of care applies to Confidential Information?"]
    rng = random.Random(0)
    messages, max_tokens = [], []
    for i in range(64):
        q = f"Request {i}: I represent {subjects[i % len(subjects)]}. {asks[(i * 5) % len(asks)]}"
        messages.append([{"role": "system", "content": template}, {"role": "user", "content": q}])
        max_tokens.append(rng.randint(16, 128))
    return pa.table({"id": list(range(64)), "messages": messages,
                     "max_tokens": pa.array(max_tokens, pa.int32())})


def read_workload(path: Path, rows: int | None, default_max_tokens: int) -> list[dict]:
    """Rows of {id, messages, max_tokens}; a `prompt` column becomes one user message."""
    table = pq.read_table(path)
    if rows is not None:
        table = table.slice(0, rows)
    data = table.to_pylist()
    out = []
    for i, row in enumerate(data):
        messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
        out.append({"id": row.get("id", i), "messages": messages,
                    "max_tokens": int(row.get("max_tokens") or default_max_tokens)})
    return out


def render(tokenizer, rows: list[dict]) -> list[list[int]]:
    """Token ids of each row's chat, rendered with the generation prompt (as apply_chat_template
    with tokenize=True: no extra special tokens)."""
    ids = []
    for row in rows:
        text = tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True,
                                             tokenize=False)
        ids.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return ids


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


def run_batchllm(settings: dict) -> dict:
    """batchllm.LLM(model, **engine_kwargs).generate(prompt token ids, per-row SamplingParams):
    the same token ids the baselines get."""
    import batchllm

    llm = batchllm.LLM(settings["model"], **settings["engine_kwargs"])
    params = [batchllm.SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
              for m in settings["max_tokens"]]
    start = time.perf_counter()
    outs = llm.generate(settings["prompts"], params)
    wall = time.perf_counter() - start
    metrics = dict(getattr(llm, "last_metrics", None) or {})
    prompt_tokens = sum(o.prompt_tokens for o in outs)
    note = ""
    if prompt_tokens != settings["prompt_tokens"]:
        note = f"prompt tokens differ: batchllm {prompt_tokens}, bench {settings['prompt_tokens']}"
    return {"wall_s": wall, "output_tokens": sum(len(o.token_ids) for o in outs),
            "prefill_tokens": metrics.get("prefill_tokens"),
            "kv_pages_peak": metrics.get("kv_pages_peak"), "note": note, "metrics": metrics}


def table(results: list[dict]) -> str:
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
    return "\n".join(fmt.format(*x).rstrip() for x in [head, *lines])


SETTINGS = ("hf-static", "hf-continuous", "batchllm-sharing", "batchllm-no-sharing")


def isolated(args: argparse.Namespace) -> None:
    """Each setting in its own process, one after the other (same machine, same data): no setting
    inherits another's heap, threads or caches. With --repeat N, N rounds in alternating order
    (A B C D, D C B A, ...), so that a machine that drifts slower or faster during the run
    favours no setting; each setting's figures are then the mean over its runs. Prints one table
    of all of them."""
    skipped = {"hf-static": args.skip_hf or args.skip_hf_static,
               "hf-continuous": args.skip_hf or args.skip_hf_continuous,
               "batchllm-sharing": args.skip_batchllm, "batchllm-no-sharing": args.skip_batchllm}
    child_args = [a for a in sys.argv[1:] if not a.startswith(("--json=", "--repeat="))]
    for flag in ("--json", "--repeat"):
        if flag in child_args:
            i = child_args.index(flag)
            del child_args[i : i + 2]
    names = [n for n in SETTINGS if not skipped[n]]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    env = {}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.repeat):
            for name in names if round_ % 2 == 0 else names[::-1]:
                out = Path(tmp) / f"{name}-{round_}.json"
                subprocess.run([sys.executable, __file__, *child_args, "--only", name, "--json",
                                str(out)], check=True)
                data = json.loads(out.read_text())
                runs[name] += data["results"]
                env = data["env"]
    results = [_mean_of(runs[n]) for n in names]
    print(table(results))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        env.update(isolated=True, repeat=args.repeat)
        args.json.write_text(json.dumps({"env": env, "results": results, "runs": runs},
                                        indent=1, default=str))


def _mean_of(runs: list[dict]) -> dict:
    """One setting's runs as one result: mean wall time, tokens/s from it, each wall in the note."""
    timed = [r for r in runs if "wall_s" in r]
    if len(runs) == 1 or not timed:
        return runs[0]
    r = dict(timed[0])
    r["wall_s"] = sum(t["wall_s"] for t in timed) / len(timed)
    r["output_tok_s"] = r["output_tokens"] / r["wall_s"]
    r["total_tok_s"] = (r["prompt_tokens"] + r["output_tokens"]) / r["wall_s"]
    walls = ", ".join(f"{t['wall_s']:.1f}" for t in timed)
    r["note"] = f"mean of {len(timed)} runs ({walls} s)" + (f"; {r['note']}" if r.get("note")
                                                             else "")
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", type=Path, help="Parquet: id, messages|prompt, max_tokens")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rows", type=int, help="first N rows only")
    ap.add_argument("--max-tokens", type=int, default=64, help="when the workload has none")
    ap.add_argument("--device", default="cpu", help="cpu | cuda")
    ap.add_argument("--threads", type=int, help="torch CPU threads")
    ap.add_argument("--batch-size", type=int, default=8, help="hf-static batch size")
    ap.add_argument("--page-size", type=int, default=16, help="batchllm page size")
    ap.add_argument("--skip-hf", action="store_true", help="skip both transformers baselines")
    ap.add_argument("--skip-hf-static", action="store_true")
    ap.add_argument("--skip-hf-continuous", action="store_true")
    ap.add_argument("--skip-batchllm", action="store_true")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--in-process", action="store_true",
                    help="run every setting in this process (default: each in a fresh one)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds of all settings, in alternating order; figures are means")
    ap.add_argument("--only", help=argparse.SUPPRESS)  # the one setting a child process runs
    args = ap.parse_args()
    if not args.in_process and args.only is None:
        return isolated(args)
    if args.threads:
        torch.set_num_threads(args.threads)

    folder = resolve_model(args.model)
    tokenizer = load_tokenizer(folder)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.workload or contract_workload(Path(tmp) / "contract.parquet")
        rows = read_workload(path, args.rows, args.max_tokens)
    prompts = render(tokenizer, rows)
    max_tokens = [r["max_tokens"] for r in rows]
    prompt_tokens = sum(len(p) for p in prompts)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    load = os.getloadavg()[0]
    if load > (os.cpu_count() or 1):
        print(f"bench: WARNING load average {load:.1f} > {os.cpu_count()} cores: other processes "
              "are running, figures will be unreliable", file=sys.stderr)
    print(f"workload: {len(rows)} rows, {prompt_tokens} prompt tokens, {sum(max_tokens)} output "
          f"tokens, model {args.model}, device {args.device}, threads {torch.get_num_threads()}",
          file=sys.stderr)

    wanted = {args.only} if args.only is not None else set(SETTINGS)
    runs: list[tuple[str, object]] = []
    if not args.skip_hf and wanted & {"hf-static", "hf-continuous"}:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(args.device)
        model.eval()
        if not args.skip_hf_static:
            runs.append(("hf-static",
                         lambda: hf_static(model, prompts, max_tokens, pad_id, args.batch_size)))
        if not args.skip_hf_continuous and hasattr(model, "continuous_batching_context_manager"):
            runs.append(("hf-continuous",
                         lambda: hf_continuous(model, prompts, max_tokens, pad_id)))
    if not args.skip_batchllm and wanted & {"batchllm-sharing", "batchllm-no-sharing"}:
        for sharing in (True, False):
            settings = {"model": args.model, "prompts": prompts, "max_tokens": max_tokens,
                        "prompt_tokens": prompt_tokens,
                        "engine_kwargs": {"page_size": args.page_size, "prefix_sharing": sharing,
                                          "device": args.device, "dtype": "float32"}}
            name = "batchllm-sharing" if sharing else "batchllm-no-sharing"
            runs.append((name, lambda s=settings: run_batchllm(s)))

    if args.only is not None:
        runs = [(name, fn) for name, fn in runs if name == args.only]
    results = []
    for name, fn in runs:
        print(f"running {name} ...", file=sys.stderr, flush=True)
        try:
            r = fn()
        except ImportError as exc:
            r = {"note": f"skipped: cannot import batchllm ({exc})"}
        except Exception as exc:  # noqa: BLE001 - one failed setting must not hide the others
            r = {"note": f"failed: {type(exc).__name__}: {exc}"}
        r = {"setting": name, "prompt_tokens": prompt_tokens, **r}
        if "wall_s" in r:
            r["output_tok_s"] = r["output_tokens"] / r["wall_s"]
            r["total_tok_s"] = (prompt_tokens + r["output_tokens"]) / r["wall_s"]
        results.append(r)
        print(f"  {name}: {r.get('wall_s', float('nan')):.1f} s {r.get('note', '')}",
              file=sys.stderr, flush=True)
    if args.only is None:
        print(table(results))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        env = {"rows": len(rows), "prompt_tokens": prompt_tokens, "device": args.device,
               "load_average_at_start": load, "cpu_count": os.cpu_count(),
               "threads": torch.get_num_threads(), "torch": torch.__version__}
        args.json.write_text(json.dumps({"env": env, "results": results}, indent=1, default=str))


if __name__ == "__main__":
    main()
