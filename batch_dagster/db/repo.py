"""Queries and writes on the store, scoped by owner: what the API and the sensors ask of it."""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar, cast

from sqlalchemy import ColumnElement, CursorResult, case, exists, func, select, type_coerce, update
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Session

from batch_dagster.batchfile.folder import BatchFolder
from batch_dagster.batchfile.status import TERMINAL, BatchStatus
from batch_dagster.batchfile.storage import Storage
from batch_dagster.storage import file_location

from .models import ApiKey, BatchRecord, FileRecord, IntakeRecord, WebhookEndpointRecord

ANONYMOUS = "anonymous"
Row = TypeVar("Row", FileRecord, BatchRecord, WebhookEndpointRecord)


def now() -> int:
    return int(time.time())


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex}"


def owner_of_key(api_key: str) -> str:
    """The owner a key's files and batches are stored under: its SHA-256, never the key."""
    return hashlib.sha256(api_key.encode()).hexdigest()


def ensure_owners(session: Session, owners: Sequence[str]) -> None:
    known = set(session.scalars(select(ApiKey.owner).where(ApiKey.owner.in_(owners))))
    session.add_all(ApiKey(owner=o, created_at=now()) for o in owners if o not in known)
    session.commit()


def page(session: Session, model: type[Row], owner: str, after: str | None, limit: int, *, ascending: bool = False,
          extra=()) -> tuple[list[Row], bool] | None:
    """A page of an owner's rows, newest first, after the row with id `after`; None when `after` is unknown."""
    query = select(model).where(model.owner == owner, *extra)
    if after is not None:
        anchor = session.scalar(select(model.pk).where(model.owner == owner, model.id == after))
        if anchor is None:
            return None
        query = query.where(model.pk > anchor if ascending else model.pk < anchor)
    query = query.order_by(model.pk.asc() if ascending else model.pk.desc()).limit(limit + 1)
    rows = list(session.scalars(query))
    return rows[:limit], len(rows) > limit


def get_file(session: Session, owner: str, file_id: str) -> FileRecord | None:
    row = session.scalar(select(FileRecord).where(FileRecord.owner == owner, FileRecord.id == file_id))
    if row is not None and row.expires_at is not None and row.expires_at <= now():
        return None
    return row


def list_files(session: Session, owner: str, *, after: str | None, limit: int, ascending: bool,
               purpose: str | None) -> tuple[list[FileRecord], bool] | None:
    extra: list[ColumnElement[bool]] = [(FileRecord.expires_at.is_(None)) | (FileRecord.expires_at > now())]
    if purpose:
        extra.append(FileRecord.purpose == purpose)
    return page(session, FileRecord, owner, after, limit, ascending=ascending, extra=extra)


def expired_files(session: Session, limit: int = 500) -> list[FileRecord]:
    return list(session.scalars(select(FileRecord).where(FileRecord.expires_at <= now()).limit(limit)))


def get_batch(session: Session, owner: str, batch_id: str) -> BatchRecord | None:
    return session.scalar(select(BatchRecord).where(BatchRecord.owner == owner, BatchRecord.id == batch_id))


@dataclass(frozen=True)
class BatchFilter:
    """Which of an owner's batches a list shows: a status, metadata pairs (all must match), a creation time in
    [created_after, created_before)."""

    status: str | None = None
    metadata: Mapping[str, str] = field(default_factory=dict)
    created_after: int | None = None
    created_before: int | None = None

    def where(self, dialect: str) -> list[ColumnElement[bool]]:
        clauses = [_metadata_is(dialect, key, value) for key, value in self.metadata.items()]
        if self.status is not None:
            clauses.append(BatchRecord.status == self.status)
        if self.created_after is not None:
            clauses.append(BatchRecord.created_at >= self.created_after)
        if self.created_before is not None:
            clauses.append(BatchRecord.created_at < self.created_before)
        return clauses


def _metadata_is(dialect: str, key: str, value: str) -> ColumnElement[bool]:
    """The batch's metadata holds key: value. On PostgreSQL as jsonb containment, which its GIN index answers
    (ix_batches_metadata). SQLite's JSON paths miss keys with quotes or non-ASCII characters, so there the pairs are
    read with json_each, which decodes every key."""
    if dialect == "postgresql":
        return type_coerce(BatchRecord.meta, JSONB).contains({key: value})
    if dialect != "sqlite":
        return BatchRecord.meta[key].as_string() == value
    pairs = func.json_each(BatchRecord.meta).table_valued("key", "value")
    return exists(select(1).select_from(pairs).where(pairs.c.key == key, pairs.c.value == value))


def list_batches(
    session: Session, owner: str, *, after: str | None, limit: int, where: BatchFilter = BatchFilter()
) -> tuple[list[BatchRecord], bool] | None:
    return page(session, BatchRecord, owner, after, limit, extra=where.where(session.get_bind().dialect.name))


def _unfinished(session: Session, *, launched: bool, limit: int, after: int | None = None) -> list[BatchRecord]:
    launch = BatchRecord.launched_at.is_not(None) if launched else BatchRecord.launched_at.is_(None)
    query = select(BatchRecord).where(launch, BatchRecord.status.not_in(TERMINAL))
    if after is not None:
        query = query.where(BatchRecord.pk > after)
    return list(session.scalars(query.order_by(BatchRecord.pk).limit(limit)))


