"""The webhook outbox and the owners' webhook endpoints: an event when a batch ends, one delivery per
endpoint (global, or the owner's own), attempts with backoff.

Events are written in the same transaction as the terminal status (store/lifecycle.apply), so a
batch that ended always has its event; the webhook sensor delivers them. A delivery is marked only
after its POST returned, so a crash in between sends it again: at least once.
"""

from __future__ import annotations

import base64
import secrets
import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy import func, or_, select, update
from sqlalchemy.orm import Session

from batch_dagster.batchfile.status import TERMINAL
from batch_dagster.batchfile.usage import Usage

from .models import BatchRecord, WebhookDelivery, WebhookEndpointRecord, WebhookEvent
from .repo import now, page

EVENT_TYPES: dict[str, str] = {status: f"batch.{status}" for status in TERMINAL}
SECRET_PREFIX = "whsec_"
MAX_ENDPOINTS_PER_OWNER = 16
DELETED = "The webhook endpoint was deleted."


def new_secret() -> str:
    """A Standard Webhooks secret, as OpenAI gives one per endpoint: `whsec_` and base64 of 32 random bytes."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()


def add_endpoint(session: Session, owner: str, *, url: str, name: str,
                 event_types: Sequence[str]) -> WebhookEndpointRecord:
    """A new endpoint of `owner` with a new secret; it gets the events of batches that end from now on."""
    row = WebhookEndpointRecord(id=f"we_{uuid.uuid4().hex}", owner=owner, name=name, url=url,
                                event_types=list(dict.fromkeys(event_types)), secret=new_secret(), created_at=now())
    session.add(row)
    session.commit()
    return row


def _live(owner: str):
    return (WebhookEndpointRecord.owner == owner, WebhookEndpointRecord.deleted_at.is_(None))


def count_endpoints(session: Session, owner: str) -> int:
    return session.scalar(select(func.count()).select_from(WebhookEndpointRecord).where(*_live(owner))) or 0


def get_endpoint(session: Session, owner: str, endpoint_id: str) -> WebhookEndpointRecord | None:
    return session.scalar(select(WebhookEndpointRecord).where(*_live(owner), WebhookEndpointRecord.id == endpoint_id))


def list_endpoints(session: Session, owner: str, *, after: str | None,
                   limit: int) -> tuple[list[WebhookEndpointRecord], bool] | None:
    """A page of the owner's endpoints, newest first; None when `after` names none of the owner's."""
    return page(session, WebhookEndpointRecord, owner, after, limit,
                extra=(WebhookEndpointRecord.deleted_at.is_(None),))


def delete_endpoint(session: Session, row: WebhookEndpointRecord) -> None:
    """Forget the endpoint's secret and give up its pending deliveries: nothing more is sent to it."""
    at = now()
    row.deleted_at, row.secret = at, None
    session.execute(update(WebhookDelivery)
                    .where(WebhookDelivery.endpoint_id == row.id, WebhookDelivery.delivered_at.is_(None),
                           WebhookDelivery.failed_at.is_(None))
                    .values(failed_at=at, last_error=DELETED))
    session.commit()


def add_event(session: Session, batch_id: str, owner: str, status: str, at: int | None = None) -> WebhookEvent:
    """The event of a batch that just reached `status` (terminal); committed by the caller."""
    from batch_dagster.batchfile.contract import new_id

    event = WebhookEvent(id=new_id("evt_"), type=EVENT_TYPES[status], batch_id=batch_id, owner=owner,
                         created_at=at or now())
    session.add(event)
    return event


def plan(session: Session, urls: Sequence[str], limit: int = 500) -> int:
    """Give each unplanned event its deliveries, as endpoints are now: one per global URL, one per endpoint of
    the batch's owner that subscribes to the event's type and existed when the batch ended; how many events
    were planned."""
    events = list(session.scalars(select(WebhookEvent).where(WebhookEvent.planned_at.is_(None))
                                  .order_by(WebhookEvent.pk).limit(limit)))
    owners = {event.owner for event in events}
    endpoints: dict[str, list[WebhookEndpointRecord]] = {}
    for endpoint in session.scalars(select(WebhookEndpointRecord).where(
            WebhookEndpointRecord.owner.in_(owners), WebhookEndpointRecord.deleted_at.is_(None))
            .order_by(WebhookEndpointRecord.pk)):
        endpoints.setdefault(endpoint.owner, []).append(endpoint)
    at = now()
    for event in events:
        for url in dict.fromkeys(urls):
            session.add(WebhookDelivery(event_id=event.id, url=url, attempts=0, next_attempt_at=event.created_at))
        for endpoint in endpoints.get(event.owner, ()):
            if event.type in endpoint.event_types and endpoint.created_at <= event.created_at:
                session.add(WebhookDelivery(event_id=event.id, endpoint_id=endpoint.id, url=endpoint.url, attempts=0,
                                            next_attempt_at=event.created_at))
        event.planned_at = at
    session.commit()
    return len(events)


def due(session: Session, at: int | None = None,
        limit: int = 100) -> list[tuple[WebhookDelivery, WebhookEvent, str | None]]:
    """Deliveries whose next attempt is due, oldest first, with their events and the secret of their endpoint
    (None for a global one, signed with the global secret); never one to a deleted endpoint."""
    at = now() if at is None else at
    rows = session.execute(
        select(WebhookDelivery, WebhookEvent, WebhookEndpointRecord.secret)
        .join(WebhookEvent, WebhookEvent.id == WebhookDelivery.event_id)
        .outerjoin(WebhookEndpointRecord, WebhookEndpointRecord.id == WebhookDelivery.endpoint_id)
        .where(WebhookDelivery.delivered_at.is_(None), WebhookDelivery.failed_at.is_(None),
               WebhookDelivery.next_attempt_at <= at,
               or_(WebhookDelivery.endpoint_id.is_(None), WebhookEndpointRecord.secret.is_not(None)))
        .order_by(WebhookDelivery.next_attempt_at, WebhookDelivery.pk).limit(limit)
    )
    return [(d, e, secret) for d, e, secret in rows]


def event_data(session: Session, events: Sequence[WebhookEvent]) -> dict[str, dict[str, Any]]:
    """Each event's `data`, by event id: OpenAI's {id} and, as an extension, the ended batch's final
    `request_counts` and `usage` (stored with its terminal status, so every attempt sends the same)."""
    ids = {event.batch_id for event in events}
    batches = {b.id: b for b in session.scalars(select(BatchRecord).where(BatchRecord.id.in_(ids)))}
    data: dict[str, dict[str, Any]] = {}
    for event in events:
        batch = batches.get(event.batch_id)
        data[event.id] = {"id": event.batch_id} if batch is None else {
            "id": event.batch_id,
            "request_counts": batch.counts().to_dict(),
            "usage": Usage.from_dict(batch.usage or {}).to_dict(),
        }
    return data


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
