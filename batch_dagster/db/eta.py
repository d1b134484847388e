"""Queue position and ETA in the store: what the queue_eta_sensor computes (batchfile/eta.py) from the batches
not ended yet and the model's recent batches, and stores on each row, so the API reads them as columns."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from batch_dagster.batchfile.eta import Entry, Place, Rate, bounded_work, busy_s, launch_order, plan
from batch_dagster.batchfile.status import TERMINAL, BatchStatus

from .estimate import RECENT_BATCHES
from .fleets import start_delays
from .models import BatchRecord, FileRecord

# The statuses of batches not ended: listed, so the status index serves the query (NOT IN would scan).
NOT_ENDED = tuple(s for s in BatchStatus if s not in TERMINAL)


def model_rate(session: Session, model: str | None, default_tokens_per_s: float) -> Rate:
    """The model's pace over its recent completed batches that carry an estimate: bounded tokens per second that
    one of them at least was running (validated to completed), and per input byte; the defaults when it has none."""
    rows = session.execute(
        select(BatchRecord.estimate, BatchRecord.in_progress_at, BatchRecord.completed_at, FileRecord.bytes)
        .join(FileRecord, FileRecord.id == BatchRecord.input_file_id)
        .where(BatchRecord.model == model, BatchRecord.status == BatchStatus.COMPLETED,
               BatchRecord.estimate.is_not(None), BatchRecord.in_progress_at.is_not(None))
        .order_by(BatchRecord.completed_at.desc(), BatchRecord.pk.desc())
        .limit(RECENT_BATCHES)).all()
    work, size, spans = 0.0, 0, []
    for estimate, started, ended, nbytes in rows:
        tokens = bounded_work(estimate)
        if tokens is None or ended is None:
            continue
        work, size = work + tokens, size + nbytes
        spans.append((float(started), float(max(ended, started + 1))))
    if not spans:
        return Rate(default_tokens_per_s)
    return Rate(work / busy_s(spans), work / size if size else Rate(0).tokens_per_byte, len(spans))


@dataclass(frozen=True)
class Moved:
    """A batch whose stored place or estimated end changed."""

    batch_id: str
    run_id: str | None
    place: Place
    new_position: bool  # its queue_position changed (not only its estimated end)


def refresh_queue(session: Session, *, slots: int, default_tokens_per_s: float, now: float) -> list[Moved]:
    """Recompute every not-ended batch's queue position and estimated end, per model; store those that changed
    (committed) and return them."""
    rows = session.execute(
        select(BatchRecord, FileRecord.bytes).join(FileRecord, FileRecord.id == BatchRecord.input_file_id)
        .where(BatchRecord.status.in_(NOT_ENDED))).all()
    by_model: dict[str | None, list[tuple[BatchRecord, int]]] = defaultdict(list)
    for batch, nbytes in rows:
        by_model[batch.model].append((batch, nbytes))
    waits = start_delays(session, now)  # a warm fleet asleep or starting: its replicas' start comes first
    moved, changes = [], []
    for model, batches in by_model.items():
        entries = [Entry(
            batch_id=b.id, running=b.status != BatchStatus.VALIDATING,
            order=launch_order(b.priority, b.launch_priority, b.pk), work=bounded_work(b.estimate),
            input_bytes=nbytes,
            done=(b.request_completed + b.request_failed) / b.request_total if b.request_total else 0.0,
            in_progress_at=b.in_progress_at) for b, nbytes in batches]
        places = plan(entries, model_rate(session, model, default_tokens_per_s), slots,
                      now + waits.get(model or "", 0.0))
        for b, _ in batches:
            place = places[b.id]
            if (b.queue_position, b.estimated_completion_at) != (place.queue_position, place.estimated_completion_at):
                moved.append(Moved(b.id, b.run_id, place, b.queue_position != place.queue_position))
                # The first end it is given stays: the metrics' ETA error is measured against it.
                first = b.first_estimated_completion_at or place.estimated_completion_at
                changes.append({"pk": b.pk, "queue_position": place.queue_position,
                                "estimated_completion_at": place.estimated_completion_at,
                                "first_estimated_completion_at": first})
    if changes:
        # One statement for all (executemany by primary key): a batch that ended meanwhile keeps a stale place,
        # which the API does not show once it has ended.
        session.execute(update(BatchRecord), changes)
    session.commit()
    return moved


def set_launch_priorities(session: Session, priorities: dict[str, int]) -> None:
    """Record each launched batch's run priority (its dagster/priority tag): its place in the launch order."""
    for batch_id, priority in priorities.items():
        session.execute(update(BatchRecord).where(BatchRecord.id == batch_id).values(launch_priority=priority))
    session.commit()
