"""Prompt tokens of a request body, counted with the model's tokenizer as the engine will see them."""

from __future__ import annotations

from typing import Any

from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile.responses import chat_body

from . import translate as t


def prompt_tokens(tokenizer: Any, endpoint: str, body: dict[str, Any]) -> int:
    """The prompt's token count (0 for a body the engine will reject anyway: it never runs)."""
    try:
        if endpoint == c.RESPONSES:
            endpoint, body = c.CHAT, chat_body(body)
        if endpoint == c.CHAT:
            text = tokenizer.apply_chat_template(t.chat_messages(body), tokenize=False, add_generation_prompt=True,
                                                 **t.chat_template_kwargs(body))
            return len(tokenizer.encode(text, add_special_tokens=False))
        field = "prompt" if endpoint == c.COMPLETIONS else "input"
        return sum(len(p) if isinstance(p, list) else len(tokenizer.encode(p)) for p in t.prompt_list(body, field))
    except t.RequestError:
        return 0
