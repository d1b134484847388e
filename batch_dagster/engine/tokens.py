"""Prompt tokens of a request body, counted with the model's tokenizer before anything runs (for estimates).

The engine counts them itself when the request runs; this count is the estimate's, close to it: text content only
(an image part counts for nothing here), through the model's chat template.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile.responses import chat_body

from .lines import RequestError

# A request's prompt tokens as the engine counts them, one count per prompt (a completions or embeddings body
# may hold several); None when the engine will refuse the request before it runs (its template fails on it).
CountTokens = Callable[[str, dict[str, Any]], list[int] | None]
# vLLM's own models have no stated limit; a tokenizer without one says so with a huge model_max_length.
_NO_LIMIT = 10**8


def _text_of(content: Any) -> str:
    """A message's content as vLLM gives it to a chat template that takes text: its text parts joined by newlines."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        return "\n".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    raise RequestError("Message content must be a string or a list of content parts.", param="messages")


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for i, m in enumerate(body["messages"]):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"Message {i} must be an object with a 'role'.", param=f"messages[{i}]")
        out.append({**m, "content": _text_of(m.get("content"))})
    return out


def _template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    given = body.get("chat_template_kwargs") or {}
    if not isinstance(given, dict):
        raise RequestError("'chat_template_kwargs' must be an object.", param="chat_template_kwargs")
    return {**given, **({"enable_thinking": body["enable_thinking"]} if "enable_thinking" in body else {})}


def _prompt_list(value: Any) -> list[str | list[int]]:
    """A completions `prompt` or embeddings `input` as a list of prompts (text or token ids)."""
    if isinstance(value, str) or isinstance(value, list) and value and all(isinstance(t, int) for t in value):
        return [value]
    if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        return list(value)
    raise RequestError("The prompt must be a string, a list of strings or a list of token ids.")


def _prompts(tokenizer: Any, endpoint: str, body: dict[str, Any]) -> list[int]:
    """One count per prompt, as vLLM's server counts them: the chat template's text encoded without special
    tokens; a text prompt or input with them."""
    if endpoint == c.RESPONSES:
        endpoint, body = c.CHAT, chat_body(body)
    if endpoint == c.CHAT:
        text = tokenizer.apply_chat_template(_messages(body), tokenize=False, add_generation_prompt=True,
                                             **_template_kwargs(body))
        return [len(tokenizer.encode(text, add_special_tokens=False))]
    if endpoint in (c.SCORE, c.RERANK):  # an embedding model embeds each text once
        query = body.get("queries", body.get("query"))
        texts = [*(query if isinstance(query, list) else [query]), *_prompt_list(body["documents"])]
        return [sum(len(tokenizer.encode(t)) for t in texts if isinstance(t, str))]
    field = "prompt" if endpoint == c.COMPLETIONS else "input"
    return [len(p) if isinstance(p, list) else len(tokenizer.encode(p)) for p in _prompt_list(body[field])]


def counter(tokenizer: Any) -> CountTokens:
    """The estimate's count: each prompt's tokens, or None for a body the engine refuses before it runs."""
    from jinja2 import TemplateError

    # What the tokenizer or the chat template raise for one bad body (the engine answers it with a 400 line).
    refused = (RequestError, TemplateError, ValueError, TypeError, LookupError, AttributeError, OverflowError)

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
