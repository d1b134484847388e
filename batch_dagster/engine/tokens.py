"""Prompt tokens of a request body, counted with the model's tokenizer as the engine will see them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile.responses import chat_body

from . import translate as t

# A request's prompt tokens as the engine counts them, one count per prompt (a completions or embeddings body
# may hold several); None when the engine will refuse the request before it runs (its template fails on it).
CountTokens = Callable[[str, dict[str, Any]], list[int] | None]
# vLLM's own models have no stated limit; a tokenizer without one says so with a huge model_max_length.
_NO_LIMIT = 10**8


def _prompts(tokenizer: Any, endpoint: str, body: dict[str, Any]) -> list[int]:
    """One count per prompt, as engine/offline.py prepares them (and vLLM's server: the chat template's text,
    encoded without special tokens; a text prompt or input with them)."""
    if endpoint == c.RESPONSES:
        endpoint, body = c.CHAT, chat_body(body)
    if endpoint == c.CHAT:
        text = tokenizer.apply_chat_template(t.chat_messages(body), tokenize=False, add_generation_prompt=True,
                                             **t.chat_template_kwargs(body))
        return [len(tokenizer.encode(text, add_special_tokens=False))]
    field = "prompt" if endpoint == c.COMPLETIONS else "input"
    return [len(p) if isinstance(p, list) else len(tokenizer.encode(p)) for p in t.prompt_list(body, field)]


def counter(tokenizer: Any) -> CountTokens:
    """The estimate's count: each prompt's tokens, or None for a body the engine refuses before it runs."""
    from jinja2 import TemplateError

    # What the tokenizer or the chat template raise for one bad body (engine/offline.py turns the same into
    # that request's 400 line).
    refused = (t.RequestError, TemplateError, ValueError, TypeError, LookupError, AttributeError, OverflowError)

    def count(endpoint: str, body: dict[str, Any]) -> list[int] | None:
        try:
            return _prompts(tokenizer, endpoint, body)
        except refused:
            return None

    return count


def stated_context_length(tokenizer: Any, model_path: str) -> int:
    """The context vLLM gives a model the registry sets no max_model_len for: its config's
    max_position_embeddings, else what its tokenizer states."""
    try:
        stated = orjson.loads((Path(model_path) / "config.json").read_bytes()).get("max_position_embeddings")
    except (OSError, orjson.JSONDecodeError, AttributeError):
        stated = None
    stated = stated or getattr(tokenizer, "model_max_length", None)
    if isinstance(stated, int) and 0 < stated < _NO_LIMIT:
        return stated
    raise ValueError(f"The context length of {model_path} is not known; set max_model_len in the registry.")
