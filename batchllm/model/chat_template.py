"""Chat templates rendered as transformers renders them, without importing transformers.

transformers' apply_chat_template(tokenize=False) drops the keys whose value is None from each
message and renders the template in a sandboxed jinja2 environment (trim_blocks, lstrip_blocks,
the loop-controls extension; a tojson filter that does not escape HTML; raise_exception,
strftime_now, and a `dict` and `namespace` that reject underscore names) with messages, tools,
documents, add_generation_prompt and the tokenizer's special tokens (utils/chat_template_utils.py,
_compile_jinja_template and render_jinja_template). Importing that module imports transformers:
0.4 s of a start-up of 1.7 s here. This file builds the same environment; a template that uses
transformers' own `{% generation %}` tag, or messages with more than a text role and content
(transformers rewrites reasoning fields and rich objects), go to transformers' renderer.
tests/test_hf_cache.py renders real and hand-written templates both ways.
"""

from __future__ import annotations

import functools
import json
import re
from datetime import datetime
from typing import Any

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


@functools.cache
def _jinja_ok() -> bool:
    """jinja2 >= 3.1.6, as transformers requires (older ones have sandbox escapes); else
    transformers' renderer, which says so."""
    import jinja2

    version = tuple(int(p) for p in re.findall(r"\d+", jinja2.__version__)[:3])
    return version >= (3, 1, 6)


@functools.lru_cache(maxsize=8)
def _compile(template: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:  # `dict(...)` in a template, without the class's attributes
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):  # no underscore attributes
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, "
                    f"but got {name!r}. Please rename the attribute.")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now,
                       dict=TemplateDict(), namespace=TemplateNamespace)
    return env.from_string(template)


def render(template: str, chats: list[list[dict]], add_generation_prompt: bool,
           special_tokens: dict[str, Any]) -> list[str]:
    """Each conversation through `template`, as apply_chat_template(tokenize=False) does."""
    chats = [[{k: v for k, v in m.items() if v is not None} for m in chat] for chat in chats]
    plain = all(set(m) <= {"role", "content"} and all(isinstance(v, str) for v in m.values())
                for chat in chats for m in chat)  # transformers rewrites others (reasoning)
    if _GENERATION_TAG.search(template) or not plain or not _jinja_ok():
        from transformers.utils.chat_template_utils import render_jinja_template

        rendered, _ = render_jinja_template(conversations=chats, chat_template=template,
                                            add_generation_prompt=add_generation_prompt,
                                            **special_tokens)
        return rendered
    compiled = _compile(template)
    return [compiled.render(messages=chat, tools=None, documents=None,
                            add_generation_prompt=add_generation_prompt, **special_tokens)
            for chat in chats]
