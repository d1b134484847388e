"""Per-key webhook endpoints (/v1/webhook_endpoints, OpenAI's webhook endpoints API) through the openai SDK, with
real HTTP receivers on loopback: each key gets only its own batches' events, at its own URL, signed with its own
secret; subscriptions, deletion and validation; the global endpoints still get every event."""

from __future__ import annotations

import base64
import functools

import dagster as dg
import openai
import pytest
from openai import OpenAI
from sqlalchemy import select

from batch_dagster.db import Database, repo
from batch_dagster.db.lifecycle import add_event
from batch_dagster.db.models import WebhookDelivery, WebhookEndpointRecord
from batch_dagster.defs.resources import DatabaseResource
from batch_dagster.defs.webhooks import WebhookConfig, webhook_sensor
from batch_dagster.features import egress
from batch_dagster.features import webhooks as outbox
from tests.helpers import KEY_A, KEY_B, Receiver, chat_request, rows, upload, wait_for

GLOBAL_SECRET = "whsec_" + base64.b64encode(b"the global secret, 32 bytes long").decode()
CHAT = "/v1/chat/completions"
ENDS = {"completed", "failed", "expired", "cancelled"}
ALL_TYPES = ["batch.completed", "batch.failed", "batch.expired", "batch.cancelled", "batch.deadline_at_risk"]


# Receivers here are on loopback (and the endpoint-limit test names addresses in 10.0.0.0/24): an operator opens
# such internal endpoints on purpose with BATCH_WEBHOOK_ALLOW, and these tests do so. What is refused without it is
# in test_webhook_egress.py.
ALLOW = ("127.0.0.1", "10.0.0.0/24")
PUBLIC_NAMES = {"example.com": "93.184.216.34"}  # no test depends on the network's DNS


@pytest.fixture(autouse=True)
def resolver(monkeypatch):
    monkeypatch.setattr(egress, "resolve", lambda host, port: [PUBLIC_NAMES[host]])


@pytest.fixture
def start_service(start_service):
    return functools.partial(start_service, webhook_allow=ALLOW)


@pytest.fixture
def receiver():
    """Receivers on loopback, closed after the test."""
    made: list[Receiver] = []

    def make(*statuses: int) -> Receiver:
        made.append(Receiver(*statuses))
        return made[-1]

    yield make
    for r in made:
        r.close()


def deliver(service, urls=(), ticks: int = 1) -> None:
    """Evaluate the webhook sensor `ticks` times, as the daemon would, with these global endpoints."""
    webhooks = WebhookConfig(urls=list(urls), secret=GLOBAL_SECRET if urls else "", timeout_s=2.0, max_attempts=5,
                             first_backoff_s=0, allow=list(ALLOW))
    context = dg.build_sensor_context(instance=service.instance, resources={
        "database": DatabaseResource(url=service.config.database_url), "webhooks": webhooks})
    for _ in range(ticks):
        webhook_sensor(context)


def end_batch(client: OpenAI, path, lines: list[dict], status: str) -> str:
    batch = client.batches.create(input_file_id=upload(client, path, lines), endpoint=CHAT, completion_window="24h")
    assert wait_for(client, batch.id, ENDS).status == status
    return batch.id


def by_batch(r: Receiver) -> dict[str, str]:
    return {e["data"]["id"]: e["type"] for e in r.events()}


