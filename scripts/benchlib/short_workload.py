"""A short, prefill-heavy job (`--workload short`): the shape of the small nightly jobs that are
common (tests, backfills, small customers), unlike the contract workload's long decodes.

60 chat prompts of ~200 tokens: one shared header (a system prompt), four mid-level task
templates under it, then a short row of its own (a ticket); max_tokens 8-64 per row, to be run
with end-of-sequence honoured (`--eos`). With SmolLM2's chat template: ~12,000 prompt tokens of
which ~2,300 are distinct (the prefix tree's tokens).
"""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

HEADER = (
    "You are the support assistant of Northwind Outfitters, a retailer of outdoor gear with "
    "stores in twelve countries and an online shop. Be accurate, brief and polite. Never invent "
    "order numbers, prices or policies. Our return window is 60 days with a receipt; opened "
    "electronics can be returned within 14 days; custom-made items cannot be returned. Shipping "
    "is free above 50 euros; express delivery takes one to two working days. Warranty claims go "
    "to warranty@northwind.example with the order number and photos of the defect. Escalate "
    "anything about safety, injuries or legal threats to a human agent."
)
TEMPLATES = (
    ("Task: classify the customer ticket below into exactly one category: returns, shipping, "
     "warranty, billing, product question, or escalate. Answer with the category name first, "
     "then one sentence that says why."),
    ("Task: extract from the customer ticket below the order number (if any), the product, the "
     "problem in a few words, and what the customer wants. Answer as four short lines."),
    ("Task: write a reply to the customer ticket below that follows our policies. Keep it under "
     "four sentences and end with the next step the customer should take."),
    ("Task: rate the urgency of the customer ticket below from 1 (can wait a week) to 5 "
     "(needs a human within the hour), and give the one fact that decided it."),
)
PRODUCTS = ("tent", "sleeping bag", "rain jacket", "hiking boots", "headlamp", "backpack",
            "camping stove", "trekking poles", "water filter", "GPS watch")
PROBLEMS = ("arrived with a torn seam", "has not arrived after ten days", "was charged twice",
            "stopped working after one trip", "is the wrong size", "smells of smoke",
            "came without the manual", "leaks at the zip")
WANTS = ("a refund", "a replacement", "to know where the parcel is", "a repair",
         "to cancel the order", "an invoice")


def write_short_workload(out: Path, rows: int = 60, seed: int = 0) -> Path:
    """Write the workload (id, messages, max_tokens) to `out`; the same rows for the same seed."""
    rng = random.Random(seed)
    messages, max_tokens = [], []
    for i in range(rows):
        order = f"NW-{rng.randrange(10**5):05d}"
        ticket = (f"Ticket {1000 + i}: my {rng.choice(PRODUCTS)} (order {order}) "
                  f"{rng.choice(PROBLEMS)}. I would like {rng.choice(WANTS)}.")
        task = TEMPLATES[i % len(TEMPLATES)]
        messages.append([{"role": "system", "content": HEADER},
                         {"role": "user", "content": f"{task}\n\n{ticket}"}])
        max_tokens.append(rng.randint(8, 64))
    table = pa.table({"id": list(range(rows)), "messages": messages,
                      "max_tokens": pa.array(max_tokens, pa.int32())})
    pq.write_table(table, out)
    return out
