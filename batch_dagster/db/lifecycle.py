"""How a batch's API status follows its Dagster run: read from the files the pipeline writes, then persisted.

The pipeline writes, in order: validation.json (valid or not), shard summaries as each shard
commits and the progress document after each (their totals, so that a running batch is followed by
one read), merged.json once the output and error files are merged, summary.json at the end. Each
file's presence moves the status on; its modification time is when that happened, so the
timestamps are right whoever looks first (the status sensor, or the CLI at its run's end). The API
reads what they stored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

from sqlalchemy import CursorResult, func, select, update
from sqlalchemy.orm import Session

from batch_dagster.batchfile.contract import MAX_MODEL_CHARS, PIPELINE_ERROR, BatchError, new_id
from batch_dagster.batchfile.folder import BatchFolder, Progress
from batch_dagster.batchfile.results import RequestCounts, committed_shards, progress_of
from batch_dagster.batchfile.status import TERMINAL, BatchStatus
from batch_dagster.batchfile.storage import Storage
from batch_dagster.batchfile.usage import Usage

from .models import EVENT_TYPES, BatchRecord, FileRecord, WebhookEvent
from .repo import new_file_id, now


@dataclass
class Observation:
    """What a batch's files say: its status, when each step happened, and its counts so far."""

    status: str = BatchStatus.VALIDATING
    timestamps: dict[str, int | None] = field(default_factory=dict)  # None: the file's time is unknown (gone)
    request_counts: RequestCounts | None = None
    usage: Usage | None = None
    model: str | None = None
    errors: list[BatchError] | None = None
    has_files: bool = False  # the output and error files are written (the pipeline's summary.json is there)
    estimate: dict[str, Any] | None = None  # validation's estimate (read while the record has none)


def observe(folder: BatchFolder) -> Observation:
    """Derive the batch's status from the pipeline's files (nothing there yet: `validating`)."""
    obs = Observation()
    validation = folder.validation()
    if validation is None:
        return obs
    obs.model = validation.model
    validated_at = folder.modified_at(folder.VALIDATION)
    if not validation.valid:
        obs.status = BatchStatus.FAILED
        obs.timestamps["failed_at"] = validated_at
        obs.errors = validation.errors
        # A batch that never ran counts no requests, as OpenAI reports it; errors.data says what was wrong.
        obs.request_counts = RequestCounts(total=0)
        return obs
    obs.status = BatchStatus.IN_PROGRESS
    obs.timestamps["in_progress_at"] = validated_at

    if (merged_at := folder.modified_at(folder.MERGED)) is not None:
        obs.status = BatchStatus.FINALIZING
        obs.timestamps["finalizing_at"] = merged_at
    summary = folder.summary()
    if summary is not None:
        obs.status = summary.status
        obs.timestamps[f"{obs.status}_at"] = folder.summary_modified_at()
        obs.request_counts, obs.usage, obs.model = summary.request_counts, summary.usage, summary.model
        obs.errors = summary.errors or None  # why its run failed, when it did
        obs.has_files = True
        return obs

    # Running: the counts move with every committed shard (and the live one's finished requests).
    progress = folder.progress()
    if progress is None or not progress.has_totals:  # inference not started, or a document written before totals
        progress = _progress_from_markers(folder, validation.total_requests, progress)
    _running(obs, progress)
    return obs


def _progress_from_markers(folder: BatchFolder, total_requests: int, live: Progress | None) -> Progress:
    """The progress a folder's shard markers say (one listing, and a read per marker): for a folder whose inference
    step has not written the progress document's totals yet."""
    shards = committed_shards(folder.storage, folder.results_prefix)
    manifest = folder.manifest()
    count = manifest.shard_count if manifest else None
    at = None
    if count is not None and len(shards) >= count:  # when the last committed: the batch's finalizing_at
        at = max((t for t in map(folder.shard_committed_at, shards) if t is not None), default=None)
    progress = progress_of(shards, total_requests, count, at)
    if live is not None and live.shard is not None and live.shard not in shards:
        progress.shard, progress.done = live.shard, live.done
    return progress


