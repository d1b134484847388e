"""The chat body a /v1/responses body amounts to (`instructions` -> a system message, `input` -> the messages).

vLLM's serving layer runs a responses request itself; this is only what sharding and estimates read of one: its
prompt's text, to group it with requests sharing a prefix and to count its tokens.
"""

from __future__ import annotations

from typing import Any


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
