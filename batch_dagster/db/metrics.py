"""What the service's metrics read from the store at scrape time: grouped counts and sums, one row per owner, model
and status (never one per batch), so a scrape costs the same at a year's volume as on the first day. A model is one
of the registry's, or OTHER: a batch's model is its file's first line, any string a client wrote, and the label's
values (and the rows a scrape reads) stay as few as the registry's models whatever clients write."""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass

from sqlalchemy import ColumnElement, Integer, String, and_, case, func, literal, select, update
from sqlalchemy.orm import Session

from batch_dagster.batchfile.status import BatchStatus

from .models import BatchRecord, FleetRecord, SensorTick, WebhookDelivery, WebhookEvent
from .repo import ended_at

# Upper bounds of the ETA's relative error buckets: |estimated end - end| over the batch's whole time.
ETA_ERROR_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0)
OTHER = "other"  # the model label of every batch whose model is not the registry's


def model_label(models: Collection[str]) -> ColumnElement[str]:
    """A batch's model as a label: its model when one of `models` (the registry's), else OTHER."""
    return case((BatchRecord.model.in_(sorted(models)), BatchRecord.model), else_=literal(OTHER, String))


@dataclass(frozen=True)
class BatchGroup:
    """The batches of one owner and model in one status: how many, their requests finished and their tokens."""

    owner: str
    model: str
    status: str
    batches: int
    completed: int
    failed: int
    input_tokens: int
    output_tokens: int


def batch_groups(session: Session, models: Collection[str]) -> list[BatchGroup]:
    """Every (owner, model label, status) with its batches' counts and token sums."""
    tokens = [func.coalesce(func.sum(BatchRecord.usage[name].as_integer()), 0)
              for name in ("input_tokens", "output_tokens")]
    model = model_label(models)
    rows = session.execute(
        select(BatchRecord.owner, model, BatchRecord.status, func.count(),
               func.coalesce(func.sum(BatchRecord.request_completed), 0),
               func.coalesce(func.sum(BatchRecord.request_failed), 0), *tokens)
        .group_by(BatchRecord.owner, model, BatchRecord.status))
    return [BatchGroup(owner, label, status, *map(int, counts)) for owner, label, status, *counts in rows]


def oldest_queued(session: Session, models: Collection[str]) -> dict[str, int]:
    """Per model label, when its oldest batch still waiting for its run to start (validating) was created."""
    model = model_label(models)
    rows = session.execute(select(model, func.min(BatchRecord.created_at))
                           .where(BatchRecord.status == BatchStatus.VALIDATING).group_by(model))
    return {label: int(created) for label, created in rows}


@dataclass(frozen=True)
class EtaErrors:
    """The completed batches of a model that had an estimated end: how many, the sum of their relative errors and
    how many fell at or under each bound of ETA_ERROR_BUCKETS."""

    model: str
    count: int
    total: float
    buckets: tuple[int, ...]


def eta_errors(session: Session, models: Collection[str]) -> list[EtaErrors]:
    """The relative error of the first estimated end each completed batch was given, per model label."""
    end = ended_at()
    greatest = func.max if session.get_bind().dialect.name == "sqlite" else func.greatest  # SQLite's max(a, b)
    whole = greatest(end - BatchRecord.created_at, 1)
    error = func.abs(BatchRecord.first_estimated_completion_at - end) * 1.0 / whole
    counted = and_(BatchRecord.status == BatchStatus.COMPLETED, BatchRecord.first_estimated_completion_at.is_not(None))
    model = model_label(models)
    rows = session.execute(
        select(model, func.count(), func.coalesce(func.sum(error), 0.0),
               *(func.sum(case((error <= bound, 1), else_=0)).cast(Integer) for bound in ETA_ERROR_BUCKETS))
        .where(counted).group_by(model))
    return [EtaErrors(label, int(count), float(total), tuple(int(b or 0) for b in buckets))
            for label, count, total, *buckets in rows]


@dataclass(frozen=True)
class Deliveries:
    """One owner's webhook deliveries: delivered, given up, still being tried, and the attempts that failed."""

    owner: str
    delivered: int
    given_up: int
    pending: int
    failed_attempts: int


def webhook_deliveries(session: Session) -> list[Deliveries]:
    """Every owner's webhook deliveries, counted (a global endpoint's under the batch's owner)."""
    delivered = WebhookDelivery.delivered_at.is_not(None)
    given_up = WebhookDelivery.failed_at.is_not(None)
    rows = session.execute(
        select(WebhookEvent.owner,
               func.sum(case((delivered, 1), else_=0)), func.sum(case((given_up, 1), else_=0)),
               func.sum(case((delivered | given_up, 0), else_=1)),
               func.sum(WebhookDelivery.attempts - case((delivered, 1), else_=0)))
        .join(WebhookEvent, WebhookEvent.id == WebhookDelivery.event_id).group_by(WebhookEvent.owner))
    return [Deliveries(owner, *(int(n or 0) for n in counts)) for owner, *counts in rows]


@dataclass(frozen=True)
class Ticks:
    """A sensor's evaluations as it recorded them."""

    name: str
    ticks: int
    failures: int
    seconds_total: float
    last_seconds: float
    last_at: int


def sensor_ticks(session: Session) -> list[Ticks]:
    return [Ticks(t.name, t.ticks, t.failures, t.seconds_total, t.last_seconds, t.last_at)
            for t in session.scalars(select(SensorTick).order_by(SensorTick.name))]


@dataclass(frozen=True)
class Fleet:
    """A warm fleet's state and its last start's duration."""

    model: str
    state: str
    start_s: float | None


def fleets(session: Session) -> list[Fleet]:
    rows = session.scalars(select(FleetRecord).order_by(FleetRecord.model))
    return [Fleet(f.model, f.state, f.start_s) for f in rows]


def record_tick(session: Session, name: str, seconds: float, ok: bool) -> None:
    """Count one evaluation of the sensor `name` (committed)."""
    at = int(time.time())
    changed = session.execute(update(SensorTick).where(SensorTick.name == name).values(
        ticks=SensorTick.ticks + 1, failures=SensorTick.failures + (0 if ok else 1),
        seconds_total=SensorTick.seconds_total + seconds, last_seconds=seconds, last_at=at))
    if not changed.rowcount:  # type: ignore[attr-defined]
        session.add(SensorTick(name=name, ticks=1, failures=0 if ok else 1, seconds_total=seconds,
                               last_seconds=seconds, last_at=at))
    session.commit()