def test_each_key_gets_its_own_batches_signed_with_its_own_secret(start_service, tmp_path, receiver):
    service = start_service(shard_size=10)
    a, b = service.client(KEY_A), service.client(KEY_B)
    at_a, at_b, at_global = receiver(), receiver(), receiver()
    # Created with the openai SDK's own webhooks client, as against OpenAI.
    endpoint_a = a.webhooks.create(name="team a", url=at_a.url, event_types=ALL_TYPES)
    endpoint_b = b.webhooks.create(name="team b", url=at_b.url, event_types=ALL_TYPES)
    for endpoint in (endpoint_a, endpoint_b):
        assert endpoint.object == "webhook_endpoint" and endpoint.id.startswith("we_")
        assert endpoint.signing_secret.startswith("whsec_") and len(base64.b64decode(endpoint.signing_secret[6:])) == 32
        assert endpoint.event_types == ALL_TYPES and endpoint.signing_secret_hint
    assert endpoint_a.signing_secret != endpoint_b.signing_secret

    a_done = end_batch(a, tmp_path / "a.jsonl", rows(2), "completed")
    a_failed = end_batch(a, tmp_path / "f.jsonl", [chat_request("x", "hi", model="nope")], "failed")
    b_done = end_batch(b, tmp_path / "b.jsonl", rows(1), "completed")
    deliver(service, urls=[at_global.url], ticks=2)

    assert by_batch(at_a) == {a_done: "batch.completed", a_failed: "batch.failed"}
    assert by_batch(at_b) == {b_done: "batch.completed"}
    assert by_batch(at_global) == {a_done: "batch.completed", a_failed: "batch.failed", b_done: "batch.completed"}
    assert len(at_a.posts) == 2 and len(at_b.posts) == 1 and len(at_global.posts) == 3  # each once

    # The openai SDK's verification: A's posts verify with A's secret only; the global ones with the global secret.
    sdk = OpenAI(api_key="unused")
    for headers, body, _ in at_a.posts:
        event = sdk.webhooks.unwrap(body.decode(), headers, secret=endpoint_a.signing_secret)
        assert event.type == by_batch(at_a)[event.data.id]
        for other in (endpoint_b.signing_secret, GLOBAL_SECRET):
            with pytest.raises(openai.InvalidWebhookSignatureError):
                sdk.webhooks.unwrap(body.decode(), headers, secret=other)
    for headers, body, _ in at_global.posts:
        sdk.webhooks.unwrap(body.decode(), headers, secret=GLOBAL_SECRET)
        with pytest.raises(openai.InvalidWebhookSignatureError):
            sdk.webhooks.unwrap(body.decode(), headers, secret=endpoint_a.signing_secret)
    # One event, one id: the same webhook-id reaches the owner's endpoint and the global one.
    assert {h["webhook-id"] for h, _, _ in at_a.posts} <= {h["webhook-id"] for h, _, _ in at_global.posts}

    # Owner-scoped like files and batches: each key lists its own, never a secret; another key's id is a 404.
    assert [e.id for e in a.webhooks.list()] == [endpoint_a.id]
    assert [e.id for e in b.webhooks.list()] == [endpoint_b.id]
    assert a.webhooks.retrieve(endpoint_a.id).url == at_a.url
    with service.http(KEY_A) as http:
        listed = http.get("/v1/webhook_endpoints").json()
    assert listed["object"] == "list" and "signing_secret" not in listed["data"][0]
    assert listed["data"][0]["signing_secret_hint"] == endpoint_a.signing_secret_hint
    assert endpoint_a.signing_secret[10:] not in str(listed)
    for call in (b.webhooks.retrieve, b.webhooks.delete):
        with pytest.raises(openai.NotFoundError) as caught:
            call(endpoint_a.id)
        assert caught.value.body["param"] == "webhook_endpoint_id"
    assert a.webhooks.retrieve(endpoint_a.id).id == endpoint_a.id  # B's attempt deleted nothing
    assert a.webhooks.event_types.list().data == ALL_TYPES


def test_subscriptions_and_deletion(start_service, tmp_path, receiver):
    service = start_service(shard_size=10)
    a = service.client(KEY_A)
    failures, down = receiver(), receiver(*[500] * 10)
    failures_only = a.webhooks.create(name="failures", url=failures.url, event_types=["batch.failed"])
    flaky = a.webhooks.create(name="down", url=down.url, event_types=ALL_TYPES)

    end_batch(a, tmp_path / "a.jsonl", rows(1), "completed")
    deliver(service)
    assert failures.posts == []  # subscribed to batch.failed only
    assert [status for _, _, status in down.posts] == [500]

    deleted = a.webhooks.delete(flaky.id)
    assert (deleted.id, deleted.deleted, deleted.object) == (flaky.id, True, "webhook_endpoint.deleted")
    deliver(service, ticks=3)  # the retry was due at once (no backoff here): it is never attempted
    assert len(down.posts) == 1
    failed = end_batch(a, tmp_path / "f.jsonl", [chat_request("x", "hi", model="nope")], "failed")
    deliver(service, ticks=2)
    assert len(down.posts) == 1  # and nothing new is planned for it
    assert by_batch(failures) == {failed: "batch.failed"}

    assert [e.id for e in a.webhooks.list()] == [failures_only.id]
    for call in (a.webhooks.retrieve, a.webhooks.delete):
        with pytest.raises(openai.NotFoundError):
            call(flaky.id)
    store = Database(service.config.database_url)
    with store.session() as session:
        row = session.scalar(select(WebhookEndpointRecord).where(WebhookEndpointRecord.id == flaky.id))
        assert row.deleted_at is not None and row.secret is None  # its secret is not kept
        pending = session.scalar(select(WebhookDelivery).where(WebhookDelivery.endpoint_id == flaky.id))
        assert (pending.attempts, pending.last_error) == (1, outbox.DELETED) and pending.failed_at is not None
    store.dispose()


