"""Sharding: order requests so shared prefixes and similar lengths run together, then cut.

Requests that share a system prompt (or the same opening text) sit next to each other so the
engine's prefix cache hits, and within a prefix group they go by length so a shard's sequences
finish at about the same time.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from . import contract as c
from .responses import chat_body

# Opening text that counts as a shared prefix when there is no system prompt.
PREFIX_CHARS = 256


@dataclass(frozen=True)
class Features:
    """What sharding needs to know about one request."""

    prompt_chars: int
    prefix_key: str


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: keep the text ones (a mistyped one ends as a 400 line)
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def features(endpoint: str, body: dict[str, Any]) -> Features:
    """Prompt size and prefix of one request body (already validated)."""
    if endpoint == c.RESPONSES:  # runs as its chat body, so it groups as one
        endpoint, body = c.CHAT, chat_body(body)
    if endpoint == c.CHAT:
        messages = body.get("messages") or []
        texts = [_text_of(m.get("content")) for m in messages if isinstance(m, dict)]
        first = messages[0] if messages and isinstance(messages[0], dict) else {}
        prefix = texts[0] if first.get("role") in ("system", "developer") else texts[0][:PREFIX_CHARS] if texts else ""
        chars = sum(len(t) for t in texts)
    else:
        raw = body.get("prompt") if endpoint == c.COMPLETIONS else body.get("input")
        texts = [raw] if isinstance(raw, str) else [str(x) for x in raw] if isinstance(raw, list) else [str(raw)]
        chars = sum(len(t) for t in texts)
        prefix = texts[0][:PREFIX_CHARS] if texts else ""
    return Features(chars, hashlib.blake2b(prefix.encode(), digest_size=8).hexdigest())


def plan_shards(features_by_row: Sequence[Features], shard_size: int) -> list[list[int]]:
    """Row indices per shard: prefix groups (largest first) in length order, cut every shard_size."""
    if shard_size < 1:
        raise ValueError("shard_size must be at least 1")
    group_size: dict[str, int] = {}
    for f in features_by_row:
        group_size[f.prefix_key] = group_size.get(f.prefix_key, 0) + 1
    def key(i: int) -> tuple[int, int, str, int]:
        f = features_by_row[i]
        size = group_size[f.prefix_key]
        # Requests whose prefix nobody shares gain nothing from grouping: they go by length only.
        return (0, -size, f.prefix_key, f.prompt_chars) if size > 1 else (1, 0, "", f.prompt_chars)

    order = sorted(range(len(features_by_row)), key=key)
    return [order[i : i + shard_size] for i in range(0, len(order), shard_size)]
