"""The /v1/responses contract: checking a request body, turning it into a chat body, and the `response` object.

A responses request runs as the chat request it amounts to (`instructions` -> a system message,
`input` -> the messages), so both engines share the chat translation; only the body written back
differs, and it has the shape vLLM's OpenAI server returns from /v1/responses.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from . import contract as c
from .bodies import BodyError, check_depth

ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text")

# Body fields and the types they must have (bool is not a number here, as in the OpenAI spec).
_NUMBER_RANGES = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0)}
_STRINGS = ("instructions", "user", "truncation", "service_tier")
_UNSUPPORTED = {
    "previous_response_id": "a batch request cannot continue a stored response",
    "conversation": "a batch request cannot continue a stored conversation",
    "background": "batch requests already run in the background",
}



def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_content(content: Any, where: str) -> str | None:
    """What is wrong with a message's content, or None."""
    if isinstance(content, str):
        return None
    if not isinstance(content, list):
        return f"'{where}' must be a string or a list of content parts."
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            return (f"'{where}[{j}]' must be a text part ({{'type': 'input_text', 'text': ...}}); "
                    "only text input is served.")
    return None


def input_problem(value: Any) -> tuple[str, str] | None:
    """(message, param) for an `input` that is neither a string nor a list of message items, else None."""
    if isinstance(value, str):
        return None if value else ("'input' must not be empty.", "body.input")
    if not isinstance(value, list) or not value:
        return "'input' must be a string or a non-empty list of input items.", "body.input"
    for i, item in enumerate(value):
        where = f"body.input[{i}]"
        if not isinstance(item, dict):
            return f"'{where}' must be an object (a message with 'role' and 'content').", where
        kind = item.get("type", "message")
        if kind != "message":
            return f"'{where}' has type {c.quoted(kind)}; only 'message' items are served.", f"{where}.type"
        if item.get("role") not in ROLES:
            return f"'{where}.role' must be one of {', '.join(ROLES)}.", f"{where}.role"
        if (problem := _check_content(item.get("content"), f"{where}.content")) is not None:
            return problem, f"{where}.content"
    return None


def body_problems(body: dict[str, Any]) -> list[tuple[str, str]]:
    """Every (message, param) wrong with a responses body (besides `model`, checked for every endpoint)."""
    problems = []
    try:
        check_depth(body)  # the limit of every endpoint: a deeper body is cut to be stored (bodies.cut)
    except BodyError as exc:
        problems.append((str(exc), exc.param))
    if "input" not in body:
        problems.append(("Field 'body.input' must be present for /v1/responses.", "body.input"))
    elif (problem := input_problem(body["input"])) is not None:
        problems.append(problem)
    for name in _STRINGS:
        if body.get(name) is not None and not isinstance(body[name], str):
            problems.append((f"'body.{name}' must be a string.", f"body.{name}"))
    tokens = body.get("max_output_tokens")
    if tokens is not None and (not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1):
        problems.append(("'body.max_output_tokens' must be an integer of at least 1.", "body.max_output_tokens"))
    for name, (low, high) in _NUMBER_RANGES.items():
        value = body.get(name)
        if value is not None and (not _is_number(value) or not low <= value <= high):
            problems.append((f"'body.{name}' must be a number from {low:g} to {high:g}.", f"body.{name}"))
    if body.get("stream"):
        problems.append(("'body.stream' must be false or absent: batch requests do not stream.", "body.stream"))
    for name, why in _UNSUPPORTED.items():
        if body.get(name):
            problems.append((f"'body.{name}' is not supported: {why}.", f"body.{name}"))
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        problems.append(("'body.metadata' must be an object.", "body.metadata"))
    return problems


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content or [] if isinstance(p, dict))


def chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """The chat completions body a responses body amounts to: instructions first, as a system message."""
    messages = [{"role": "system", "content": body["instructions"]}] if body.get("instructions") else []
    value = body["input"]
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
    else:
        messages += [{"role": item["role"], "content": _text(item.get("content"))} for item in value]
    chat: dict[str, Any] = {"model": body["model"], "messages": messages}
    for name in ("temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "stop"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    return chat


def response_object(
    body: dict[str, Any],
    *,
    model: str,
    text: str,
    finish_reason: str | None,
    input_tokens: int,
    output_tokens: int,
    cached_tokens: int = 0,
    temperature: float | None = None,
    top_p: float | None = None,
    max_output_tokens: int | None = None,
) -> dict[str, Any]:
    """A `response` object as vLLM's server writes it for a plain text answer (no tools, no reasoning parser)."""
    status = "incomplete" if finish_reason == "length" else "completed"
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": [], "logprobs": None}
    content = [part] if text else []
    return {
        "id": f"resp_{uuid.uuid4().hex}",
        "created_at": int(time.time()),
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.get("instructions"),
        "metadata": body.get("metadata"),
        "model": model,
        "object": "response",
        "output": [{"id": f"msg_{uuid.uuid4().hex}", "content": content, "role": "assistant",
                    "status": "completed", "type": "message"}],
        "parallel_tool_calls": True,
        "temperature": temperature,
        "tool_choice": "auto",
        "tools": [],
        "top_p": top_p,
        "background": False,
        "max_output_tokens": max_output_tokens,
        "max_tool_calls": None,
        "previous_response_id": None,
        "prompt": None,
        "reasoning": None,
        "service_tier": body.get("service_tier") or "auto",
        "status": status,
        "text": None,
        "top_logprobs": None,
        "truncation": body.get("truncation") or "disabled",
        "usage": {
            "input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens,
        },
        "user": body.get("user"),
    }
