"""Which ended batches are past retention, in the order they ended, and which of their folder's files the store still
serves; and the store's first batch, where the daily report starts. The batch row itself is never deleted: the API
answers for it and the daily report counts it.

No column records a purge: the retention sensor walks the batches by their end, (end, pk) after its cursor, and
every delete it makes is idempotent, so a lost cursor costs a pass over the ended batches again, never a wrong delete.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import and_, create_engine, make_url, or_, select, update
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from batch_dagster.batchfile.folder import BatchFolder
from batch_dagster.batchfile.status import TERMINAL
from batch_dagster.db import repo
from batch_dagster.db.models import BatchRecord, FileRecord


@dataclass(frozen=True)
class Ended:
    """An ended batch, and where it is in the order of ends: (ended_at, pk)."""

    batch_id: str
    ended_at: int
    pk: int


def ended_before(session: Session, cutoff: int, *, after: tuple[int, int] | None = None,
                 limit: int = 100) -> list[Ended]:
    """Batches that ended at or before `cutoff`, after the (ended_at, pk) `after`, the earliest end first."""
    end = repo.ended_at()
    query = select(BatchRecord.id, end, BatchRecord.pk).where(BatchRecord.status.in_(TERMINAL), end <= cutoff)
    if after is not None:
        query = query.where(or_(end > after[0], and_(end == after[0], BatchRecord.pk > after[1])))
    rows = session.execute(query.order_by(end, BatchRecord.pk).limit(limit))
    return [Ended(batch_id, int(at), pk) for batch_id, at, pk in rows]


def served_keys(session: Session, folder: BatchFolder) -> set[str]:
    """The folder's objects that are the bytes of a File the API still serves (not expired): they stay."""
    keys = [folder.input_key, folder.output_key, folder.error_key]
    live = (FileRecord.expires_at.is_(None)) | (FileRecord.expires_at > repo.now())
    return set(session.scalars(select(FileRecord.path).where(FileRecord.path.in_(keys), live)))


def record_stored_bytes(session: Session, batch_id: str, nbytes: int) -> None:
    """What the batch's folder keeps once retention cleared it (lifecycle.folder_bytes), for its key's limit."""
    session.execute(update(BatchRecord).where(BatchRecord.id == batch_id).values(stored_bytes=nbytes))
    session.commit()


def first_created_at(session: Session) -> int | None:
    """When the store's first batch was created (the lowest pk: one row read by the primary key)."""
    return session.scalar(select(BatchRecord.created_at).order_by(BatchRecord.pk).limit(1))


def first_batch_created_at(url: str) -> int | None:
    """When the first batch of the store at `url` was created, read without side effects (no file created, no
    migration run); None when the store is empty, not made yet or unreachable within 2 seconds."""
    if url.startswith("sqlite"):
        database = make_url(url).database
        if not database or database == ":memory:" or not Path(database).is_file():
            return None
    connect_args = {"connect_timeout": 2} if url.startswith("postgres") else {}
    try:
        engine = create_engine(url, connect_args=connect_args)
    except Exception:  # a URL or driver the store could not open either: its own errors say so when it is used
        return None
    try:
        with Session(engine) as session:
            return first_created_at(session)
    except SQLAlchemyError:
        return None
    finally:
        engine.dispose()
