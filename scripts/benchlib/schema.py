"""The bench's structured-output setting: `--json-schema small` or the path of a JSON schema.

"small" is what a nightly extraction job asks of the contract workload: two short fields and an
enum, then one free string, so that a row can still run to its max_tokens inside the string and
the setting decodes about as many tokens as the unconstrained one (with end-of-sequence ignored,
a finished grammar still ends its row).
"""

from __future__ import annotations

import json
from pathlib import Path

SMALL = {
    "type": "object",
    "properties": {
        "party": {"type": "string", "maxLength": 40},
        "risk": {"enum": ["low", "medium", "high"]},
        "summary": {"type": "string"},
    },
    "required": ["party", "risk", "summary"],
    "additionalProperties": False,
}


def load_schema(arg: str | None) -> dict | None:
    """The schema `--json-schema` names: None (not given), the small one, or a JSON file's."""
    if arg is None:
        return None
    if arg == "small":
        return SMALL
    return json.loads(Path(arg).read_text())
