"""Structured output's constraints as llguidance grammars, and whether one compiles, without a
tokenizer (so that a job's own schema, regex or choice is checked with the job file, before the
model loads: config/sections.py). JSON is generated with fixed separators (", " and ": ", no
other whitespace; a schema's "x-guidance" options override this): flexible whitespace lets a
small model loop on newlines until max_tokens.
"""

from __future__ import annotations

import json

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(kind: str, spec: str) -> str:
    """The llguidance grammar of a constraint (SamplingParams.constraint)."""
    import llguidance as llg

    if kind == "json_schema":
        return llg.LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":  # literal alternatives; JSON string escapes are Lark's too
        choices = json.loads(spec)
        return llg.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))
    raise ValueError(f"unknown constraint kind {kind!r}")


def compile_problem(kind: str, spec: str) -> str | None:
    """Why a constraint (SamplingParams.constraint's kind and spec) does not compile, in the
    compiler's words; None when it does."""
    import llguidance as llg

    try:
        why = llg.LLMatcher.validate_grammar(grammar_text(kind, spec))
    except ValueError as e:  # not valid JSON, or rejected before compiling
        why = str(e)
    return why.strip() or None
