"""Sharding: order requests so shared prefixes run together and the longest work goes first, then cut.

Requests that share a system prompt (or the same opening text) form a group; inside it,
requests that share a longer leading text (a document asked several questions) sit together,
so one shard holds them all and the engine's prefix cache computes that text once. Within
what they share the longest expected work goes first (the most output tokens asked, then the longest prompt), so
the batch's tail is its shortest requests, not a few long ones running alone on an engine sized for hundreds; cuts
fall where the least is shared. The engines send a shard's requests in the same order (`ordered`).
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from . import contract as c
from .responses import chat_body

# Opening text that counts as a shared prefix when there is no system prompt.
PREFIX_CHARS = 256
# The prefix path: a hash per PATH_CHARS bytes of the prompt (~128 tokens), up to PATH_SEGMENTS of them.
PATH_CHARS = 512
PATH_SEGMENTS = 32
_PATH_BYTES = PATH_CHARS * PATH_SEGMENTS
_HEX = 16  # hex characters of the group's hash (8 bytes)
PATH_HEX = 8  # hex characters of one path hash (a CRC-32: a rare collision only orders two requests side by side)
# A chat request without max_tokens may write to the end of its context: it orders as asking this many.
UNBOUNDED_OUTPUT_TOKENS = 4096
CHARS_PER_TOKEN = 4  # about, in English text: how a prompt's characters weigh against output tokens in `work`


@dataclass(frozen=True)
class Features:
    """What sharding needs to know about one request.

    `prefix_key` is a path: the hash of its group (system prompt, or opening text), then one
    hash per PATH_CHARS chunk of the prompt's text after the system prompt. Two requests' paths agree for as many
    leading hashes as their prompts agree for full chunks.
    """

    prompt_chars: int
    prefix_key: str
    max_tokens: int = 0  # the output tokens it asks for at most (output_cap)

    @property
    def work(self) -> int:
        """Its expected work, in tokens: the output asked for, and the prompt at about CHARS_PER_TOKEN a token."""
        return self.max_tokens + self.prompt_chars // CHARS_PER_TOKEN

    @property
    def group(self) -> str:
        return self.prefix_key[:_HEX]

    @property
    def path(self) -> str:
        return self.prefix_key[_HEX:]


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: keep the text ones (a mistyped one ends as a 400 line)
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [] if value is None else [value]


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=_HEX // 2).hexdigest()


def prefix_path(text: str) -> str:
    """One hash per full PATH_CHARS chunk of `text` (as UTF-8): equal leading hashes, equal leading text."""
    data = text[:_PATH_BYTES].encode()  # a character is at least a byte: the chunks that count are all here
    n = min(len(data) // PATH_CHARS, PATH_SEGMENTS)
    return ("%08x" * n) % tuple([zlib.crc32(data[i : i + PATH_CHARS]) for i in range(0, n * PATH_CHARS, PATH_CHARS)])


def output_cap(endpoint: str, body: dict[str, Any]) -> int:
    """The output tokens a request asks for at most, as ordering weighs it: its max_completion_tokens or
    max_tokens; without one a legacy completion's default, and a chat request's UNBOUNDED_OUTPUT_TOKENS; none for
    the endpoints that write no tokens."""
    if endpoint not in (c.CHAT, c.COMPLETIONS):
        return 0
    asked = body.get("max_completion_tokens", body.get("max_tokens"))
    if isinstance(asked, int) and not isinstance(asked, bool) and asked > 0:
        return min(asked, UNBOUNDED_OUTPUT_TOKENS)
    return UNBOUNDED_OUTPUT_TOKENS if endpoint == c.CHAT else c.COMPLETIONS_MAX_TOKENS


def features(endpoint: str, body: dict[str, Any]) -> Features:
    """Prompt size, prefix and output asked of one request body (already validated)."""
    if endpoint == c.RESPONSES:  # runs as its chat body, so it groups as one
        endpoint, body = c.CHAT, chat_body(body)
    if endpoint == c.CHAT:
        messages = [m for m in body.get("messages") or [] if isinstance(m, dict)]
        texts = [_text_of(m.get("content")) for m in messages]
        first = messages[0] if messages else {}
        system = first.get("role") in ("system", "developer")
        prefix = texts[0] if system else texts[0][:PREFIX_CHARS] if texts else ""
        chars = sum(len(t) for t in texts)
        # The prompt after its group's system prompt (which the group's hash covers), as the chat template lays
        # it out: each message's role, then its text, in order.
        after = 1 if system else 0
        leading = "".join([f"\x1e{m.get('role')}\x1f{t}" for m, t in zip(messages[after:], texts[after:], strict=True)])
    elif endpoint in (c.SCORE, c.RERANK):  # grouped by their query, sized by all their texts
        texts = [_text_of(x) for x in _as_list(body.get("queries", body.get("query")))]
        docs = [_text_of(x) for x in _as_list(body.get("documents"))]
        chars = sum(len(t) for t in texts + docs)
        prefix = texts[0][:PREFIX_CHARS] if texts else ""
        leading = texts[0] if texts else ""
    else:
        raw = body.get("prompt") if endpoint == c.COMPLETIONS else body.get("input")
        texts = [raw] if isinstance(raw, str) else [str(x) for x in raw] if isinstance(raw, list) else [str(raw)]
        chars = sum(len(t) for t in texts)
        prefix = texts[0][:PREFIX_CHARS] if texts else ""
        leading = texts[0] if texts else ""
    return Features(chars, _digest(prefix.encode()) + prefix_path(leading), output_cap(endpoint, body))


def _shared(a: str, b: str) -> int:
    """How many leading hashes two paths have in common."""
    n = 0
    for i in range(0, min(len(a), len(b)), PATH_HEX):
        if a[i : i + PATH_HEX] != b[i : i + PATH_HEX]:
            break
        n += 1
    return n


def ordered(features_by_row: Sequence[Features]) -> tuple[list[int], list[str]]:
    """Row indices in running order, and each row's shared path: prefix groups (largest first), shared prefixes
    together, each the longest work first.

    Within a group, requests go by the longest leading text they share with another request (a trie's order: every
    prefix's requests are contiguous), then by expected work (Features.work), the most first. Requests whose prefix
    nobody shares go after the groups, by work alone. O(n log n).
    """
    rows = len(features_by_row)
    group_size: dict[str, int] = {}
    for f in features_by_row:
        group_size[f.group] = group_size.get(f.group, 0) + 1
    # What each request shares: the longest path prefix it has in common with a neighbour in path order.
    by_path = sorted(range(rows), key=lambda i: features_by_row[i].prefix_key)
    shared = [0] * rows
    for a, b in zip(by_path, by_path[1:], strict=False):
        n = _shared(features_by_row[a].path, features_by_row[b].path) if features_by_row[a].group == \
            features_by_row[b].group else 0
        shared[a], shared[b] = max(shared[a], n), max(shared[b], n)
    kept = [features_by_row[i].path[: shared[i] * PATH_HEX] for i in range(rows)]

    def key(i: int) -> tuple[int, int, str, str, int, int]:
        f = features_by_row[i]
        size = group_size[f.group]
        # Requests whose prefix nobody shares gain nothing from grouping: they go by work only.
        return (0, -size, f.group, kept[i], -f.work, -f.prompt_chars) if size > 1 else \
            (1, 0, "", "", -f.work, -f.prompt_chars)

    return sorted(range(rows), key=key), kept


def plan_shards(features_by_row: Sequence[Features], shard_size: int) -> list[list[int]]:
    """Row indices per shard, in `ordered`'s order. Cuts fall every shard_size rows, moved back (by up to a quarter
    of a shard, within the room the last shard leaves) to where neighbours share the least, so a set of requests
    sharing a prefix stays in one shard where it fits. O(n log n).
    """
    if shard_size < 1:
        raise ValueError("shard_size must be at least 1")
    rows = len(features_by_row)
    order, kept = ordered(features_by_row)
    # Cuts move back only as far as the last shard's spare room: never more shards than plain cutting makes.
    shards, start, spare = [], 0, -rows % shard_size
    while rows - start > shard_size:
        cut = start + shard_size
        window = range(cut, cut - min(shard_size // 4, spare) - 1, -1)
        # The latest of the least-shared boundaries in the window (with nothing shared anywhere: shard_size).
        best = min(window, key=lambda p: _shared(kept[order[p - 1]], kept[order[p]]))
        spare -= cut - best
        shards.append(order[start:best])
        start = best
    if start < rows:
        shards.append(order[start:])
    return shards
