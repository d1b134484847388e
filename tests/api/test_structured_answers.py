"""Structured answers through the API: a line whose answer does not follow its schema stays in the output file,
marked with its first violation, and is counted (request_counts.invalid_structured) on the Batch object, in the
webhook event and in /metrics; a retry may take only those lines; the error breaker counts them when the batch asks.
The real engine's answers: tests/system/test_structured.py."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select

from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile.contract import RequestCounts
from batch_dagster.batchfile.failure import breaker_tripped
from batch_dagster.batchfile.results import CommittedShard
from batch_dagster.db import Database
from batch_dagster.db.models import WebhookEvent
from batch_dagster.features.webhooks import event_data
from tests.helpers import CHAT_MODEL, FakeEngine, chat_request, file_lines, upload, wait_for

CREATE = {"endpoint": "/v1/chat/completions", "completion_window": "24h"}
LABEL = {"type": "object", "properties": {"label": {"enum": ["positive", "negative"]}}, "required": ["label"]}
SCHEMA = {"type": "json_schema", "json_schema": {"name": "label", "schema": LABEL, "strict": True}}
TOOL = {"type": "function", "function": {"name": "tag", "parameters": LABEL}}


class Parrot(FakeEngine):
    """Answers each request with its own user message, so a test writes every answer, valid or not."""

    def run(self, endpoint, requests, on_progress=None):
        lines = super().run(endpoint, requests, on_progress)
        said = {cid: body["messages"][-1]["content"] for cid, body in requests}
        for line in lines:
            if c.is_success(line):
                line["response"]["body"]["choices"][0]["message"]["content"] = said[line["custom_id"]]
        return lines


def labelling_rows() -> list[dict]:
    return [
        chat_request("ok-1", '{"label": "positive"}', response_format=SCHEMA),
        chat_request("ok-2", '{"label": "negative"}', response_format=SCHEMA),
        chat_request("bad-enum", '{"label": "happy"}', response_format=SCHEMA),
        chat_request("bad-text", "Positive, I think.", response_format=SCHEMA),
        chat_request("bad-tool", '{"label": "positive"}', tools=[TOOL], tool_choice="required"),  # no call made
        chat_request("plain", "hello"),  # asks for no structure: never checked
    ]


def test_invalid_structured_answers_are_kept_marked_counted_and_retried_alone(start_service, tmp_path):
    service = start_service(shard_size=4, engine=Parrot())
    client = service.client()
    requests = labelling_rows()
    batch = wait_for(client, client.batches.create(input_file_id=upload(client, tmp_path / "in.jsonl", requests),
                                                   **CREATE).id, "completed")
    assert batch.request_counts.model_dump() == {"total": 6, "completed": 6, "failed": 0, "invalid_structured": 3}
    out = {x["custom_id"]: x for x in file_lines(client, batch.output_file_id)}
    assert set(out) == {r["custom_id"] for r in requests}  # each kept in the output file, as the engine answered it
    marks = {cid: x.get(c.INVALID_STRUCTURED) for cid, x in out.items()}
    assert marks["bad-enum"] == {"answer": "/choices/0/message/content", "pointer": "/label",
                                 "reason": "'happy' is not one of ['positive', 'negative']"}
    assert marks["bad-text"]["reason"].startswith("not JSON: ") and marks["bad-text"]["pointer"] == ""
    assert marks["bad-tool"] == {"answer": "/choices/0/message/tool_calls", "pointer": "",
                                 "reason": "no tool call, though tool_choice asked for one"}
    assert marks["ok-1"] is marks["ok-2"] is marks["plain"] is None
    assert out["bad-enum"]["response"]["body"]["choices"][0]["message"]["content"] == '{"label": "happy"}'

    # The webhook event and /metrics carry the count, by key and model.
    with Database(service.config.database_url).session() as session:
        events = list(session.scalars(select(WebhookEvent).where(WebhookEvent.batch_id == batch.id)))
        assert [data["request_counts"]["invalid_structured"] for data in event_data(session, events).values()] == [3]
    scraped = httpx.get(service.metrics_url, timeout=30).text  # the metrics' own listener
    flagged = {(s.labels["model"], s.labels["problem"]): s.value for family in text_string_to_metric_families(
        scraped) for s in family.samples if s.name == "batch_dagster_structured_answers_flagged_total"}
    assert flagged == {(CHAT_MODEL, "invalid"): 3, (CHAT_MODEL, "incomplete"): 0}  # one key: its own series

    # A retry of only those lines: the child runs the three, and the merged output holds every line once.
    child = client.post(f"/batches/{batch.id}/retry", cast_to=openai.types.Batch,
                        body={"only": ["invalid_structured"]})
    child = wait_for(client, child.id, "completed")
    assert sorted(x["custom_id"] for x in file_lines(client, child.output_file_id)) == ["bad-enum", "bad-text",
                                                                                        "bad-tool"]
    assert child.request_counts.model_dump() == {"total": 3, "completed": 3, "failed": 0, "invalid_structured": 3}
    merged = file_lines(client, child.output_file_id, merged=True)
    assert sorted(x["custom_id"] for x in merged) == sorted(r["custom_id"] for r in requests)
    # Nothing cut short, nothing failed: a retry of those has nothing to run; a filter not offered is a 400.
    for only in (["incomplete_structured"], ["failed"]):
        with pytest.raises(openai.BadRequestError, match="no request to retry"):
            client.post(f"/batches/{batch.id}/retry", cast_to=openai.types.Batch, body={"only": only})
    with pytest.raises(openai.BadRequestError) as refused:
        client.post(f"/batches/{batch.id}/retry", cast_to=openai.types.Batch, body={"only": ["wrong"]})
    assert refused.value.body["param"].startswith("only"), refused.value.body


def test_the_error_breaker_counts_invalid_structured_answers_when_the_batch_asks(start_service, tmp_path):
    service = start_service(shard_size=2, engine=Parrot(), error_breaker_lines=2)
    client = service.client()
    wrong = [chat_request(f"r{i}", "not JSON", response_format=SCHEMA) for i in range(6)]
    file_id = upload(client, tmp_path / "in.jsonl", wrong)
    ran_on = wait_for(client, client.batches.create(input_file_id=file_id, **CREATE).id, {"completed", "failed"})
    assert ran_on.status == "completed" and ran_on.request_counts.model_dump()["invalid_structured"] == 6
    asked = client.batches.create(input_file_id=file_id, **CREATE, extra_body={"error_breaker_structured": True})
    assert asked.model_extra["error_breaker_structured"] is True
    stopped = wait_for(client, asked.id, {"completed", "failed"})
    assert stopped.status == "failed" and [e.code for e in stopped.errors.data] == [c.ERROR_RATE_EXCEEDED]
    assert stopped.request_counts.model_dump() == {"total": 6, "completed": 2, "failed": 4, "invalid_structured": 2}
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id=file_id, **CREATE, extra_body={"error_breaker_structured": "yes"})


def test_the_breaker_adds_structured_answers_only_when_asked():
    wrong = CommittedShard(0, RequestCounts(total=2, completed=2, invalid_structured=1, incomplete_structured=1))
    assert not breaker_tripped([wrong, wrong], 4, 0.95)
    assert breaker_tripped([wrong, wrong], 4, 0.95, structured=True)
