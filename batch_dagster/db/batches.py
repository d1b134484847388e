"""How a batch record is made, whoever makes it: the API, the S3/inbox intake or `batch-dagster run`.

The invariant lives here: the batch's input (or where to fetch it), deadline and endpoint are in its
folder before its row exists, so nothing that lists rows ever sees half a batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
from batch_dagster.batchfile.options import BatchOptions
from batch_dagster.batchfile.outcome import BatchOutcome
from batch_dagster.batchfile.status import BatchStatus
from batch_dagster.batchfile.storage import Storage
from batch_dagster.batchfile.usage import Cost, Usage
from batch_dagster.batchfile.windows import Window
from batch_dagster.storage import file_location

from . import repo
from .models import BatchRecord, FileRecord, IntakeRecord

HEAD_BYTES = 64 * 1024  # enough for a file's first request, whose url names the endpoint and body the model
NO_WINDOW = "24h"  # what a batch with no window (from the command line: it never expires) shows, as OpenAI's only
OUTPUT_EXPIRES_AFTER_S: int | None = None  # output and error files are kept until deleted unless a batch asks


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


def create_batch(
    session: Session,
    storage: Storage,
    *,
    owner: str,
    endpoint: str | None,
    input_file: FileRecord,
    input_from: Path | str | FileRecord | None,
    window: Window | None,
    metadata: dict[str, Any] | None = None,
    output_expires_after: int | None = OUTPUT_EXPIRES_AFTER_S,
    launched: bool = False,
    batch_id: str | None = None,
    model: str | None = None,
    parent: BatchRecord | None = None,
    commit: bool = True,
    options: BatchOptions = BatchOptions(),
    admit: Callable[[Session, BatchRecord], None] | None = None,
) -> BatchRecord:
    """Put the batch's input, deadline and endpoint in its folder, then add its row (committed).

    `input_from`: a local file copied in now, a stored File copied in now, a URI the run fetches
    (dropped files), or None when the input is in the folder already. `window`: the completion window it was
    created with, whose length sets its deadline (`expires_at`); None: the batch never expires. `endpoint` None: the
    first request's url decides.
    `options`: the batch's options, kept whole (a retry passes its parent's). `launched`: the caller requests the
    run itself (else the API sensor launches it). `parent`: the batch this one
    retries (features/retry.py only; it must have the same owner). `commit` False: the caller commits (or rolls back)
    the row with its own. `admit`: run once the input is in place, before the row is added, in the row's own
    transaction: it may lock and count what the owner holds, and refuse (features/quotas.py batch_admission), so that
    the slow copy is outside the lock and the count and the insert are not.
    The batch's model (from its first request, or `model` for a dropped file, whose head the intake read) and,
    for a local file, its request count are recorded on the row: nothing after reads the input to know them.
    """
    batch_id = batch_id or repo.new_batch_id()
    folder = BatchFolder(storage, batch_id)
    created_at = repo.now()
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
        model = model or head_model(head)
        endpoint = endpoint or endpoint_of_head(head)
    endpoint = endpoint or CHAT
    expires_at = created_at + window.seconds if window is not None else None
    if expires_at is not None:
        folder.set_deadline(expires_at)
    # Validation reports every line with another url; the window prices the batch.
    folder.declare(endpoint, window.name if window is not None else None)
    row = BatchRecord(
        id=batch_id, owner=owner, endpoint=endpoint, input_file_id=input_file.id,
        completion_window=window.name if window is not None else NO_WINDOW, status=BatchStatus.VALIDATING,
        created_at=created_at, expires_at=expires_at,
        meta=metadata, output_expires_after=output_expires_after, launched_at=created_at if launched else None,
        model=model, request_total=requests, parent_batch_id=_same_owner(parent, owner), options=options,
        # The folder's own copy of the input, unless it is the File's bytes (a command-line batch's File is that copy).
        stored_bytes=0 if input_file.path == folder.input_key else input_file.bytes,
    )
    if admit is not None:
        admit(session, row)
    session.add(row)
    if commit:
        session.commit()
    else:
        session.flush()
    return row


def _same_owner(parent: BatchRecord | None, owner: str) -> str | None:
    if parent is None:
        return None
    if parent.owner != owner:
        raise ValueError(f"A batch of one owner cannot retry another owner's batch ({parent.id}).")
    return parent.id


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
        batch = create_batch(session, storage, owner=owner, endpoint=dropped.endpoint, input_file=input_file,
                             input_from=dropped.source, window=window,
                             metadata={"source": dropped.source[:512]}, launched=True, model=dropped.model,
                             batch_id=batch_id, commit=False)
        session.add(IntakeRecord(source=dropped.source, version=dropped.version, batch_id=batch.id,
                                 deliver_to=deliver_to.rstrip("/") + f"/{batch.id}/", created_at=batch.created_at))
        session.commit()
    except BaseException:
        session.rollback()
        storage.delete_folder(BatchFolder(storage, batch_id).prefix)
        raise
    return batch


def register_local(session: Session, storage: Storage, input_path: Path, *, owner: str,
                   batch_id: str | None = None) -> BatchRecord:
    """A batch started from the command line; it has no deadline. The file at `input_path` is copied once, into the
    batch's folder, and its File is that copy (the endpoint is the first request's)."""
    batch_id = batch_id or repo.new_batch_id()
    input_file = add_input_file(session, owner=owner, file_id=repo.new_file_id(), filename=input_path.name,
                                size=input_path.stat().st_size, path=BatchFolder(storage, batch_id).input_key)
    return create_batch(session, storage, owner=owner, endpoint=None, input_file=input_file,
                        input_from=input_path, window=None,
                        metadata={"source": input_path.resolve().as_uri()[:512]}, launched=True, batch_id=batch_id)


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
