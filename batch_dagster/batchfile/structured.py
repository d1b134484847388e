"""Which requests asked for structured output, and which of their answers were cut short of it by max_tokens.

Such a line stays as OpenAI returns it (`finish_reason: "length"`, a `response` with `status: "incomplete"`): its
JSON is not whole. The batch counts them (`request_counts.incomplete_structured`), so a user knows before parsing.
"""

from __future__ import annotations

from typing import Any

from . import contract as c


def asks_structured(endpoint: str, body: dict[str, Any]) -> bool:
    """Whether the request constrains its answer to a format: a JSON schema or object, vLLM's structured outputs,
    or a tool call it requires."""
    if body.get("structured_outputs"):
        return True
    if endpoint == c.RESPONSES:
        text = body.get("text")
        fmt = text.get("format") if isinstance(text, dict) else None
        if isinstance(fmt, dict) and fmt.get("type") in ("json_schema", "json_object"):
            return True
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") in ("json_schema", "json_object"):
        return True
    choice = body.get("tool_choice")
    return bool(body.get("tools")) and (choice == "required" or isinstance(choice, dict))


def cut_short(body: dict[str, Any]) -> bool:
    """Whether an answer (a response body) stopped at its token limit: any choice, or the `response`."""
    if body.get("object") == "response":
        return body.get("status") == "incomplete"
    return any(isinstance(ch, dict) and ch.get("finish_reason") == "length" for ch in body.get("choices") or ())
