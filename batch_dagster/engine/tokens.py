"""Prompt tokens of a request body, counted before anything runs (estimates, the token limit, the cost cap), each
count under a deadline.

A generation model's bodies are rendered by vLLM's own render path (engine/render.py, in a count worker or a replica
of the model's fleet), so the count is the engine's: the same template, template kwargs merge and refusals. An
embedding model's inputs are only tokenized, here. An image part counts for nothing: nothing is fetched to count it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from batch_dagster.batchfile import contract as c

# A request's prompt tokens as the engine counts them, one count per prompt (a completions or embeddings body
# may hold several); None when the engine refuses the request before it runs (a 400 line, billed nothing). Raises
# CountTimeout when the body, or the whole count, ran past its deadline.
CountTokens = Callable[[str, dict[str, Any]], list[int] | None]
# The same, within `timeout_s`; raises TimedOut past it.
TimedCount = Callable[[str, dict[str, Any], float], list[int] | None]
# vLLM's own models have no stated limit; a tokenizer without one says so with a huge model_max_length.
_NO_LIMIT = 10**8
# How long one body may render: vLLM's own render timeout (VLLM_CHAT_TEMPLATE_RENDER_TIMEOUT's default), past which
# the engine refuses it too; a little more, so that vLLM's answer comes first.
LINE_TIMEOUT_S = 35.0


class TimedOut(Exception):
    """A body that did not render within the time it was given (its worker was stopped)."""


class CountFailed(RuntimeError):
    """The count itself failed (its worker did not start, or died): no fault of the body."""


class CountTimeout(Exception):
    """A count stopped at its deadline: a body that renders too long, or a file past the estimate's deadline.
    `line` is the file's line it stopped at, once the caller knows it."""

    def __init__(self, reason: str, line: int | None = None):
        super().__init__(reason)
        self.reason, self.line = reason, line

    def at(self, line: int) -> CountTimeout:
        return CountTimeout(self.reason, line)

    def __str__(self) -> str:
        return self.reason if self.line is None else f"Line {self.line}: {self.reason}"


def bounded(count: TimedCount, budget_s: float | None) -> CountTokens:
    """`count` with a deadline on each body (LINE_TIMEOUT_S) and, from the first body on, on them all (`budget_s`)."""
    deadline: float | None = None
    line_s = LINE_TIMEOUT_S

    def one(endpoint: str, body: dict[str, Any]) -> list[int] | None:
        nonlocal deadline
        now = time.monotonic()
        if budget_s is not None and deadline is None:
            deadline = now + budget_s
        left = line_s if deadline is None else min(line_s, deadline - now)
        if left <= 0:
            raise CountTimeout(f"the count ran past its deadline of {budget_s:g} s here; split the file.")
        try:
            return count(endpoint, body, left)
        except TimedOut:
            if left < line_s:
                raise CountTimeout(f"the count ran past its deadline of {budget_s:g} s here; split the file.") from None
            raise CountTimeout(f"the body did not render within {line_s:g} s (the engine's own bound on rendering "
                               "one request); it was stopped.") from None

    return one


def _prompt_list(value: Any) -> list[str | list[int]]:
    """An embeddings `input` as a list of prompts (text or token ids)."""
    if isinstance(value, str) or isinstance(value, list) and value and all(isinstance(t, int) for t in value):
        return [value]
    if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        return list(value)
    return []


def pooling_counter(tokenizer: Any) -> TimedCount:
    """An embedding model's count: each input, or a score or rerank line's texts, tokenized as vLLM's server does
    (special tokens added); token ids as they are. There is no template to render: the time a body takes is its
    size's, which the line limit bounds."""

    def count(endpoint: str, body: dict[str, Any], timeout_s: float) -> list[int] | None:
        if endpoint in (c.SCORE, c.RERANK):  # an embedding model embeds each text once
            query = body.get("queries", body.get("query"))
            texts = [*(query if isinstance(query, list) else [query]), *_prompt_list(body.get("documents"))]
            return [sum(len(tokenizer.encode(t)) for t in texts if isinstance(t, str))]
        prompts = _prompt_list(body.get("input"))
        if endpoint != c.EMBEDDINGS or not prompts:
            return None
        return [len(p) if isinstance(p, list) else len(tokenizer.encode(p)) for p in prompts]

    return count


_IMAGE_PARTS = ("image_url", "input_image", "image")


def _text_parts(parts: Any) -> Any:
    return [p for p in parts if not (isinstance(p, dict) and p.get("type") in _IMAGE_PARTS)] \
        if isinstance(parts, list) else parts


def without_images(endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    """The body as it is counted: its image parts left out, so the count fetches nothing on a client's behalf (the
    engine's fetch has its own checks, features/images.py), and an image counts for nothing (docs/http-api.md,
    "Estimate")."""
    field = "messages" if endpoint in (c.CHAT, c.MESSAGES) else "input"
    items = body.get(field) if endpoint in (c.CHAT, c.RESPONSES, c.MESSAGES) else None
    if not isinstance(items, list):
        return body
    kept = [{**m, "content": _text_parts(m["content"])} if isinstance(m, dict) and "content" in m else m
            for m in items]
    return {**body, field: kept}


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
