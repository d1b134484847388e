"""/v1/messages/batches through the official `anthropic` SDK (`client.messages.batches`), on the fake engine: the
Message Batch object, its results file, list cursors, cancel, delete, errors in Anthropic's shape and the key in
`x-api-key`."""

from __future__ import annotations

import datetime as dt
import time

import anthropic
import httpx
import pytest

from batch_dagster.batchfile import contract as c
from tests.helpers import CHAT_MODEL, KEY_A, KEY_B, tls


def client(service, api_key: str = KEY_A) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=service.url, api_key=api_key, max_retries=0, timeout=30)


def request(custom_id: str, text: str, **params) -> dict:
    return {"custom_id": custom_id, "params": {"model": CHAT_MODEL, "max_tokens": 16,
                                               "messages": [{"role": "user", "content": text}], **params}}


def ended(batches, batch_id: str, timeout_s: float = 60):
    deadline = time.time() + timeout_s
    while (batch := batches.retrieve(batch_id)).processing_status != "ended":
        assert time.time() < deadline, f"{batch_id} is still {batch.processing_status}"
        time.sleep(0.2)
    return batch


def test_the_sdks_batch_lifecycle_create_poll_results_delete(start_service):
    service = start_service()
    service.engine.refuse = {"refused"}  # the engine answers it with a 400, as vLLM does a request it refuses
    batches = client(service).messages.batches
    created = batches.create(requests=[
        request("one", "the quick brown fox"),
        request("two", "hello there", system=[{"type": "text", "text": "Be brief."}]),
        request("refused", "hi"),
        request("three", "one two three four"),
    ])
    assert created.type == "message_batch" and created.processing_status == "in_progress"
    assert created.request_counts.processing == 4 and created.results_url is None and created.ended_at is None
    assert created.expires_at - created.created_at == dt.timedelta(days=1)

    batch = ended(batches, created.id)
    assert batch.request_counts.model_dump() == {"processing": 0, "succeeded": 3, "errored": 1, "canceled": 0,
                                                 "expired": 0}
    assert batch.results_url.endswith(f"/v1/messages/batches/{batch.id}/results") and batch.ended_at is not None

    results = {r.custom_id: r.result for r in batches.results(batch.id)}
    assert set(results) == {"one", "two", "three", "refused"}
    assert results["one"].type == "succeeded"
    assert [b.text for b in results["one"].message.content] == ["echo: the quick brown fox"]
    assert results["two"].message.content[0].text == "echo: hello there"
    assert results["two"].message.usage.input_tokens == 2
    refused = results["refused"].error.error
    assert results["refused"].type == "errored" and refused.type == "invalid_request_error"
    assert refused.message == "fake refusal"

    # The same batch is a batch like any other, billed as one.
    openai_view = service.http().get(f"/v1/batches/{batch.id}").json()
    assert openai_view["endpoint"] == c.MESSAGES and openai_view["request_counts"]["completed"] == 3
    assert openai_view["usage"]["input_tokens"] == 4 + 2 + 4

    deleted = batches.delete(batch.id)
    assert deleted.id == batch.id and deleted.type == "message_batch_deleted"
    with pytest.raises(anthropic.NotFoundError) as gone:
        batches.retrieve(batch.id)
    assert gone.value.body["error"]["type"] == "not_found_error"


def test_cancel_keeps_the_finished_requests_and_the_rest_are_canceled(start_service):
    service = start_service(shard_size=1)
    batches = client(service).messages.batches
    ids: list[str] = []
    service.engine.on_call = lambda n: n == 2 and batches.cancel(ids[0])
    ids.append(batches.create(requests=[request(f"r{i}", f"text {i}") for i in range(5)]).id)
    batch = ended(batches, ids[0])
    assert batch.cancel_initiated_at is not None and batch.ended_at is not None
    counts = batch.request_counts
    assert counts.succeeded >= 1 and counts.canceled >= 1 and counts.succeeded + counts.canceled == 5
    kinds = {r.custom_id: r.result.type for r in batches.results(batch.id)}
    assert sorted(kinds) == [f"r{i}" for i in range(5)]
    assert list(kinds.values()).count("canceled") == counts.canceled
    with pytest.raises(anthropic.BadRequestError) as again:
        batches.cancel(batch.id)
    assert again.value.body["error"]["type"] == "invalid_request_error"


