"""Dropped files become batches: the same File and Batch rows an API upload makes, plus where results go."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.orm import Session

from batch_dagster.batchfile.contract import endpoint_of_head
from batch_dagster.resources.storage import BatchStorage

from . import repo
from .models import BatchRecord, FileRecord, IntakeRecord


HEAD_BYTES = 64 * 1024  # enough for a file's first request, whose url names the endpoint


@dataclass(frozen=True)
class DroppedFile:
    """A complete file found in a bucket or the inbox."""

    source: str  # s3://bucket/key or file:///path
    version: str  # ETag, or size and mtime
    filename: str
    bytes: int
    endpoint: str  # from its first line, so the batch lists with the right endpoint before validation


def _add_batch(session: Session, *, owner: str, file_path: Path, filename: str, size: int, endpoint: str,
               source: str, expires_at: int | None, batch_id: str | None = None) -> BatchRecord:
    """The File and Batch rows of a batch that is launched already (its run is requested by the caller)."""
    repo.ensure_owners(session, [owner])
    created_at = repo.now()
    file_id = repo.new_file_id()
    session.add(FileRecord(id=file_id, owner=owner, bytes=size, created_at=created_at, expires_at=None,
                           filename=filename, purpose="batch", path=str(file_path)))
    batch = BatchRecord(
        id=batch_id or repo.new_batch_id(), owner=owner, endpoint=endpoint, input_file_id=file_id,
        completion_window="24h", status="validating", created_at=created_at, expires_at=expires_at,
        meta={"source": source[:512]}, launched_at=created_at,
    )
    session.add(batch)
    session.flush()
    return batch


def register_batch(session: Session, storage: BatchStorage, dropped: DroppedFile, *, owner: str, deliver_to: str,
                   files_dir: Path, completion_window_s: int) -> BatchRecord:
    """Record a dropped file and its batch under `owner`; the sensor requests the run itself.

    Its bytes are fetched by the run (batch_input), so a sensor tick stays small whatever the file's size.
    """
    expires_at = repo.now() + completion_window_s
    file_path = files_dir / f"{repo.new_file_id()}.jsonl"
    batch = _add_batch(session, owner=owner, file_path=file_path, filename=dropped.filename, size=dropped.bytes,
                       endpoint=dropped.endpoint, source=dropped.source, expires_at=expires_at)
    storage.set_source(batch.id, dropped.source, file_path)
    storage.set_deadline(batch.id, expires_at)
    session.add(IntakeRecord(source=dropped.source, version=dropped.version, batch_id=batch.id,
                             deliver_to=deliver_to.rstrip("/") + f"/{batch.id}/", created_at=batch.created_at))
    session.commit()
    return batch


def record_local_batch(session: Session, storage: BatchStorage, batch_id: str, source: Path, *, owner: str,
                       files_dir: Path) -> BatchRecord:
    """Record a batch started from the command line, whose input is already in its folder (no deadline)."""
    file_path = files_dir / f"{repo.new_file_id()}.jsonl"
    file_path.parent.mkdir(parents=True, exist_ok=True)
    input_path = storage.input_path(batch_id)
    try:
        os.link(input_path, file_path)  # the File's bytes without a second copy; deleting it keeps the batch's
    except OSError:
        shutil.copyfile(input_path, file_path)
    with open(input_path, "rb") as f:
        endpoint = endpoint_of_head(f.read(HEAD_BYTES))
    batch = _add_batch(session, owner=owner, file_path=file_path, filename=source.name, size=file_path.stat().st_size,
                       endpoint=endpoint, source=source.resolve().as_uri(), expires_at=None, batch_id=batch_id)
    session.commit()
    return batch

STATUS_TIMES = ("created_at", "in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
                "cancelled_at")


def result_summary(batch: BatchRecord, intake: IntakeRecord, cost: dict | None, files: list[str]) -> dict:
    """The summary.json written beside a dropped file's results: the batch as the API shows it, and its cost."""
    return {
        "id": batch.id,
        "source": intake.source,
        "status": batch.status,
        "endpoint": batch.endpoint,
        "model": batch.model,
        "request_counts": {"total": batch.request_total, "completed": batch.request_completed,
                           "failed": batch.request_failed},
        "usage": batch.usage,
        "cost": cost,
        "errors": batch.errors,
        "files": files,
        **{name: getattr(batch, name) for name in STATUS_TIMES if getattr(batch, name) is not None},
    }