def batches_to_launch(session: Session, limit: int = 100) -> list[BatchRecord]:
    """Batches Dagster has not been asked to run yet, or to run again; a cancelled one runs too."""
    return _unfinished(session, launched=False, limit=limit)


def mark_launched(session: Session, batch_ids: Sequence[str], at: int | None = None) -> None:
    session.execute(update(BatchRecord).where(BatchRecord.id.in_(batch_ids)).values(launched_at=at or now()))
    session.commit()


def unmark_launched(session: Session, batch_id: str) -> None:
    session.execute(update(BatchRecord).where(BatchRecord.id == batch_id).values(launched_at=None))
    session.commit()


def active_batches(session: Session, limit: int = 1000, after: int | None = None) -> list[BatchRecord]:
    """Launched batches that have not reached a terminal status, oldest first (after the one whose pk is `after`)."""
    return _unfinished(session, launched=True, limit=limit, after=after)


def active_batches_by_id(session: Session, batch_ids: Collection[str], chunk: int = 500) -> list[BatchRecord]:
    """Those of `batch_ids` that are launched batches and have not reached a terminal status, oldest first."""
    ids, found = sorted(batch_ids), list[BatchRecord]()
    for i in range(0, len(ids), chunk):  # a bounded IN list per query, whatever the store's parameter limit
        found += session.scalars(select(BatchRecord).where(
            BatchRecord.id.in_(ids[i:i + chunk]), BatchRecord.launched_at.is_not(None),
            BatchRecord.status.not_in(TERMINAL)))
    return sorted(found, key=lambda b: b.pk)


def request_cancel(session: Session, batch: BatchRecord, at: int | None = None) -> bool:
    """Move a batch to `cancelling` unless it already ended or is cancelling; False then."""
    # An UPDATE without RETURNING gives a CursorResult (typed as a plain Result), which has the rowcount.
    result = cast(CursorResult, session.execute(
        update(BatchRecord)
        .where(BatchRecord.id == batch.id, BatchRecord.status.not_in(TERMINAL), BatchRecord.cancelling_at.is_(None))
        .values(status=BatchStatus.CANCELLING, cancelling_at=at or now())
    ))
    session.commit()
    session.refresh(batch)
    return result.rowcount == 1


def add_file(session: Session, row: FileRecord) -> FileRecord:
    session.add(row)
    session.commit()
    return row


def delete_file(session: Session, storage: Storage, row: FileRecord) -> None:
    """Forget a file and remove its bytes, unless they are a batch's own input: a command-line batch's File is
    its folder's copy, which a re-run of the batch reads again."""
    inputs = {BatchFolder(storage, b).input_key for b in
              session.scalars(select(BatchRecord.id).where(BatchRecord.input_file_id == row.id))}
    session.delete(row)
    session.commit()
    if row.path not in inputs:
        files, key = file_location(storage, row.path)
        files.delete(key)


def ended_at() -> ColumnElement[int]:
    """A batch's end: the timestamp of its terminal status (NULL while it has not ended)."""
    return case(*((BatchRecord.status == status, getattr(BatchRecord, f"{status}_at")) for status in TERMINAL))


def finished_between(session: Session, start: int, end: int) -> list[BatchRecord]:
    """Batches whose end is in [start, end), in creation order."""
    at = ended_at()
    query = select(BatchRecord).where(BatchRecord.status.in_(TERMINAL), at >= start, at < end)
    return list(session.scalars(query.order_by(BatchRecord.pk)))


def known_sources(session: Session, sources: Sequence[str]) -> set[tuple[str, str]]:
    """The (source, version) pairs among `sources` that already became batches."""
    if not sources:
        return set()
    rows = session.execute(select(IntakeRecord.source, IntakeRecord.version).where(IntakeRecord.source.in_(sources)))
    return {(source, version) for source, version in rows}


def get_intake(session: Session, batch_id: str) -> tuple[IntakeRecord, BatchRecord] | None:
    """A dropped file's intake row and its batch."""
    row = session.execute(
        select(IntakeRecord, BatchRecord).join(BatchRecord, BatchRecord.id == IntakeRecord.batch_id)
        .where(IntakeRecord.batch_id == batch_id)
    ).first()
    return (row[0], row[1]) if row else None


def mark_delivered(session: Session, batch_id: str) -> None:
    session.execute(update(IntakeRecord).where(IntakeRecord.batch_id == batch_id).values(delivered_at=now()))
    session.commit()


def undelivered(session: Session, scheme: str, limit: int = 100) -> list[IntakeRecord]:
    """Dropped files from `scheme` (e.g. "s3://") whose batch ended and whose results were not yet requested."""
    query = (
        select(IntakeRecord)
        .join(BatchRecord, BatchRecord.id == IntakeRecord.batch_id)
        .where(IntakeRecord.delivery_requested_at.is_(None), IntakeRecord.source.startswith(scheme),
               BatchRecord.status.in_(TERMINAL))
        .order_by(IntakeRecord.pk)
        .limit(limit)
    )
    return list(session.scalars(query))


def mark_delivery_requested(session: Session, batch_ids: Sequence[str]) -> None:
    session.execute(update(IntakeRecord).where(IntakeRecord.batch_id.in_(batch_ids)).values(delivery_requested_at=now()))
    session.commit()
