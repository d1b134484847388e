"""Webhooks to real HTTP receivers on loopback: OpenAI's event shape, Standard Webhooks signatures (checked here
with hmac, independently of the sender), retries with backoff, and endpoints that are down or hang."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import socket
import time

import dagster as dg
import pytest
from openai import OpenAI
from sqlalchemy import func, select

from batch_dagster.db import Database
from batch_dagster.db.models import WebhookDelivery, WebhookEvent
from batch_dagster.defs.resources import DatabaseResource
from batch_dagster.defs.webhooks import WebhookConfig, webhook_sensor
from batch_dagster.features.webhooks import backoff_s, check_secret
from tests.helpers import Receiver, chat_request, free_port, rows, upload, wait_for

SECRET = "whsec_" + base64.b64encode(b"a test secret of 32 bytes.......").decode()
CHAT = "/v1/chat/completions"


def verify(secret: str, headers, body: bytes) -> bool:
    """The Standard Webhooks check, written from the spec: v1,base64(HMAC-SHA256(key, id.timestamp.body))."""
    key = base64.b64decode(secret.removeprefix("whsec_"))
    signed = f"{headers['webhook-id']}.{headers['webhook-timestamp']}.".encode() + body
    expected = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
    return any(sig == f"v1,{expected}" for sig in headers["webhook-signature"].split(" "))


@pytest.fixture
def hanging_url():
    """An endpoint that accepts connections and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}/hook"
    sock.close()


