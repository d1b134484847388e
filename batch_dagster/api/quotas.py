"""Per-key limits: batches not yet ended, and bytes of files kept. Past one, a 429 in OpenAI's shape with its own
code (`batch_limit_exceeded`, `storage_limit_exceeded`), so one key cannot fill the queue or the storage. Each limit
is the key's own (`batch-dagster keys limits`), else the deployment's (BATCH_KEY_*)."""

from __future__ import annotations

from sqlalchemy.orm import Session

from batch_dagster.db.keys import limits_of
from batch_dagster.db.quotas import stored_bytes, unfinished_batches
from batch_dagster.settings import Settings

from .errors import ApiError

TYPE = "rate_limit_exceeded"


def check_batches(config: Settings, session: Session, owner: str) -> None:
    """ApiError 429 when the owner already has as many batches that have not ended as its limit."""
    limit = limits_of(session, owner, config).max_active_batches
    if limit is not None and unfinished_batches(session, owner) >= limit:
        raise ApiError(429, f"This key has {limit} batches that have not ended, its limit (its own, or else "
                       "BATCH_KEY_MAX_ACTIVE_BATCHES); create more when some have ended, or cancel some.",
                       type=TYPE, code="batch_limit_exceeded")


def stored_bytes_room(config: Settings, session: Session, owner: str) -> int | None:
    """The bytes the owner may still store (None: no limit); ApiError 429 when there is no room left."""
    limit = limits_of(session, owner, config).max_stored_bytes
    if limit is None:
        return None
    room = limit - stored_bytes(session, owner)
    if room <= 0:
        raise stored_bytes_full(limit)
    return room


def stored_bytes_full(limit: int) -> ApiError:
    return ApiError(429, f"This key's files would take more than its storage limit of {limit} bytes (its own, or "
                    "else BATCH_KEY_MAX_STORED_BYTES); delete files it no longer needs.",
                    type=TYPE, param="file", code="storage_limit_exceeded")
