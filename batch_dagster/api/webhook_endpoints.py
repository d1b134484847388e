"""/v1/webhook_endpoints (OpenAI's webhook endpoints API): each key's own endpoints for its batches' events."""

from __future__ import annotations

from typing import Annotated
from urllib.parse import urlsplit

import httpx
from fastapi import APIRouter, Query
from starlette.concurrency import run_in_threadpool

from batch_dagster.db.models import WebhookEndpointRecord
from batch_dagster.features import webhooks as store
from batch_dagster.features.egress import Allow, Refused, check

from .context import AppContext
from .deps import Context, DbSession, Owner
from .errors import ERROR_RESPONSES, clip, invalid, not_found
from .schemas import (
    WEBHOOK_EVENT_TYPES,
    CreateWebhookEndpointRequest,
    DeletedWebhookEndpoint,
    ListPage,
    Text,
    WebhookEndpoint,
    WebhookEndpointWithSecret,
    WebhookEventTypeList,
    shown,
)

router = APIRouter(tags=["webhooks"], responses=ERROR_RESPONSES)


def url_problem(url: str) -> str | None:
    """Why `url` cannot be a webhook endpoint (not http(s), no host, not parseable), or None."""
    if any(c.isspace() or not c.isprintable() for c in url):
        return "The URL must not contain spaces or control characters."
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - parsing the port is the check: a bad one raises
        httpx.URL(url)  # what the sender will make of it
    except (ValueError, httpx.InvalidURL) as exc:
        return f"The URL {clip(url)!r} cannot be parsed: {clip(exc, 200)}"
    if parts.scheme.lower() not in ("http", "https"):
        return f"The URL {clip(url)!r} must start with http:// or https://."
    if not parts.hostname:
        return f"The URL {clip(url)!r} names no host."
    return None


def address_problem(url: str, allow: Allow) -> str | None:
    """Why `url`'s host may not be reached (not at a public address nor allowed; egress.check resolves it), or
    None. A blocking lookup: the route runs it on its own lane."""
    parts = urlsplit(url)
    try:
        check(parts.hostname or "", parts.port or (443 if parts.scheme.lower() == "https" else 80), allow)
    except Refused as exc:
        return str(exc)
    return None


def endpoint_object(row: WebhookEndpointRecord) -> WebhookEndpoint:
    secret = row.secret or ""
    hint = f"{secret[:len(store.SECRET_PREFIX) + 4]}…" if secret else None  # enough to tell two secrets apart
    types = row.event_types if isinstance(row.event_types, list) else []
    return WebhookEndpoint(id=row.id, created_at=row.created_at, event_types=[shown(t) for t in types],
                           name=shown(row.name), signing_secret_hint=hint, url=shown(row.url),
                           updated_at=row.created_at)


@router.post("/webhook_endpoints", response_model=WebhookEndpointWithSecret)
async def create_webhook_endpoint(body: CreateWebhookEndpointRequest, owner: Owner,
                                  ctx: Context) -> WebhookEndpointWithSecret:
    """Add an endpoint for this key's batch events; its signing secret is in this answer only. Its host must be
    at a public address, unless the operator allows it (BATCH_WEBHOOK_ALLOW); delivery checks again. The host is
    resolved on a lane of its own (api/lanes.py), a few lookups per key at once, never in the API's worker pool."""
    if problem := url_problem(body.url):
        raise invalid(problem, param="url", code="invalid_url")
    event_types = list(WEBHOOK_EVENT_TYPES) if body.event_types is None else body.event_types
    for event_type in event_types:
        if event_type not in WEBHOOK_EVENT_TYPES:
            raise invalid(f"Event type {clip(event_type)!r} is not sent here; use {', '.join(WEBHOOK_EVENT_TYPES)}.",
                          param="event_types", code="invalid_event_type")
    async with ctx.lookups.admitted(owner):
        if problem := await ctx.lookups.run(owner, lambda: address_problem(body.url, ctx.webhook_allow)):
            raise invalid(problem, param="url", code="invalid_url")
    return await run_in_threadpool(_add_endpoint, ctx, owner, body.url, body.name, event_types)


def _add_endpoint(ctx: AppContext, owner: str, url: str, name: str,
                  event_types: list[str]) -> WebhookEndpointWithSecret:
    with ctx.db.session() as session:
        if store.count_endpoints(session, owner) >= store.MAX_ENDPOINTS_PER_OWNER:
            raise invalid(f"This key already has {store.MAX_ENDPOINTS_PER_OWNER} webhook endpoints, the most it "
                          "may have; delete one first.", code="too_many_webhook_endpoints")
        row = store.add_endpoint(session, owner, url=url, name=name, event_types=event_types)
        return WebhookEndpointWithSecret(**endpoint_object(row).model_dump(), signing_secret=row.secret or "")


@router.get("/webhook_endpoints", response_model=ListPage[WebhookEndpoint])
def list_webhook_endpoints(
    session: DbSession,
    owner: Owner,
    after: Text | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> ListPage[WebhookEndpoint]:
    """This key's endpoints, newest first, without their secrets."""
    page = store.list_endpoints(session, owner, after=after, limit=limit)
    if page is None:  # only when `after` names no endpoint of this key
        raise not_found("WebhookEndpoint", str(after), param="after")
    rows, has_more = page
    data = [endpoint_object(r) for r in rows]
    return ListPage[WebhookEndpoint].of(data, has_more)


def _owned(session, owner: str, endpoint_id: str) -> WebhookEndpointRecord:
    row = store.get_endpoint(session, owner, endpoint_id)
    if row is None:
        raise not_found("WebhookEndpoint", endpoint_id, param="webhook_endpoint_id")
    return row


@router.get("/webhook_endpoints/{webhook_endpoint_id}", response_model=WebhookEndpoint)
def retrieve_webhook_endpoint(webhook_endpoint_id: Text, session: DbSession, owner: Owner) -> WebhookEndpoint:
    return endpoint_object(_owned(session, owner, webhook_endpoint_id))


@router.delete("/webhook_endpoints/{webhook_endpoint_id}", response_model=DeletedWebhookEndpoint)
def delete_webhook_endpoint(webhook_endpoint_id: Text, session: DbSession, owner: Owner) -> DeletedWebhookEndpoint:
    """Remove the endpoint: no delivery to it is attempted from now on, pending retries included."""
    store.delete_endpoint(session, _owned(session, owner, webhook_endpoint_id))
    return DeletedWebhookEndpoint(id=webhook_endpoint_id, deleted=True)


@router.get("/webhook_event_types", response_model=WebhookEventTypeList)
def list_webhook_event_types(_owner: Owner) -> WebhookEventTypeList:
    """The event types an endpoint may subscribe to here: a batch's end."""
    return WebhookEventTypeList(data=list(WEBHOOK_EVENT_TYPES))