def test_terminal_batches_are_posted_signed_retried_and_never_held_up(start_service, tmp_path, hanging_url, capsys):
    service = start_service(worker=False, shard_size=10)
    client = service.client()
    cancelled = client.batches.create(input_file_id=upload(client, tmp_path / "c.jsonl", rows(2)), endpoint=CHAT,
                                      completion_window="24h")
    client.batches.cancel(cancelled.id)
    completed = client.batches.create(input_file_id=upload(client, tmp_path / "a.jsonl", rows(3)), endpoint=CHAT,
                                      completion_window="24h")
    failed = client.batches.create(input_file_id=upload(client, tmp_path / "f.jsonl", [chat_request("x", "hi", model="nope")]),
                                   endpoint=CHAT, completion_window="24h")
    service.start_worker()
    for batch, status in ((completed, "completed"), (cancelled, "cancelled"), (failed, "failed")):
        assert wait_for(client, batch.id, {"completed", "cancelled", "failed", "expired"}).status == status
        client.batches.retrieve(batch.id)  # observed again: still one event

    good, flaky = Receiver(), Receiver(500, 503)
    down = f"http://127.0.0.1:{free_port()}/hook"  # nothing listens there
    # 3 s each: the first POSTs of a process also import httpx's async stack, which on a loaded CI machine took
    # over 1 s (every endpoint, the good one too, then timed out).
    webhooks = WebhookConfig(urls=[good.url, flaky.url, down, hanging_url], secret=SECRET, timeout_s=3.0,
                             max_attempts=3, first_backoff_s=0)
    context = dg.build_sensor_context(instance=service.instance, resources={
        "database": DatabaseResource(url=service.config.database_url), "webhooks": webhooks})

    started = time.monotonic()
    webhook_sensor(context)
    # The hanging and the dead endpoint cost one timeout, not one per delivery (3 in a row: 9 s), and held nothing
    # else up.
    assert time.monotonic() - started < 6
    expected = {completed.id: "batch.completed", cancelled.id: "batch.cancelled", failed.id: "batch.failed"}
    assert {e["data"]["id"]: e["type"] for e in good.events()} == expected
    # The operator's log says each webhook sent, at info, by the receiver's host (a URL may hold a secret).
    logged = capsys.readouterr().err
    for batch_id, event in expected.items():
        assert f"INFO - {event} {batch_id} -> 127.0.0.1: delivered (attempt 1)" in logged, logged[-3000:]
    assert "/hook" not in logged
    for _ in range(3):
        webhook_sensor(context)

    # Every event reached the good receiver exactly once, in OpenAI's shape, signed.
    assert len(good.posts) == 3
    for headers, body, _ in good.posts + flaky.posts:
        assert verify(SECRET, headers, body), headers
        assert abs(int(headers["webhook-timestamp"]) - time.time()) < 60
        event = json.loads(body)
        assert set(event) == {"id", "object", "type", "created_at", "data"} and event["object"] == "event"
        assert event["id"] == headers["webhook-id"] and event["id"].startswith("evt_")
        # OpenAI's data {id}, and the batch's final counts and usage (the same on every attempt).
        batch = client.batches.retrieve(event["data"]["id"])
        assert event["data"] == {"id": batch.id, "request_counts": batch.request_counts.model_dump(),
                                 "usage": batch.usage.model_dump()}, event
    by_id = {json.loads(body)["data"]["id"]: json.loads(body)["data"] for _, body, _ in good.posts}
    assert by_id[completed.id]["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    assert by_id[completed.id]["usage"]["output_tokens"] > 0 and by_id[failed.id]["usage"]["total_tokens"] == 0
    assert not verify("whsec_" + base64.b64encode(b"another secret of 32 bytes......").decode(), *good.posts[0][:2])
    # The openai SDK's own webhook verification accepts them, as it does OpenAI's batch events.
    sdk = OpenAI(api_key="unused", webhook_secret=SECRET)
    for headers, body, _ in good.posts:
        event = sdk.webhooks.unwrap(body.decode(), headers)
        assert event.type == expected[event.data.id]
        assert event.data.model_extra["request_counts"] == by_id[event.data.id]["request_counts"]  # kept as extras

    # The flaky receiver failed twice per event, then got each: retried, with the same webhook-id each time.
    assert {e["data"]["id"]: e["type"] for e in flaky.events()} == expected
    attempts: dict[str, list[int]] = {}
    for headers, _, status in flaky.posts:
        attempts.setdefault(headers["webhook-id"], []).append(status)
    assert sorted(attempts.values()) == [[200], [500, 200], [503, 200]]
    assert len(flaky.posts) == 5  # 3 events: the first two posts failed, then each event once more

    store = Database(service.config.database_url)
    with store.session() as session:
        per_batch = {batch_id: n for batch_id, n in session.execute(
            select(WebhookEvent.batch_id, func.count()).group_by(WebhookEvent.batch_id))}
        assert per_batch == {batch_id: 1 for batch_id in expected}
        deliveries = list(session.scalars(select(WebhookDelivery)))
        by_url: dict[str, list[WebhookDelivery]] = {}
        for d in deliveries:
            by_url.setdefault(d.url, []).append(d)
        assert all(d.delivered_at is not None for d in by_url[good.url] + by_url[flaky.url])
        for url in (down, hanging_url):  # given up after max_attempts, each attempt recorded
            assert all(d.attempts == 3 and d.failed_at is not None and d.last_error for d in by_url[url]), url
    store.dispose()
    assert "No webhook to deliver" in webhook_sensor(context).skip_message


def test_no_endpoint_means_no_delivery_and_no_flood_later(start_service, tmp_path):
    service = start_service(shard_size=10)
    client = service.client()
    batch = client.batches.create(input_file_id=upload(client, tmp_path / "a.jsonl", rows(1)), endpoint=CHAT,
                                  completion_window="24h")
    wait_for(client, batch.id, "completed")
    resources = {"database": DatabaseResource(url=service.config.database_url)}
    webhook_sensor(dg.build_sensor_context(instance=service.instance, resources={**resources,
                                           "webhooks": WebhookConfig()}))
    late = Receiver()
    webhook_sensor(dg.build_sensor_context(instance=service.instance, resources={
        **resources, "webhooks": WebhookConfig(urls=[late.url], secret=SECRET)}))
    assert late.posts == []  # the event was planned while no endpoint was configured


def test_secret_and_backoff_rules():
    assert check_secret(SECRET) is None
    assert "whsec_" in check_secret("not-a-secret")
    assert "base64" in check_secret("whsec_!!!")
    assert [backoff_s(n, 10) for n in (1, 2, 3, 4)] == [10, 20, 40, 80]
    assert backoff_s(30, 10) == 3600
    with dg.build_sensor_context(resources={"database": DatabaseResource(url="sqlite://"),
                                            "webhooks": WebhookConfig(urls=["http://x"], secret="bad")}) as context:
        skipped = webhook_sensor(context)
    assert "BATCH_WEBHOOK_SECRET must start with 'whsec_'" in skipped.skip_message
