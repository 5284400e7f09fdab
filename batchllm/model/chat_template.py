"""Chat templates rendered by transformers' own renderer, as apply_chat_template(tokenize=False)
renders them: the keys whose value is None dropped from each message, then
utils/chat_template_utils.render_jinja_template (its sandboxed jinja2 environment, its globals
and filters, its `{% generation %}` tag).

batchllm once kept a copy of that environment to save transformers' import (0.35 s of a
start-up of 1.45 s here, measured with the copy and without, three runs each: 1.44-1.49 s ->
1.74-1.85 s to the first forward). The copy was of a security sandbox that transformers
changes (underscore names refused in `namespace`, `dict` without the class's attributes): a fix
it missed would have been a hole no output test shows. The import is paid only by jobs whose
prompts have a chat template, and only once the tokenizer is cached (tokenizer.py).
"""

from __future__ import annotations

from typing import Any


def render(template: str, chats: list[list[dict]], add_generation_prompt: bool,
           special_tokens: dict[str, Any]) -> list[str]:
    """Each conversation through `template`, as apply_chat_template(tokenize=False) does."""
    from transformers.utils.chat_template_utils import render_jinja_template

    chats = [[{k: v for k, v in m.items() if v is not None} for m in chat] for chat in chats]
    rendered, _ = render_jinja_template(conversations=chats, chat_template=template,
                                        add_generation_prompt=add_generation_prompt,
                                        **special_tokens)
    return rendered
