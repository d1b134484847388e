"""Webhooks: the outbox (one delivery per endpoint, global or the owner's own, for each event of a batch that
ended), the owners' endpoints, and the signed POSTs (Standard Webhooks), retried with backoff.

Events are written in the same transaction as the terminal status (db/lifecycle.apply), so a batch that ended
always has its event; the webhook sensor delivers them (`deliver_due`). A delivery is marked only after its POST
returned, so a crash in between sends it again: at least once.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import secrets
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx
import orjson
from sqlalchemy import func, or_, select, update
from sqlalchemy.orm import Session
from standardwebhooks import Webhook
from standardwebhooks.webhooks import EmptyWebhookSecretError

from batch_dagster.batchfile.usage import Usage
from batch_dagster.db.models import BatchRecord, WebhookDelivery, WebhookEndpointRecord, WebhookEvent
from batch_dagster.db.repo import now, page
from batch_dagster.features.egress import Allow, pinned

SECRET_PREFIX = "whsec_"
MAX_ENDPOINTS_PER_OWNER = 16
DELETED = "The webhook endpoint was deleted."
Post = tuple[str, str | None, str, bytes]  # url, the endpoint's secret (None: the global one), event id, body
_ERROR_BYTES = 200  # of an endpoint's error answer, kept with the attempt


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

def check_secret(secret: str) -> str | None:
    """What is wrong with a Standard Webhooks secret (`whsec_` and base64), or None."""
    if not secret.startswith(SECRET_PREFIX):
        return "BATCH_WEBHOOK_SECRET must start with 'whsec_' (a Standard Webhooks secret)."
    try:
        key = Webhook(secret)._whsecret  # the library's own decoding, as its verify() uses
    except (binascii.Error, ValueError, RuntimeError, EmptyWebhookSecretError) as exc:
        return f"BATCH_WEBHOOK_SECRET after 'whsec_' must be base64: {exc}"
    return None if len(key) >= 16 else "BATCH_WEBHOOK_SECRET must hold at least 16 bytes (24 base64 characters)."


def event_body(event_id: str, event_type: str, created_at: int, data: dict[str, Any]) -> bytes:
    """OpenAI's webhook event: {id, object: "event", type, created_at, data: {id, ...}}."""
    return orjson.dumps({"id": event_id, "object": "event", "type": event_type, "created_at": created_at,
                         "data": data})


@dataclass(frozen=True)
class Sender:
    """How events are POSTed: signed with an owner's endpoint's secret or the global `secret`, each within
    `timeout_s`, to owners' endpoints only at public addresses or those `allow` lets through (features/egress.py)."""

    secret: str
    timeout_s: float = 5.0
    allow: list[str] = field(default_factory=list)

    def headers(self, event_id: str, body: bytes, at: datetime | None = None, *,
                secret: str | None = None) -> dict[str, str]:
        """The Standard Webhooks headers (webhook-id, webhook-timestamp, webhook-signature), signed with `secret`
        (an owner's endpoint's) or else the global one."""
        at = at or datetime.now(UTC)
        signature = Webhook(secret or self.secret).sign(event_id, at, body.decode())
        return {"webhook-id": event_id, "webhook-timestamp": str(int(at.timestamp())),
                "webhook-signature": signature, "content-type": "application/json",
                "user-agent": "batch-dagster-webhooks"}

    def send_all(self, posts: list[Post]) -> list[str | None]:
        """POST each (url, secret or None for the global one, event_id, body) concurrently; per post None when a
        2xx came back, else why not.

        Each has `timeout_s` at most, in all, and reads at most a few hundred bytes of the answer, so a slow,
        dead or hostile endpoint delays nothing else and costs no memory.
        """
        return asyncio.run(self._send_all(posts))

    async def _send_all(self, posts: list[Post]) -> list[str | None]:
        allow = Allow.parse(self.allow)
        async with httpx.AsyncClient(timeout=self.timeout_s, follow_redirects=False) as client:

            async def post(url: str, secret: str | None, event_id: str, body: bytes) -> str | None:
                headers = self.headers(event_id, body, secret=secret)
                target, extensions = httpx.URL(url), dict[str, Any]()
                if secret is not None:  # an owner's endpoint (the operator's global ones are trusted)
                    target, extensions = await pinned(target, allow)
                    headers["host"] = httpx.URL(url).netloc.decode("ascii")
                async with client.stream("POST", target, content=body, headers=headers,
                                         extensions=extensions) as response:
                    if 200 <= response.status_code < 300:
                        return None
                    head = b""
                    async for chunk in response.aiter_bytes():
                        head += chunk
                        if len(head) >= _ERROR_BYTES:
                            break
                    return f"HTTP {response.status_code}: {head[:_ERROR_BYTES].decode(errors='replace')}"

            async def one(*post_args) -> str | None:
                try:
                    return await asyncio.wait_for(post(*post_args), self.timeout_s)
                except TimeoutError:
                    return f"no answer within {self.timeout_s} s"
                except Exception as exc:  # one endpoint's problem (a bad URL, a reset) stays its own
                    return f"{type(exc).__name__}: {exc}"

            return list(await asyncio.gather(*(one(*post) for post in posts)))


@dataclass(frozen=True)
class Attempt:
    """One POST of one event to one endpoint, as deliver_due made it; `error` None when it was delivered."""

    delivery: WebhookDelivery
    event: WebhookEvent
    error: str | None


def deliver_due(session: Session, urls: Sequence[str], sender: Sender, *, max_attempts: int,
                first_backoff_s: float) -> list[Attempt]:
    """Plan the new events' deliveries (to the global `urls` and the owners' endpoints), POST those due and record
    each attempt (committed). With no endpoint configured, events are planned with no delivery: turning webhooks on
    later (or adding an endpoint) does not flood the endpoints with old events."""
    plan(session, urls)
    work = due(session)
    if not work:
        return []
    data = event_data(session, [e for _, e, _ in work])
    errors = sender.send_all([(d.url, secret, e.id, event_body(e.id, e.type, e.created_at, data[e.id]))
                              for d, e, secret in work])
    for (delivery, _, _), error in zip(work, errors, strict=True):
        record(session, delivery, error, max_attempts=max_attempts, first_backoff_s=first_backoff_s)
    session.commit()
    return [Attempt(delivery, event, error) for (delivery, event, _), error in zip(work, errors, strict=True)]