def test_list_pages_newest_first_by_after_id_and_before_id(shared_service):
    service = shared_service()
    batches = client(service, KEY_B).messages.batches
    made = [batches.create(requests=[request("a", "x")]).id for _ in range(5)]
    first = batches.list(limit=2)
    assert [b.id for b in first.data] == made[:-3:-1] and first.has_more
    assert first.first_id == made[-1] and first.last_id == made[-2]
    assert [b.id for b in batches.list(limit=2)] == made[::-1]  # the SDK follows after_id to the end
    newer = batches.list(before_id=made[0], limit=2)
    assert [b.id for b in newer.data] == [made[2], made[1]] and newer.has_more
    # Another key's batches, and the OpenAI-format batches, are not listed.
    assert client(service).messages.batches.list().data == []


def test_errors_are_in_anthropics_shape_and_the_key_is_x_api_key(shared_service):
    service = shared_service()
    http = httpx.Client(base_url=service.url, verify=tls())
    unauthenticated = http.get("/v1/messages/batches")
    assert unauthenticated.status_code == 401
    assert unauthenticated.json() == {"type": "error", "error": {"type": "authentication_error",
                                                                 "message": unauthenticated.json()["error"]["message"]}}
    with pytest.raises(anthropic.AuthenticationError):
        client(service, "sk-wrong").messages.batches.list()
    headers = {"x-api-key": KEY_A, "anthropic-version": "2023-06-01"}
    assert http.get("/v1/messages/batches", headers=headers).status_code == 200
    # The OpenAI routes keep their shape and their header.
    assert http.get("/v1/batches", headers=headers).status_code == 401
    assert "message" in http.get("/v1/batches").json()["error"]

    batches = client(service).messages.batches
    for requests, where in (([], "requests"), ([{"custom_id": "a b", "params": {}}], "requests.0.custom_id"),
                            ([request("a", "x"), request("a", "y")], "requests.1.custom_id"),
                            ([{"custom_id": "a", "params": "text"}], "requests.0.params")):
        with pytest.raises(anthropic.BadRequestError) as refused:
            batches.create(requests=requests)
        assert refused.value.body["type"] == "error" and refused.value.body["error"]["type"] == "invalid_request_error"
        assert refused.value.body["error"]["message"].startswith(where)
    with pytest.raises(anthropic.NotFoundError):
        batches.retrieve("batch_nope")
    created = batches.create(requests=[request("a", "x")])
    early = http.get(f"/v1/messages/batches/{created.id}/results", headers=headers)  # no worker: not ended
    assert early.status_code == 404 and early.json()["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.AnthropicError, match="results_url"):  # the SDK asks for them only once ended
        batches.results(created.id)
    with pytest.raises(anthropic.BadRequestError):
        batches.delete(created.id)
    # Another key's batch is not found, whatever it asks.
    other = client(service, KEY_B).messages.batches
    for call in (other.retrieve, other.cancel, other.delete):
        with pytest.raises(anthropic.NotFoundError):
            call(created.id)


def test_a_batch_whose_input_is_refused_ends_with_every_request_errored_saying_why(start_service):
    service = start_service()
    batches = client(service).messages.batches
    created = batches.create(requests=[request("a", "x"), {"custom_id": "b", "params": {
        "model": "another-model", "max_tokens": 4, "messages": [{"role": "user", "content": "y"}]}}])
    batch = ended(batches, created.id)
    assert service.http().get(f"/v1/batches/{batch.id}").json()["status"] == "failed"
    assert batch.request_counts.model_dump() == {"processing": 0, "succeeded": 0, "errored": 2, "canceled": 0,
                                                 "expired": 0}
    results = {r.custom_id: r.result for r in batches.results(batch.id)}
    assert sorted(results) == ["a", "b"] and {r.type for r in results.values()} == {"errored"}
    assert all(r.error.error.type == "invalid_request_error" and "another-model" in r.error.error.message
               for r in results.values())


def test_a_repeated_create_with_its_idempotency_key_answers_the_first_message_batch(start_service):
    """The anthropic SDK sends the header with `extra_headers`: a repeat answers the Message Batch the first made; the
    same key with other requests is a 409 in Anthropic's shape; another key's same header makes its own batch."""
    service = start_service(worker=False)
    once = {"Idempotency-Key": "labels-2026-12-04"}
    batches = client(service).messages.batches
    first = batches.create(requests=[request("one", "hello")], extra_headers=once)
    again = batches.create(requests=[request("one", "hello")], extra_headers=once)
    assert again.id == first.id and [b.id for b in batches.list()] == [first.id]
    with pytest.raises(anthropic.ConflictError) as refused:
        batches.create(requests=[request("one", "goodbye")], extra_headers=once)
    assert refused.value.body["error"]["type"] == "invalid_request_error"
    assert "Idempotency-Key" in refused.value.body["error"]["message"]
    theirs = client(service, KEY_B).messages.batches.create(requests=[request("one", "hello")], extra_headers=once)
    assert theirs.id != first.id
