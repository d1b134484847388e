"""Sharding: order requests so shared prefixes run together and the longest work goes first, then cut.

Requests that share a system prompt (or the same opening text) form a group; inside it,
requests that share a longer leading text (a document asked several questions) sit together,
so one shard holds them all and the engine's prefix cache computes that text once. The longest expected work goes
first (the most output tokens asked, then the longest prompt): the group holding the longest request, and within
what requests share, the longest of them. So the batch's tail is its shortest requests, not a few long ones
running alone on an engine sized for hundreds. Cuts fall where the least is shared.

When a shard runs, its requests go in the same order, each group's output asked weighed by the share of it that
the group's requests in the batch's earlier shards wrote (`OutputShares`): a group that writes a tenth of its
max_tokens runs after one that writes all of it (`running_order`).
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import anthropic
from . import contract as c
from .responses import chat_body
from .usage import Usage

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
ALL_GROUPS = ""  # OutputShares' key for the share of every group seen: a group not seen yet is taken at it


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

    def work(self, shares: Mapping[str, float] | None = None) -> int:
        """Its expected work, in tokens: the output asked for (times the share of it its group was seen to write,
        `OutputShares.shares`), and the prompt at about CHARS_PER_TOKEN a token."""
        share = shares.get(self.group, shares.get(ALL_GROUPS, 1.0)) if shares else 1.0
        return round(self.max_tokens * share) + self.prompt_chars // CHARS_PER_TOKEN

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
    if endpoint not in (c.CHAT, c.COMPLETIONS, c.MESSAGES):
        return 0
    asked = body.get("max_completion_tokens", body.get("max_tokens"))
    if isinstance(asked, int) and not isinstance(asked, bool) and asked > 0:
        return min(asked, UNBOUNDED_OUTPUT_TOKENS)
    return UNBOUNDED_OUTPUT_TOKENS if endpoint == c.CHAT else c.COMPLETIONS_MAX_TOKENS


def features(endpoint: str, body: dict[str, Any]) -> Features:
    """Prompt size, prefix and output asked of one request body (already validated)."""
    if endpoint == c.RESPONSES:  # runs as its chat body, so it groups as one
        endpoint, body = c.CHAT, chat_body(body)
    elif endpoint == c.MESSAGES:  # vLLM's Messages layer runs it as its chat body too
        endpoint, body = c.CHAT, anthropic.chat_body(body)
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


def ordered(features_by_row: Sequence[Features], shares: Mapping[str, float] | None = None,
            ) -> tuple[list[int], list[str]]:
    """Row indices in running order, and each row's shared path: prefix groups together, the longest work first.

    Expected work is Features.work, with the output `shares` seen so far. A prefix group runs as one block (a request
    whose prefix nobody shares is a block of its own), the block holding the longest request first (the larger on a
    tie). Within a group, requests go by the longest leading text they share with another request (a trie's order:
    every prefix's requests are contiguous), then by work, the most first. O(n log n).
    """
    rows = len(features_by_row)
    group_size: dict[str, int] = {}
    longest: dict[str, int] = {}
    work = [f.work(shares) for f in features_by_row]
    for f, w in zip(features_by_row, work, strict=True):
        group_size[f.group] = group_size.get(f.group, 0) + 1
        longest[f.group] = max(longest.get(f.group, 0), w)
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
        return -longest[f.group], -group_size[f.group], f.group, kept[i], -work[i], -f.prompt_chars

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


def request_features(endpoint: str, body: dict[str, Any]) -> Features:
    """`features` of a body as it reaches an engine; one that is mistyped (its 400 line comes from the engine's
    checks) orders as an empty request."""
    try:
        return features(endpoint, body)
    except (AttributeError, KeyError, TypeError):
        return Features(0, "")


def running_order(endpoint: str, requests: Sequence[tuple[str, dict[str, Any]]],
                  shares: Mapping[str, float] | None = None) -> list[int]:
    """The order a shard's requests (custom_id, body) run in: `ordered`'s, with the output shares seen so far."""
    order, _ = ordered([request_features(endpoint, body) for _, body in requests], shares)
    return order


@dataclass
class OutputShares:
    """How much of the output they asked for the requests of each prefix group wrote, over a batch's shards run so
    far: what `ordered` weighs a group's max_tokens by in the shards after them."""

    asked: dict[str, int] = field(default_factory=dict)
    written: dict[str, int] = field(default_factory=dict)

    def add(self, endpoint: str, requests: Sequence[tuple[str, dict[str, Any]]], lines: Sequence[dict[str, Any]]
            ) -> None:
        """A shard's requests and their lines: each answered request's output tokens against the output it asked."""
        bodies = dict(requests)
        for line in lines:
            response = line.get("response") or {}
            body = bodies.get(str(line.get("custom_id")))
            if body is None or response.get("status_code") != 200:
                continue
            f, usage = request_features(endpoint, body), Usage()
            usage.add_body(response.get("body") or {})
            for group in (f.group, ALL_GROUPS):
                self.asked[group] = self.asked.get(group, 0) + f.max_tokens
                self.written[group] = self.written.get(group, 0) + usage.output_tokens

    def shares(self) -> dict[str, float]:
        """Per group (and ALL_GROUPS), the output written over the output asked."""
        return {g: self.written[g] / asked for g, asked in self.asked.items() if asked > 0}