@pytest.mark.parametrize("url", ["ftp://example.com/hook", "example.com/hook", "http://", "https:///path",
                                 "http://[::1/hook", "http://example.com:99999/", "javascript:alert(1)", "",
                                 "http://exa mple.com/", "http://example.com/\n", "https://" + "a" * 1030])
def test_a_url_must_be_http_or_https_with_a_host(shared_service, url):
    service = shared_service(webhook_allow=ALLOW)
    with service.http(KEY_A) as http:
        response = http.post("/v1/webhook_endpoints", json={"url": url, "name": "x"})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "url" and error["type"] == "invalid_request_error", error
        assert http.get("/v1/webhook_endpoints").json()["data"] == []


def test_event_types_and_the_endpoint_limit(start_service):
    service = start_service(worker=False)
    with service.http(KEY_A) as a, service.http(KEY_B) as b:
        for event_types in (["response.completed"], [], ["batch.completed", "batch.done"], "batch.completed"):
            response = a.post("/v1/webhook_endpoints", json={"url": "https://example.com/h", "event_types": event_types})
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"].startswith("event_types"), response.text
        # Name and event types may be left out: every batch event then.
        first = a.post("/v1/webhook_endpoints", json={"url": "HTTPS://Example.com:8443/hook?team=a"}).json()
        assert first["event_types"] == ALL_TYPES and first["name"] == "" and first["signing_secret"].startswith("whsec_")
        ids = [first["id"]] + [a.post("/v1/webhook_endpoints", json={"url": f"http://10.0.0.{i}/h"}).json()["id"]
                               for i in range(outbox.MAX_ENDPOINTS_PER_OWNER - 1)]
        over = a.post("/v1/webhook_endpoints", json={"url": "http://example.com/one-more"})
        assert over.status_code == 400 and over.json()["error"]["code"] == "too_many_webhook_endpoints", over.text
        assert b.post("/v1/webhook_endpoints", json={"url": "http://example.com/b"}).status_code == 200  # per key
        page = a.get("/v1/webhook_endpoints", params={"limit": 10}).json()
        assert [e["id"] for e in page["data"]] == ids[::-1][:10] and page["has_more"]
        rest = a.get("/v1/webhook_endpoints", params={"after": page["last_id"]}).json()
        assert [e["id"] for e in rest["data"]] == ids[::-1][10:] and not rest["has_more"]
        assert a.delete(f"/v1/webhook_endpoints/{ids[3]}").json()["deleted"] is True
        assert a.post("/v1/webhook_endpoints", json={"url": "http://example.com/again"}).status_code == 200
    with service.http(None) as anonymous:
        assert anonymous.post("/v1/webhook_endpoints", json={"url": "http://example.com/h"}).status_code == 401


def test_planning_counts_only_endpoints_that_existed_when_the_batch_ended(tmp_path):
    store = Database(f"sqlite:///{tmp_path / 'store.db'}")
    store.upgrade()
    with store.session() as s:
        repo.ensure_owners(s, ["a", "b"])
        same_url = "http://127.0.0.1:9/hook"
        before = outbox.add_endpoint(s, "a", url=same_url, name="", event_types=ALL_TYPES)
        later = outbox.add_endpoint(s, "a", url="http://127.0.0.1:9/later", name="", event_types=ALL_TYPES)
        later.created_at = before.created_at + 10
        outbox.add_endpoint(s, "b", url="http://127.0.0.1:9/b", name="", event_types=ALL_TYPES)
        event = add_event(s, "batch_1", "a", "batch.completed", at=before.created_at + 5)
        s.commit()
        assert outbox.plan(s, [same_url, same_url]) == 1
        planned = {(d.endpoint_id, d.url) for d in s.scalars(select(WebhookDelivery))}
        # The global URL once, the same URL again as A's endpoint (its own secret); not the later one, not B's.
        assert planned == {(None, same_url), (before.id, same_url)}
        secrets = {d.endpoint_id: secret for d, _, secret in outbox.due(s, at=event.created_at)}
        assert secrets == {None: None, before.id: before.secret}
        assert outbox.plan(s, [same_url]) == 0  # planned once
    store.dispose()