def _running(obs: Observation, progress: Progress) -> None:
    """A running batch's counts and usage so far, and `finalizing` once every shard has committed."""
    obs.request_counts, obs.usage = progress.counts(), progress.usage
    if obs.status == BatchStatus.IN_PROGRESS and progress.all_committed:
        obs.status = BatchStatus.FINALIZING
        obs.timestamps["finalizing_at"] = int(progress.committed_at) if progress.committed_at else now()


def observe_progress(folder: BatchFolder) -> Observation | None:
    """What an in_progress batch's progress document says (one read): its counts so far, `finalizing` once every
    shard has committed. None when there is no such document yet: nothing to say."""
    progress = folder.progress()
    if progress is None or not progress.has_totals:
        return None
    obs = Observation(BatchStatus.IN_PROGRESS)
    _running(obs, progress)
    return obs


def run_failed(obs: Observation, message: str, at: int | None = None) -> Observation:
    """The observation of a batch whose Dagster run failed before it wrote a summary."""
    if obs.status in TERMINAL:
        return obs
    error = BatchError(PIPELINE_ERROR, message)
    return Observation(BatchStatus.FAILED, {**obs.timestamps, "failed_at": at or now()}, obs.request_counts, obs.usage,
                       obs.model, [error])


def changes(batch: BatchRecord, obs: Observation) -> dict[str, Any]:
    """The column updates that bring `batch` up to `obs`: statuses only move on, timestamps are set once."""
    if batch.status in TERMINAL:
        return {}
    status = obs.status
    cancelling = batch.cancelling_at is not None
    if cancelling and status not in TERMINAL:
        status = BatchStatus.CANCELLING  # until the run has stopped and written its summary
    values: dict[str, Any] = {}
    if status != batch.status:
        values["status"] = status
    for key, at in obs.timestamps.items():
        if key == "finalizing_at" and cancelling:
            continue
        if at is not None and getattr(batch, key) is None:
            values[key] = at
    if obs.request_counts is not None:
        for name, value in obs.request_counts.to_dict().items():
            if getattr(batch, f"request_{name}") != value:
                values[f"request_{name}"] = value
    if obs.usage is not None and obs.usage.to_dict() != batch.usage:
        values["usage"] = obs.usage.to_dict()
    # Validation refuses a longer model (a line error); a document that holds one anyway is not copied.
    if obs.model and len(obs.model) <= MAX_MODEL_CHARS and obs.model != batch.model:
        values["model"] = obs.model
    if obs.estimate is not None and batch.estimate is None:
        values["estimate"] = obs.estimate
    errors = None if obs.errors is None else [e.to_dict() for e in obs.errors]
    if errors is not None and errors != batch.errors:
        values["errors"] = errors
    return values


def _result_files(folder: BatchFolder, batch: BatchRecord, at: int) -> list[FileRecord]:
    expires_at = at + batch.output_expires_after if batch.output_expires_after else None
    files = []
    for key, suffix in ((folder.output_key, "output"), (folder.error_key, "error")):
        files.append(FileRecord(
            id=new_file_id(), owner=batch.owner, bytes=folder.storage.size(key) or 0, created_at=at,
            expires_at=expires_at, filename=f"{batch.id}_{suffix}.jsonl", purpose="batch_output", path=key,
            batch_id=batch.id,
        ))
    return files


def folder_bytes(session: Session, folder: BatchFolder) -> int:
    """What the batch's folder keeps beside the Files the store serves from it (its output and error files, a
    command-line batch's input), which its key's stored-bytes limit counts as Files: its own input copy, its working
    files, its summary. Measured (one listing) when the batch ends and after retention."""
    keys = [folder.input_key, folder.output_key, folder.error_key]
    served = session.scalar(select(func.coalesce(func.sum(FileRecord.bytes), 0)).where(
        FileRecord.path.in_(keys), FileRecord.expires_at.is_(None) | (FileRecord.expires_at > now())))
    return max(folder.storage.total_size(folder.prefix) - int(served or 0), 0)


