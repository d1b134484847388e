"""Dropped files become batches: the same File and Batch rows an API upload makes, plus where results go."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.orm import Session

from batch_dagster.resources.storage import BatchStorage

from . import repo
from .models import BatchRecord, FileRecord, IntakeRecord


@dataclass(frozen=True)
class DroppedFile:
    """A complete file found in a bucket or the inbox."""

    source: str  # s3://bucket/key or file:///path
    version: str  # ETag, or size and mtime
    filename: str
    bytes: int
    endpoint: str  # from its first line, so the batch lists with the right endpoint before validation


def register_batch(session: Session, storage: BatchStorage, dropped: DroppedFile, *, owner: str, deliver_to: str,
                   files_dir: Path, completion_window_s: int) -> BatchRecord:
    """Record the file and its batch under `owner`, already launched: the sensor requests the run itself.

    Its bytes are fetched by the run (batch_input), so a sensor tick stays small whatever the file's size.
    """
    repo.ensure_owners(session, [owner])
    created_at = repo.now()
    batch_id, file_id = repo.new_batch_id(), repo.new_file_id()
    file_path = files_dir / f"{file_id}.jsonl"
    storage.set_source(batch_id, dropped.source, file_path)
    storage.set_deadline(batch_id, created_at + completion_window_s)
    session.add(FileRecord(id=file_id, owner=owner, bytes=dropped.bytes, created_at=created_at, expires_at=None,
                           filename=dropped.filename, purpose="batch", path=str(file_path)))
    batch = BatchRecord(
        id=batch_id, owner=owner, endpoint=dropped.endpoint, input_file_id=file_id, completion_window="24h",
        status="validating", created_at=created_at, expires_at=created_at + completion_window_s,
        meta={"source": dropped.source[:512]}, launched_at=created_at,
    )
    session.add(batch)
    session.flush()  # the batch row before the intake row that refers to it
    session.add(IntakeRecord(source=dropped.source, version=dropped.version, batch_id=batch_id,
                             deliver_to=deliver_to.rstrip("/") + f"/{batch_id}/", created_at=created_at))
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
