"""Idempotent creates: with an `Idempotency-Key` header, a repeat of a create by the same owner answers the object
the first request made, and the same key sent with another request is a 409 naming the conflict.

A create route takes `Once` and hands its work to `Once.run` (docs/http-api.md#idempotency).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Header, Request
from sqlalchemy.orm import Session

from batch_dagster.db import idempotency
from batch_dagster.db.idempotency import Used
from batch_dagster.db.models import MAX_IDEMPOTENCY_KEY

from .deps import Context, Owner
from .errors import ApiError, clip, invalid

HEADER = "Idempotency-Key"
VALID_KEY = re.compile(f"[ -~]{{1,{MAX_IDEMPOTENCY_KEY}}}")  # printable ASCII
T = TypeVar("T")
Claim = Callable[[Session, str], None]  # claim(session, id of the object being made), before it is added


def valid_key(text: str | None) -> bool:
    return text is not None and VALID_KEY.fullmatch(text) is not None


def fingerprint(route: str, *parts: Any) -> str:
    """The SHA-256 of a create's route and what its request asked (JSON, keys sorted): equal for equal requests."""
    text = json.dumps([route, *parts], sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _no_claim(_session: Session, _object_id: str) -> None:
    return None


@dataclass(frozen=True)
class Once:
    """A create's idempotency: its owner, the key it sent (None: none, and the create is a plain one), how long keys
    are kept."""

    owner: str
    key: str | None
    ttl_s: int

    def run(self, session: Session, route: str, asked: str, *, create: Callable[[Claim], T],
            found: Callable[[str], T]) -> T:
        """The answer to a create on `route` whose request has the fingerprint `asked`.

        With a key sent before (and kept): `found(id)` of the object it made, when it came with this route and
        request; else a 409. With a new key: `create(claim)`, which calls `claim(session, object_id)` in the
        transaction that adds the object, once its slow work is done and before its limits are counted (quotas'
        `admit`), and commits. When another request took the key meanwhile, the create's error (its `Taken`, or a
        limit that request's object now fills) gives way to that request's answer: the caller's own error
        handling has rolled back what it wrote.
        """
        if self.key is None:
            return create(_no_claim)
        key = self.key
        sent = Used(route, asked, "")
        if (first := idempotency.find(session, self.owner, key)) is not None:
            return self._answer(first, sent, found)

        def claim(claiming: Session, object_id: str) -> None:
            idempotency.claim(claiming, self.owner, key, Used(route, asked, object_id), self.ttl_s)

        try:
            return create(claim)
        except Exception:
            session.rollback()
            if (first := idempotency.find(session, self.owner, key)) is None:
                raise
        return self._answer(first, sent, found)

    def _answer(self, first: Used, sent: Used, found: Callable[[str], T]) -> T:
        if first.route != sent.route:
            raise reused(f"{HEADER} {clip(self.key)!r} was sent with a {first.route} request; a key stands for one "
                         "request: send a new key with this one.")
        if first.fingerprint != sent.fingerprint:
            raise reused(f"{HEADER} {clip(self.key)!r} was sent with another {sent.route} request, whose body "
                         f"differs from this one; a key stands for one request (kept {self.ttl_s} s): send the same "
                         "body to get its object, or a new key to create another.")
        return found(first.object_id)


def reused(message: str) -> ApiError:
    return ApiError(409, message, param=HEADER, code="idempotency_key_reused")


def gone(kind: str, object_id: str) -> ApiError:
    """The answer to a repeat whose object was deleted (or expired) since."""
    return ApiError(404, f"The {kind} {object_id} that a request with this {HEADER} created is gone (deleted or "
                    "expired); send a new key to create another.", param=HEADER, code="not_found")


def get_once(request: Request, ctx: Context, owner: Owner, idempotency_key: Annotated[str | None, Header(
        alias=HEADER, description="Makes the create idempotent for 24 h (BATCH_IDEMPOTENCY_TTL_S): a repeat with "
        "the same key and body answers the object the first made; the same key with another body is a 409.",
        json_schema_extra={"pattern": f"^[ -~]{{1,{MAX_IDEMPOTENCY_KEY}}}$"})] = None) -> Once:
    """The request's Once; a 400 at param Idempotency-Key when the header is not 1 to 255 printable ASCII
    characters, or is sent twice."""
    if idempotency_key is not None:
        if len(request.headers.getlist(HEADER)) > 1:
            raise invalid(f"{HEADER} was sent more than once; send one.", param=HEADER,
                          code="invalid_idempotency_key")
        if not valid_key(idempotency_key):
            raise invalid(f"{HEADER} must be 1 to {MAX_IDEMPOTENCY_KEY} printable ASCII characters; this one has "
                          f"{len(idempotency_key)} characters, or others.", param=HEADER,
                          code="invalid_idempotency_key")
    return Once(owner, idempotency_key, ctx.config.idempotency_ttl_s)


Idempotent = Annotated[Once, Depends(get_once)]
