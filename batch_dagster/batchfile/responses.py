"""The chat body a /v1/responses body amounts to (`instructions` -> a system message, `input` -> the messages).

vLLM's serving layer runs a responses request itself; this is only what sharding and estimates read of one: its
prompt's text, to group it with requests sharing a prefix and to count its tokens.
"""

from __future__ import annotations

from typing import Any


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))


def _message(item: Any) -> dict[str, Any]:
    """An input item as the chat message it amounts to: a message, a tool call (its arguments), a tool's output.
    A mistyped item (validation refused it: its request never runs) counts as empty text."""
    if not isinstance(item, dict):
        return {"role": "user", "content": ""}
    kind = item.get("type", "message")
    if kind == "function_call":
        return {"role": "assistant", "content": _text(item.get("arguments"))}
    if kind == "function_call_output":
        return {"role": "tool", "content": _text(item.get("output"))}
    role = item.get("role")
    return {"role": role if isinstance(role, str) else "user", "content": _text(item.get("content"))}


def chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """The chat completions body a responses body amounts to: instructions first, as a system message."""
    instructions = body.get("instructions")
    messages = [{"role": "system", "content": instructions}] if isinstance(instructions, str) and instructions else []
    value = body.get("input")
    if isinstance(value, list):
        messages += [_message(item) for item in value]
    else:
        messages.append({"role": "user", "content": _text(value)})
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    for name in ("temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "stop"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    return chat
