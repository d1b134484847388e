"""What one owner holds in the store: the counts its limits bound (BATCH_KEY_MAX_ACTIVE_BATCHES and
BATCH_KEY_MAX_STORED_BYTES; the API answers past them)."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from batch_dagster.batchfile.status import TERMINAL

from .models import BatchRecord, FileRecord
from .repo import now


def unfinished_batches(session: Session, owner: str) -> int:
    """The owner's batches that have not ended: queued, running, finalizing or cancelling."""
    return session.scalar(select(func.count()).select_from(BatchRecord).where(
        BatchRecord.owner == owner, BatchRecord.status.not_in(TERMINAL))) or 0


def stored_bytes(session: Session, owner: str) -> int:
    """The bytes of the owner's files that are kept: uploads and its batches' output and error files, unexpired."""
    return int(session.scalar(select(func.coalesce(func.sum(FileRecord.bytes), 0)).where(
        FileRecord.owner == owner, FileRecord.expires_at.is_(None) | (FileRecord.expires_at > now()))) or 0)
