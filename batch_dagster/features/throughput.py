"""A model's throughput: how fast its batches go, measured on its recent completed batches. The estimate and the
queue's ETA share this one model of a model's speed.

It is measured two ways on the same recent batches, for two questions. `engine_throughput`: tokens (prompt and
output) per second of inference, as their summaries recorded them: how long the engine takes over a batch's tokens
(an estimate's durations). `queue_throughput`: bounded tokens (`bounded_work`: prompt and most output) per second that
one of them at least was running, validated to completed: the pace at which the queue works off what its batches'
estimates count, so the bound's slack (requests that stop early) and the pipeline's own time are in it (the ETA).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from batch_dagster.batchfile.folder import BatchFolder
from batch_dagster.batchfile.status import BatchStatus
from batch_dagster.batchfile.storage import Storage
from batch_dagster.db.models import BatchRecord, FileRecord

RECENT_BATCHES = 10  # the model's most recent completed batches its throughput is measured on
# Work per input byte before any batch of the model was validated: a first guess that measurement replaces.
DEFAULT_TOKENS_PER_BYTE = 0.5


@dataclass(frozen=True)
class Throughput:
    """A model's speed: tokens per second, and tokens per byte of a batch's input file; `batches` says how many
    recent batches measured it (0: the defaults, BATCH_ESTIMATE_TOKENS_PER_S and DEFAULT_TOKENS_PER_BYTE)."""

    tokens_per_s: float
    batches: int = 0
    tokens_per_byte: float = DEFAULT_TOKENS_PER_BYTE


@dataclass(frozen=True)
class RecentBatch:
    """A recent completed batch of the model, as the store holds it."""

    batch_id: str
    estimate: dict[str, Any] | None
    in_progress_at: int | None
    completed_at: int | None
    input_bytes: int


def recent_batches(session: Session, model: str | None) -> list[RecentBatch]:
    """The model's last RECENT_BATCHES completed batches, the newest first: one query."""
    rows = session.execute(
        select(BatchRecord.id, BatchRecord.estimate, BatchRecord.in_progress_at, BatchRecord.completed_at,
               FileRecord.bytes)
        .join(FileRecord, FileRecord.id == BatchRecord.input_file_id)
        .where(BatchRecord.model == model, BatchRecord.status == BatchStatus.COMPLETED)
        .order_by(BatchRecord.completed_at.desc(), BatchRecord.pk.desc())
        .limit(RECENT_BATCHES)).all()
    return [RecentBatch(*row) for row in rows]


def engine_throughput(session: Session, storage: Storage, model: str, default_tokens_per_s: float) -> Throughput:
    """Tokens (prompt and output) per second of inference over the model's recent batches, as each one's summary
    recorded them; `default_tokens_per_s` when the model has none yet."""
    tokens, seconds, measured = 0, 0.0, 0
    for batch in recent_batches(session, model):
        summary = BatchFolder(storage, batch.batch_id).summary()
        if summary is not None and summary.inference_s > 0 and summary.usage.total_tokens > 0:
            tokens, seconds, measured = tokens + summary.usage.total_tokens, seconds + summary.inference_s, measured + 1
    if not measured:
        return Throughput(default_tokens_per_s)
    return Throughput(round(tokens / seconds, 1), measured)


def queue_throughput(session: Session, model: str | None, default_tokens_per_s: float) -> Throughput:
    """Bounded tokens per second that one at least of the model's recent batches that carry an estimate was running
    (validated to completed), and per input byte; the defaults when it has none."""
    work, size, spans = 0.0, 0, []
    for batch in recent_batches(session, model):
        tokens = bounded_work(batch.estimate)
        if tokens is None or batch.in_progress_at is None or batch.completed_at is None:
            continue
        work, size = work + tokens, size + batch.input_bytes
        started = float(batch.in_progress_at)
        spans.append((started, float(max(batch.completed_at, started + 1))))
    if not spans:
        return Throughput(default_tokens_per_s)
    return Throughput(work / busy_s(spans), len(spans), work / size if size else DEFAULT_TOKENS_PER_BYTE)


def bounded_work(estimate: dict[str, Any] | None) -> float | None:
    """A validated batch's work in bounded tokens: its input tokens and most output tokens (None: not known)."""
    if not isinstance(estimate, dict):
        return None
    tokens, most = estimate.get("input_tokens"), estimate.get("max_output_tokens")
    if not isinstance(tokens, int) or not isinstance(most, int):
        return None
    return float(tokens + most)


def busy_s(intervals: list[tuple[float, float]]) -> float:
    """The seconds at least one of the intervals (start, end) covers."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total