def add_event(session: Session, batch_id: str, owner: str, event_type: str, at: int | None = None) -> WebhookEvent:
    """A webhook event of a batch (EVENT_TYPES: it just reached that terminal status; DEADLINE_AT_RISK); committed
    by the caller."""
    event = WebhookEvent(id=new_id("evt_"), type=event_type, batch_id=batch_id, owner=owner, created_at=at or now())
    session.add(event)
    return event


def apply(session: Session, folder: BatchFolder, batch: BatchRecord, obs: Observation) -> BatchRecord:
    """Persist what `obs` changes; on reaching the end, register the output and error files, once.

    The update only applies while the stored batch is not terminal, so when the API and the
    sensor observe the end together, exactly one of them registers the files.
    """
    values = changes(batch, obs)
    if not values:
        return batch
    # An UPDATE without RETURNING gives a CursorResult (typed as a plain Result): its rowcount tells who won.
    result = cast(CursorResult, session.execute(
        update(BatchRecord).where(BatchRecord.id == batch.id, BatchRecord.status.not_in(TERMINAL)).values(**values)
    ))
    if result.rowcount == 1 and values.get("status") in TERMINAL:
        # In the status's own transaction: exactly one event per batch that ends, whoever stored the end.
        add_event(session, batch.id, batch.owner, EVENT_TYPES[values["status"]])
    if result.rowcount == 1 and values.get("status") in TERMINAL:
        ended: dict[str, Any] = {}
        if obs.has_files:
            output, error = _result_files(folder, batch, now())
            session.add_all([output, error])
            session.flush()
            ended = {"output_file_id": output.id, "error_file_id": error.id}
        ended["stored_bytes"] = folder_bytes(session, folder)
        session.execute(update(BatchRecord).where(BatchRecord.id == batch.id).values(**ended))
    session.commit()
    session.refresh(batch)
    return batch


def record_usage(session: Session, batch_id: str, usage: Usage) -> None:
    """A running batch's usage so far (its committed shards'), stored by its own run after each shard commits, so
    that the store holds what it has spent when another batch's cost cap asks (features/cost_cap.py); the status
    sensor stores the same from the progress document a tick later. A batch that has ended keeps its final usage."""
    session.execute(update(BatchRecord).where(BatchRecord.id == batch_id, BatchRecord.status.not_in(TERMINAL))
                    .values(usage=usage.to_dict()))
    session.commit()


def sync_progress(session: Session, storage: Storage, batch: BatchRecord) -> BatchRecord:
    """Bring a running batch's counts up to date from its progress document alone (one storage read): what the
    status sensor does on every tick for a batch whose run goes on. Only an in_progress (or cancelling) batch
    moves by it; the others wait for their run's next change."""
    if batch.status not in (BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING):
        return batch
    folder = BatchFolder(storage, batch.id)
    obs = observe_progress(folder)
    return batch if obs is None else apply(session, folder, batch, obs)


def sync_batch(
    session: Session, storage: Storage, batch: BatchRecord, *, run_failure: str | None = None
) -> BatchRecord:
    """Bring a stored batch up to date with its pipeline files (and a failed run, when the sensor saw one)."""
    if batch.status in TERMINAL:
        return batch
    folder = BatchFolder(storage, batch.id)
    obs = observe(folder)
    if batch.estimate is None and obs.status != BatchStatus.VALIDATING:  # read once: then the record has it
        obs.estimate = folder.estimate()
    if run_failure is not None:
        obs = run_failed(obs, run_failure)
    return apply(session, folder, batch, obs)
