"""Anthropic's Message Batches through the official `anthropic` SDK, unchanged but for its base URL and key, against
`python -m batch_dagster.serve` on the real engine (the session's vLLM server as the model's fleet, behind a gate that
can hold its requests): create, poll, every result's message read, cancel with partial results, expiry.

(The same Messages lines through the in-process engine and a fleet, compared line by line: tests/system/test_parity.py.)
"""

from __future__ import annotations

import time

import pytest

from tests.helpers import CHAT_MODEL, CONCISE, SERVE_API_KEY, InferenceGate, Serve

pytestmark = pytest.mark.engine

CAPITALS = {"France": "Paris", "Italy": "Rome", "Japan": "Tokyo", "Germany": "Berlin"}
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}


def request(custom_id: str, country: str, **params) -> dict:
    return {"custom_id": custom_id, "params": {
        "model": CHAT_MODEL, "max_tokens": 16, "temperature": 0, "system": CONCISE,
        "messages": [{"role": "user", "content": f"What is the capital of {country}?"}], **params}}


def client(serve: Serve):
    import anthropic

    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{serve.api_port}", api_key=SERVE_API_KEY, max_retries=0,
                               timeout=60)


def ended(serve: Serve, batch_id: str, timeout_s: float = 300):
    batches, deadline = client(serve).messages.batches, time.time() + timeout_s
    while (batch := batches.retrieve(batch_id)).processing_status != "ended":
        assert time.time() < deadline and serve.proc.poll() is None, (batch, serve.logs())
        time.sleep(0.5)
    return batch


def text(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


@pytest.fixture(scope="module")
def gated(tmp_path_factory, vllm_server):
    """serve, shards of 2, its model's fleet the session's vLLM server behind a gate (open unless a test closes it)."""
    with InferenceGate(vllm_server) as gate, \
            Serve(tmp_path_factory.mktemp("messages"), BATCH_FLEET_URLS=f"{CHAT_MODEL}={gate.url}",
                  BATCH_SHARD_SIZE="2") as serve:
        gate.open()
        yield serve, gate


def test_the_sdk_creates_polls_and_reads_every_message(gated):
    serve, _ = gated
    batches = client(serve).messages.batches
    requests = [request(country, country) for country in CAPITALS]
    requests.append(request("json", "France", max_tokens=40, output_config={"format": {"type": "json_schema",
                                                                                         "schema": CITY}}))
    requests.append(request("refused", "France", max_tokens=2048, thinking={"type": "enabled", "budget_tokens": 1024}))
    created = batches.create(requests=requests)
    assert created.processing_status == "in_progress" and created.request_counts.processing == len(requests)

    batch = ended(serve, created.id)
    assert batch.request_counts.model_dump() == {"processing": 0, "succeeded": 5, "errored": 1, "canceled": 0,
                                                 "expired": 0}, serve.logs()
    results = {line.custom_id: line.result for line in batches.results(batch.id)}
    assert set(results) == {*CAPITALS, "json", "refused"}
    for country, city in CAPITALS.items():
        result = results[country]
        assert result.type == "succeeded" and result.message.type == "message" and result.message.role == "assistant"
        assert city in text(result.message), (country, text(result.message))
        assert result.message.model == CHAT_MODEL and result.message.stop_reason in ("end_turn", "max_tokens")
        assert result.message.usage.input_tokens > 0 and 0 < result.message.usage.output_tokens <= 16
    import json

    assert set(json.loads(text(results["json"].message))) == {"city"}
    refused = results["refused"]
    assert refused.type == "errored" and refused.error.error.type == "invalid_request_error"
    assert "body.thinking" in refused.error.error.message and "--reasoning-config" in refused.error.error.message

    # A batch like any other: its usage is the messages' own.
    usage = serve.client().batches.retrieve(batch.id).usage
    messages = [r.message for r in results.values() if r.type == "succeeded"]
    assert usage.input_tokens == sum(m.usage.input_tokens for m in messages)
    assert usage.output_tokens == sum(m.usage.output_tokens for m in messages)
    assert [b.id for b in batches.list(limit=5)][0] == batch.id
    assert batches.delete(batch.id).id == batch.id


COUNTRIES = [*CAPITALS, "Spain", "Portugal", "Greece", "Egypt", "Peru", "Kenya"]


def running(serve: Serve, batch_id: str) -> None:
    """Until the batch runs (validation counts its tokens on the fleet too, so the gate stays open until then)."""
    deadline = time.time() + 180
    while serve.client().batches.retrieve(batch_id).status != "in_progress":
        assert time.time() < deadline, serve.logs()
        time.sleep(0.2)


def test_cancel_keeps_the_answers_given_and_the_rest_are_canceled(gated):
    serve, gate = gated
    batches = client(serve).messages.batches
    created = batches.create(requests=[request(f"r{i}", country) for i, country in enumerate(COUNTRIES)])
    running(serve, created.id)
    gate.close()  # the shard in flight waits at the gate while the batch is canceled
    try:
        canceling = batches.cancel(created.id)
        assert canceling.processing_status == "canceling" and canceling.cancel_initiated_at is not None
    finally:
        gate.open()
    batch = ended(serve, created.id)
    counts = batch.request_counts
    assert counts.processing == 0 and counts.errored == 0 and counts.expired == 0
    assert counts.canceled >= 1 and counts.succeeded + counts.canceled == len(COUNTRIES), counts
    results = {line.custom_id: line.result for line in batches.results(batch.id)}
    assert sorted(results) == sorted(f"r{i}" for i in range(len(COUNTRIES)))
    answered = {cid: r for cid, r in results.items() if r.type == "succeeded"}
    assert len(answered) == counts.succeeded
    for result in answered.values():
        assert result.message.content and text(result.message)
    assert [r.type for r in results.values()].count("canceled") == counts.canceled


def test_a_batch_past_its_window_expires_with_the_answers_given(tmp_path, vllm_server):
    """The 24h window made 45 s here: once the batch runs, its requests are held past the deadline, then answered;
    no shard starts after it."""
    with InferenceGate(vllm_server) as gate, \
            Serve(tmp_path, BATCH_FLEET_URLS=f"{CHAT_MODEL}={gate.url}", BATCH_SHARD_SIZE="2",
                  BATCH_COMPLETION_WINDOWS="24h=45") as serve:
        gate.open()
        batches = client(serve).messages.batches
        created = batches.create(requests=[request(f"r{i}", country) for i, country in enumerate(COUNTRIES)])
        assert (created.expires_at - created.created_at).total_seconds() == 45
        running(serve, created.id)
        gate.close()
        try:
            time.sleep(max(0.0, created.expires_at.timestamp() - time.time()) + 2)
        finally:
            gate.open()
        batch = ended(serve, created.id)
        results = {line.custom_id: line.result for line in batches.results(batch.id)}
        logs = serve.logs()
    counts = batch.request_counts
    assert counts.expired >= 1 and counts.succeeded + counts.expired == len(COUNTRIES), (counts, logs)
    assert counts.errored == 0 and counts.canceled == 0
    assert sorted(results) == sorted(f"r{i}" for i in range(len(COUNTRIES)))
    assert [r.type for r in results.values()].count("expired") == counts.expired
    for result in results.values():
        assert result.type == "expired" or text(result.message)
