"""What an estimate asks the store: the model's measured throughput, and the work queued ahead for it."""

from __future__ import annotations

from sqlalchemy import case, func, select
from sqlalchemy.orm import Session

from batch_dagster.batchfile.folder import BatchFolder
from batch_dagster.batchfile.status import BatchStatus
from batch_dagster.batchfile.storage import Storage
from batch_dagster.db.models import TERMINAL, BatchRecord
from batch_dagster.features.estimate import QueueAhead, Throughput

# The model's most recent completed batches the throughput is measured on.
RECENT_BATCHES = 10


def measured_throughput(session: Session, storage: Storage, model: str, default_tokens_per_s: float) -> Throughput:
    """Tokens (prompt and output) per second of inference over the model's recent completed batches, as each
    one's summary recorded them; `default_tokens_per_s` when the model has none yet."""
    recent = session.scalars(
        select(BatchRecord.id)
        .where(BatchRecord.model == model, BatchRecord.status == BatchStatus.COMPLETED)
        .order_by(BatchRecord.completed_at.desc(), BatchRecord.pk.desc())
        .limit(RECENT_BATCHES))
    tokens, seconds, measured = 0, 0.0, 0
    for batch_id in recent:
        summary = BatchFolder(storage, batch_id).summary()
        if summary is not None and summary.inference_s > 0 and summary.usage.total_tokens > 0:
            tokens, seconds, measured = tokens + summary.usage.total_tokens, seconds + summary.inference_s, measured + 1
    if not measured:
        return Throughput(default_tokens_per_s)
    return Throughput(round(tokens / seconds, 1), measured)


def queue_ahead(session: Session, model: str, exclude: str | None = None) -> QueueAhead:
    """Every owner's batches of `model` that have not ended (one engine serves them all), their requests not
    finished yet, and how many of them validation has not counted yet; without the batch `exclude` (the one
    validation estimates)."""
    left = BatchRecord.request_total - BatchRecord.request_completed - BatchRecord.request_failed
    uncounted = case((BatchRecord.request_total == 0, 1), else_=0)  # validation counts a batch's requests
    batches, requests, not_counted = session.execute(
        select(func.count(), func.coalesce(func.sum(left), 0), func.coalesce(func.sum(uncounted), 0))
        .where(BatchRecord.model == model, BatchRecord.status.not_in(TERMINAL),
               BatchRecord.id != (exclude or ""))).one()
    return QueueAhead(int(batches), int(requests), int(not_counted))
