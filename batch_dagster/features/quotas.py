"""Per-key limits: the batches a key has not ended and the bytes it keeps stored, each the key's own
(`batch-dagster keys limits`, db/keys.py), else the deployment's (BATCH_KEY_MAX_ACTIVE_BATCHES,
BATCH_KEY_MAX_STORED_BYTES). Past one, `OverLimit`, which the API answers with a 429 in OpenAI's shape.

Each limit holds where the write it allows is made: the owner's row is locked, the owner's holdings counted and the
new row added in one transaction (`admit`), so parallel creates and uploads of one key queue there and each sees what
the others wrote. A first look without the lock (`refuse_early`, `stored_room`) answers at once when nothing more fits,
before an upload is read or an input copied.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from batch_dagster.batchfile.status import TERMINAL, BatchStatus
from batch_dagster.db.keys import limits_of
from batch_dagster.db.models import ApiKey, BatchRecord, FileRecord
from batch_dagster.db.repo import now
from batch_dagster.settings import Settings

TYPE = "rate_limit_exceeded"
# A batch counts until it has ended, cancelling included: its run is still to come or still going (it stops before
# its next shard; one that had not started lists the requests as cancelled), so a key that creates and cancels at
# once never has more runs on their way than its limit.
ACTIVE = tuple(s for s in BatchStatus if s not in TERMINAL)


class OverLimit(Exception):
    """A key's limit would be passed: the message names it and its setting."""

    def __init__(self, message: str, code: str, param: str | None = None):
        super().__init__(message)
        self.message, self.code, self.param = message, code, param


@dataclass(frozen=True)
class KeyLimits:
    """What one key may hold; None: no limit."""

    max_active_batches: int | None = None
    max_stored_bytes: int | None = None

    @classmethod
    def of(cls, session: Session, owner: str, settings: Settings) -> KeyLimits:
        """The owner's: its key's own, else the deployment's."""
        limits = limits_of(session, owner, settings)
        return cls(limits.max_active_batches, limits.max_stored_bytes)


def active_batches(session: Session, owner: str) -> int:
    """The owner's batches that have not ended: queued, running, finalizing or being cancelled."""
    return session.scalar(select(func.count()).select_from(BatchRecord).where(
        BatchRecord.owner == owner, BatchRecord.status.in_(ACTIVE))) or 0


def stored_bytes(session: Session, owner: str) -> int:
    """The bytes the owner keeps: its files that have not expired (uploads, retry inputs, its batches' output and
    error files) and what its batches' folders hold beside them (each batch's own copy of its input, its working
    files)."""
    files = session.scalar(select(func.coalesce(func.sum(FileRecord.bytes), 0)).where(
        FileRecord.owner == owner, FileRecord.expires_at.is_(None) | (FileRecord.expires_at > now())))
    folders = session.scalar(select(func.coalesce(func.sum(BatchRecord.stored_bytes), 0)).where(
        BatchRecord.owner == owner))
    return int(files or 0) + int(folders or 0)


def lock_owner(session: Session, owner: str) -> None:
    """Hold the owner's row until the session's transaction ends: a write to it, which takes the row's lock on
    PostgreSQL (FOR NO KEY UPDATE, which the rows that reference the owner do not wait for) and the database's one
    write lock on SQLite. Another transaction that locks the same owner waits, and counts after this one commits."""
    session.execute(update(ApiKey).where(ApiKey.owner == owner).values(created_at=ApiKey.created_at))


def _check(limits: KeyLimits, session: Session, owner: str, batches: int, nbytes: int) -> None:
    if batches and limits.max_active_batches is not None \
            and active_batches(session, owner) + batches > limits.max_active_batches:
        raise OverLimit(f"This key has {limits.max_active_batches} batches that have not ended, its limit (its "
                        "own, or else BATCH_KEY_MAX_ACTIVE_BATCHES); create more when some have ended (a batch being "
                        "cancelled counts until its run has stopped).",
                        code="batch_limit_exceeded")
    if limits.max_stored_bytes is not None and stored_bytes(session, owner) + nbytes > limits.max_stored_bytes:
        raise storage_exceeded(limits.max_stored_bytes, param="file" if not batches else "input_file_id")


def storage_exceeded(limit: int, param: str = "file") -> OverLimit:
    """The refusal of a write past the storage limit `limit`."""
    return OverLimit(f"This key's files and batches would keep more than its storage limit of {limit} bytes (its own, "
                     "or else BATCH_KEY_MAX_STORED_BYTES); delete files it no longer needs.",
                     code="storage_limit_exceeded", param=param)


def stored_room(session: Session, owner: str, settings: Settings) -> tuple[int, int] | None:
    """The owner's storage limit and the bytes it may still store under it, 0 at least (no lock: `admit` decides);
    None: no limit. What an upload is held to while it streams in, before anything of it is stored."""
    limit = KeyLimits.of(session, owner, settings).max_stored_bytes
    return None if limit is None else (limit, max(limit - stored_bytes(session, owner), 0))


def refuse_early(limits: KeyLimits, session: Session, owner: str, *, batches: int = 0, nbytes: int = 0) -> None:
    """OverLimit when adding `batches` and `nbytes` would pass a limit as things stand (no lock: `admit` decides)."""
    _check(limits, session, owner, batches, nbytes)


def admit(limits: KeyLimits, session: Session, owner: str, *, batches: int = 0, nbytes: int = 0) -> None:
    """Lock the owner, then OverLimit when adding `batches` and `nbytes` to what it holds would pass a limit. The
    caller adds its rows and commits in this transaction (a rollback releases the lock too)."""
    if limits.max_active_batches is None and limits.max_stored_bytes is None:
        return
    lock_owner(session, owner)
    _check(limits, session, owner, batches, nbytes)


def batch_admission(limits: KeyLimits) -> Callable[[Session, BatchRecord], None]:
    """What db/batches.py create_batch runs before it adds a batch's row: the batch, and what its folder keeps, must
    fit its owner's limits."""
    return lambda session, row: admit(limits, session, row.owner, batches=1, nbytes=row.stored_bytes)


def store_while_running(session: Session, owner: str, batch_id: str, nbytes: int,
                        deployment_max: int | None) -> str | None:
    """Count `nbytes` the running batch `batch_id` keeps in its folder (an image it fetched) against its owner's
    stored-bytes limit, from now on (the batch's folder is measured whole when it ends): None when they fit, and are
    counted; else why not, and nothing is counted. Under the owner's lock, as `admit`."""
    lock_owner(session, owner)
    row = session.get(ApiKey, owner)
    own = None if row is None else row.max_stored_bytes
    limit = deployment_max if own is None else own or None  # the key's own, else the deployment's; 0: no limit
    if limit is not None and stored_bytes(session, owner) + nbytes > limit:
        session.rollback()
        return (f"keeping it would pass this key's storage limit of {limit} bytes (its own, or else "
                "BATCH_KEY_MAX_STORED_BYTES)")
    session.execute(update(BatchRecord).where(BatchRecord.id == batch_id)
                    .values(stored_bytes=BatchRecord.stored_bytes + nbytes))
    session.commit()
    return None
