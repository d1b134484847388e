"""Whose cached work a batch's requests touch: the scope its kept answers and its prompts' prefix-cache entries are
keyed by, so that no answer and no cached prompt prefix crosses owners unless the operator shares them.

An owner is an API key's owner (its key's SHA-256) or a table batch's namespace. Each is a scope of its own; the
owners the operator lists in BATCH_SHARED_OWNERS (by name, or `*` for all) share one.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from batch_dagster.batchfile.schema import CLIENT_SALT
from batch_dagster.features.shards import Line, Request, Run, Shard, ShardFeature

SHARED = "shared"  # the one scope of the owners the operator lets share
EVERYONE = "*"  # in BATCH_SHARED_OWNERS: every owner shares
TABLE = "table:"  # a table batch's owner is its namespace, after this
_CLIENT_SALT = re.compile(CLIENT_SALT)


@dataclass(frozen=True)
class Owner:
    """Who a batch belongs to: the owner its rows are stored under (`id`; empty: not known) and the name the operator
    knows it by (an API key's name, a table batch's namespace)."""

    id: str = ""
    name: str = ""

    @classmethod
    def of_table(cls, namespace: str) -> Owner:
        return cls(TABLE + namespace, namespace)


def scope(owner: Owner, shared: Iterable[str], batch_id: str) -> str:
    """The scope of a batch of `owner`: the shared one when the operator lists the owner (or `*`), else the owner's
    own. A batch whose owner is not known shares nothing beyond itself."""
    if not owner.id:
        return f"batch:{batch_id}"
    names = set(shared)
    if EVERYONE in names or (owner.name and owner.name in names):
        return SHARED
    return f"owner:{owner.id}"


def cache_salt(scope_: str, secret: str, client_salt: str | None = None) -> str:
    """vLLM's cache_salt for a request of `scope_`: a keyed hash of the scope (and of the request's own cache_salt,
    which so partitions the prefix cache only within its owner's part of it). 64 hex digits, which vLLM takes."""
    message = f"{scope_}\0{client_salt or ''}".encode()
    return hmac.new(b"batch-dagster cache_salt\0" + secret.encode(), message, hashlib.sha256).hexdigest()


def salted(requests: Sequence[Request], scope_: str, secret: str) -> list[Request]:
    """The requests as the engine gets them: each with its scope's cache_salt, so a prefix-cache hit never crosses
    scopes. A body whose own cache_salt is not one vLLM takes keeps it, and is refused at its line, never sent."""
    out = []
    for custom_id, body in requests:
        own = body.get("cache_salt")
        if own is None or (isinstance(own, str) and _CLIENT_SALT.fullmatch(own)):
            body = {**body, "cache_salt": cache_salt(scope_, secret, own)}
        out.append((custom_id, body))
    return out


class Salt(ShardFeature):
    """Each request the engine gets salted with its batch's scope's cache_salt: no prefix-cache hit crosses scopes."""

    def __init__(self, scope_: str, secret: str):
        self.scope, self.secret = scope_, secret

    def run(self, shard: Shard, requests: list[Request], then: Run) -> list[Line]:
        return then(salted(requests, self.scope, self.secret))
