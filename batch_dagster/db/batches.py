"""How a batch record is made, whoever makes it: the API, the S3/inbox intake, `batch-dagster run` or a retry, each
with the BatchRequest it built.

The invariant lives here: the batch's input (or where to fetch it), deadline and request are in its folder before its
row exists, so nothing that lists rows ever sees half a batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from batch_dagster.batchfile.contract import (
    CHAT,
    MAX_FILENAME_CHARS,
    MAX_SOURCE_CHARS,
    MAX_VERSION_CHARS,
    BatchError,
    endpoint_of_head,
    model_of_head,
)
from batch_dagster.batchfile.folder import BatchFolder, file_key
from batch_dagster.batchfile.options import BatchRequest
from batch_dagster.batchfile.outcome import BatchOutcome
from batch_dagster.batchfile.status import BatchStatus
from batch_dagster.batchfile.storage import Storage
from batch_dagster.batchfile.usage import Cost, Usage
from batch_dagster.batchfile.windows import Window
from batch_dagster.storage import file_location

from . import repo
from .models import BatchRecord, FileRecord, IntakeRecord

HEAD_BYTES = 64 * 1024  # enough for a file's first request, whose url names the endpoint and body the model


@dataclass(frozen=True)
class DroppedFile:
    """A complete file found in a bucket or the inbox."""

    source: str  # s3://bucket/key or file:///path
    version: str  # ETag, or size and mtime
    filename: str
    bytes: int
    endpoint: str  # from its first line, so the batch lists with the right endpoint before validation
    model: str | None = None  # from its first line, so its run is queued by its model (defs/run_limits.py)


def head_model(head: bytes) -> str | None:
    """The model a file's first request names, from its first HEAD_BYTES (the whole file when shorter)."""
    return model_of_head(head, whole=len(head) < HEAD_BYTES)


def scan(input_path: Path) -> tuple[bytes, int]:
    """A local input's first HEAD_BYTES and its number of lines (its requests, until validation counts them)."""
    lines, last = 0, b"\n"
    with open(input_path, "rb") as f:
        head = f.read(HEAD_BYTES)
        chunk = head
        while chunk:
            lines += chunk.count(b"\n")
            last = chunk[-1:]
            chunk = f.read(1 << 20)
    return head, lines + (last != b"\n")  # a last line without its newline counts


def _stored_head(storage: Storage, path: str) -> bytes | None:
    """The first HEAD_BYTES of a stored File; None when it cannot be read (validation then reports it)."""
    files, key = file_location(storage, path)
    try:
        with files.open(key) as f:
            return f.read(HEAD_BYTES)
    except OSError:
        return None


def add_input_file(session: Session, *, owner: str, file_id: str, filename: str, size: int,
                   expires_at: int | None = None, path: str | None = None) -> FileRecord:
    """A File row with purpose `batch` whose bytes are (or will be) at `path` (by default its key in the storage)."""
    repo.ensure_owners(session, [owner])
    row = FileRecord(id=file_id, owner=owner, bytes=size, created_at=repo.now(), expires_at=expires_at,
                     filename=filename, purpose="batch", path=path or file_key(file_id))
    session.add(row)
    session.flush()
    return row


def create_batch(session: Session, storage: Storage, request: BatchRequest, input_from: Path | str | FileRecord | None,
                 *, admit: Callable[[Session, BatchRecord], None] | None = None,
                 batch_id: str | None = None) -> BatchRecord:
    """Put the batch's input, deadline and request in its folder, then add its row (flushed: the caller commits, or
    rolls back and deletes the folder).

    `request`: what its creator asked, kept whole; its File (`input_file_id`) must be its owner's, and so must the
    batch it retries. `input_from`: a local file copied in now, the stored File copied in now, a URI the run fetches
    (dropped files), or None when the input is in the folder already. `admit`: run once the input is in place, before
    the row is added, in the row's own transaction: it may lock and count what the owner holds, and refuse
    (features/quotas.py batch_admission), so that the slow copy is outside the lock and the count and the insert are
    not. The batch's endpoint and model, when the request leaves them to the input, are its first request's; a local
    file's request count is recorded too: nothing after reads the input to know them.
    """
    input_file = session.scalar(select(FileRecord).where(FileRecord.id == request.input_file_id,
                                                         FileRecord.owner == request.owner))
    if input_file is None:
        raise ValueError(f"No File {request.input_file_id} of this batch's owner to make a batch of.")
    if request.parent_batch_id is not None and repo.get_batch(session, request.owner, request.parent_batch_id) is None:
        raise ValueError(f"A batch of one owner cannot retry another owner's batch ({request.parent_batch_id}).")
    folder = BatchFolder(storage, batch_id or repo.new_batch_id())
    head, requests = None, 0  # the count of a stored File is validation's (copied within the store, unread)
    if isinstance(input_from, Path):
        head, requests = scan(input_from)
        folder.put_input(input_from)
    elif isinstance(input_from, FileRecord):
        head = _stored_head(storage, input_from.path)
        folder.copy_input(*file_location(storage, input_from.path))
    elif isinstance(input_from, str):
        folder.set_source(input_from, input_file.path)
    if head is not None:
        request = replace(request, endpoint=request.endpoint or endpoint_of_head(head),
                          model=request.model or head_model(head))
    request = replace(request, endpoint=request.endpoint or CHAT)
    # The folder's own copy of the input, unless it is the File's bytes (a command-line batch's File is that copy).
    row = BatchRecord(id=folder.batch_id, status=BatchStatus.VALIDATING, created_at=repo.now(), request_total=requests,
                      stored_bytes=0 if input_file.path == folder.input_key else input_file.bytes)
    row.request = request
    if row.expires_at is not None:
        folder.set_deadline(row.expires_at)
    folder.declare(request)  # validation reports every line with another url; the window prices the batch
    if admit is not None:
        admit(session, row)
    session.add(row)
    session.flush()
    return row


