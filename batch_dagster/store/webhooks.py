"""The webhook outbox: an event when a batch ends, one delivery per endpoint, attempts with backoff.

Events are written in the same transaction as the terminal status (store/lifecycle.apply), so a
batch that ended always has its event; the webhook sensor delivers them. A delivery is marked only
after its POST returned, so a crash in between sends it again: at least once.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import select
from sqlalchemy.orm import Session

from .models import TERMINAL, WebhookDelivery, WebhookEvent
from .repo import now

EVENT_TYPES = {status: f"batch.{status}" for status in TERMINAL}


def add_event(session: Session, batch_id: str, owner: str, status: str, at: int | None = None) -> WebhookEvent:
    """The event of a batch that just reached `status` (terminal); committed by the caller."""
    from batch_dagster.batchfile.contract import new_id

    event = WebhookEvent(id=new_id("evt_"), type=EVENT_TYPES[status], batch_id=batch_id, owner=owner,
                         created_at=at or now())
    session.add(event)
    return event


def plan(session: Session, urls: Sequence[str], limit: int = 500) -> int:
    """Give each unplanned event one delivery per endpoint configured now; how many events were planned."""
    events = list(session.scalars(select(WebhookEvent).where(WebhookEvent.planned_at.is_(None))
                                  .order_by(WebhookEvent.pk).limit(limit)))
    at = now()
    for event in events:
        for url in dict.fromkeys(urls):
            session.add(WebhookDelivery(event_id=event.id, url=url, attempts=0, next_attempt_at=event.created_at))
        event.planned_at = at
    session.commit()
    return len(events)


def due(session: Session, at: int | None = None, limit: int = 100) -> list[tuple[WebhookDelivery, WebhookEvent]]:
    """Deliveries whose next attempt is due, oldest first, with their events."""
    at = now() if at is None else at
    rows = session.execute(
        select(WebhookDelivery, WebhookEvent).join(WebhookEvent, WebhookEvent.id == WebhookDelivery.event_id)
        .where(WebhookDelivery.delivered_at.is_(None), WebhookDelivery.failed_at.is_(None),
               WebhookDelivery.next_attempt_at <= at)
        .order_by(WebhookDelivery.next_attempt_at, WebhookDelivery.pk).limit(limit)
    )
    return [(d, e) for d, e in rows]


def backoff_s(attempts: int, first_s: float, cap_s: float = 3600.0) -> int:
    """Seconds before the next attempt after `attempts` failed ones: first_s, doubling, capped."""
    return int(min(first_s * 2 ** (attempts - 1), cap_s))


def record(session: Session, delivery: WebhookDelivery, error: str | None, *, max_attempts: int, first_backoff_s: float,
           at: int | None = None) -> None:
    """Record one attempt: delivered, or failed with the next attempt scheduled (or given up after the last)."""
    at = now() if at is None else at
    delivery.attempts += 1
    if error is None:
        delivery.delivered_at = at
        delivery.last_error = None
    else:
        delivery.last_error = error[:1000]
        if delivery.attempts >= max_attempts:
            delivery.failed_at = at
        else:
            delivery.next_attempt_at = at + backoff_s(delivery.attempts, first_backoff_s)