def drop_problem(source: str, version: str) -> str | None:
    """Why a dropped file cannot become a batch (what names it does not fit the store), or None."""
    if len(source) > MAX_SOURCE_CHARS:
        return f"its URI is {len(source)} characters long; the limit is {MAX_SOURCE_CHARS}"
    if len(version) > MAX_VERSION_CHARS:
        return f"its version (ETag) is {len(version)} characters long; the limit is {MAX_VERSION_CHARS}"
    return None


def register_dropped(session: Session, storage: Storage, dropped: DroppedFile, *, owner: str, deliver_to: str,
                     window: Window) -> BatchRecord:
    """A dropped file's File, Batch and intake rows under `owner`, in one transaction; the sensor requests the run.

    Its bytes are fetched by the run (batch_input), so a sensor tick stays small whatever the file's size. On any
    error nothing stays behind (no row, no folder), so the file is simply tried again on a later tick.
    """
    if problem := drop_problem(dropped.source, dropped.version):
        raise ValueError(f"{dropped.source[:200]}: {problem}")
    batch_id = repo.new_batch_id()
    try:
        input_file = add_input_file(session, owner=owner, file_id=repo.new_file_id(),
                                    filename=dropped.filename[:MAX_FILENAME_CHARS], size=dropped.bytes)
        request = BatchRequest(owner=owner, input_file_id=input_file.id, endpoint=dropped.endpoint,
                               model=dropped.model, window=window, metadata={"source": dropped.source[:512]})
        batch = create_batch(session, storage, request, dropped.source, batch_id=batch_id)
        batch.launched_at = batch.created_at  # the sensor requests its run now
        session.add(IntakeRecord(source=dropped.source, version=dropped.version, batch_id=batch.id,
                                 deliver_to=deliver_to.rstrip("/") + f"/{batch.id}/", created_at=batch.created_at))
        session.commit()
    except BaseException:
        session.rollback()
        storage.delete_folder(BatchFolder(storage, batch_id).prefix)
        raise
    return batch


def source_of(input_path: Path) -> dict[str, str]:
    """A command-line batch's metadata: the file it was run from."""
    return {"source": input_path.resolve().as_uri()[:512]}


def register_local(session: Session, storage: Storage, input_path: Path, *, owner: str,
                   batch_id: str | None = None) -> BatchRecord:
    """A batch started from the command line; it has no deadline. The file at `input_path` is copied once, into the
    batch's folder, and its File is that copy (the endpoint is the first request's)."""
    batch_id = batch_id or repo.new_batch_id()
    input_file = add_input_file(session, owner=owner, file_id=repo.new_file_id(), filename=input_path.name,
                                size=input_path.stat().st_size, path=BatchFolder(storage, batch_id).input_key)
    request = BatchRequest(owner=owner, input_file_id=input_file.id, metadata=source_of(input_path))
    row = create_batch(session, storage, request, input_path, batch_id=batch_id)
    row.launched_at = row.created_at  # the command line runs it itself
    session.commit()
    return row


STATUS_TIMES = ("created_at", "in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
                "cancelled_at")


def batch_outcome(batch: BatchRecord, cost: Cost | None = None) -> BatchOutcome:
    """The batch as shown, from its record (and its cost, which the folder's summary.json holds)."""
    return BatchOutcome(
        batch_id=batch.id, status=batch.status, endpoint=batch.endpoint, model=batch.model,
        request_counts=batch.counts(),
        usage=None if batch.usage is None else Usage.from_dict(batch.usage), cost=cost,
        errors=None if batch.errors is None else [BatchError.from_dict(e) for e in batch.errors],
        times={name: getattr(batch, name) for name in STATUS_TIMES if getattr(batch, name) is not None},
    )


def delivered_summary(batch: BatchRecord, intake: IntakeRecord, cost: Cost | None, files: list[str]) -> dict:
    """The summary.json written beside a dropped file's results: the batch as the API shows it, and its cost."""
    shown = batch_outcome(batch, cost)
    return {"id": shown.batch_id, "source": intake.source, **shown.shown(), "errors": shown.errors_shown(),
            "files": files, **shown.times}
