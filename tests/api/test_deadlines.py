"""Completion windows through the openai SDK: the windows the operator offers (each its deadline and its price),
a clear 400 for any other, the queue ordering the earliest deadline first, and a batch that will miss its deadline
saying so before it expires (a field and a webhook event)."""

from __future__ import annotations

import dagster as dg
import openai
import pytest

from batch_dagster.batchfile.folder import BatchFolder
from batch_dagster.db import Database
from batch_dagster.db.models import WebhookEvent
from batch_dagster.defs.fairness import PRIORITY_TAG, RANK_TAG
from batch_dagster.defs.sensors import api_batch_sensor
from tests.helpers import rows, upload, wait_for


def create(client: openai.OpenAI, file_id: str, window: str, **extra):
    return client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                 completion_window=window, **extra)  # type: ignore[arg-type]


def test_each_offered_window_sets_the_deadline_and_the_price_and_any_other_is_a_400(start_service, tmp_path):
    service = start_service(completion_windows=("1h=600", "24h"))
    client = service.client()
    file_id = upload(client, tmp_path / "in.jsonl", rows(4, max_tokens=6))

    for window, code in (("2h", "completion_window_not_offered"), ("1 week", "invalid_completion_window"),
                         ("", "invalid_completion_window")):
        with pytest.raises(openai.BadRequestError) as refused:
            create(client, file_id, window)
        error = refused.value.body
        assert (error["code"], error["param"]) == (code, "completion_window") and "'1h', '24h'" in error["message"]
    assert client.batches.list().data == []  # nothing created
    # The OpenAPI document lists the windows this service offers.
    document = service.http().get("/openapi.json").json()
    assert document["components"]["schemas"]["CreateBatchRequest"]["properties"]["completion_window"]["enum"] == [
        "1h", "24h"]

    hour, day = create(client, file_id, "1h"), create(client, file_id, "24h")
    assert (hour.completion_window, hour.expires_at - hour.created_at) == ("1h", 600)  # its real length here
    assert (day.completion_window, day.expires_at - day.created_at) == ("24h", 86_400)
    service.start_worker()
    costs = {b.id: BatchFolder(service.storage.open(), b.id) for b in (wait_for(client, hour.id, "completed"),
                                                                        wait_for(client, day.id, "completed"))}
    hour_cost, day_cost = (costs[b.id].summary().cost for b in (hour, day))  # type: ignore[union-attr]
    # The shipped price table: the 1h window at 25% off, the 24h window at the batch discount, 50%.
    assert (hour_cost.batch_discount, day_cost.batch_discount) == (0.25, 0.5)
    assert hour_cost.total_cost == pytest.approx(day_cost.total_cost * 1.5)


def test_the_earlier_deadline_goes_first_and_a_batch_that_will_miss_its_deadline_says_so(start_service, tmp_path):
    # The 1h window is 5 s long: at the default rate (BATCH_ESTIMATE_TOKENS_PER_S) this file takes longer.
    service = start_service(worker=False, completion_windows=("1h=5", "24h"))
    client = service.client()
    file_id = upload(client, tmp_path / "in.jsonl", rows(40, max_tokens=16))
    patient = create(client, file_id, "24h")
    urgent = create(client, file_id, "1h")  # submitted later, due sooner
    assert urgent.meets_deadline is None and urgent.deadline_at_risk_at is None  # not placed yet
    # The launch sensor's tick: the run queue launches by these dagster/priority tags, the earliest deadline first.
    launched = api_batch_sensor(dg.build_sensor_context(instance=service.instance,
                                                        resources=service.worker.sensor_resources))
    assert isinstance(launched, dg.SensorResult)
    tags = {r.partition_key: r.tags for r in launched.run_requests or []}
    assert int(tags[urgent.id][PRIORITY_TAG]) > int(tags[patient.id][PRIORITY_TAG])
    assert int(tags[urgent.id][RANK_TAG]) < int(tags[patient.id][RANK_TAG])  # its key's later run, due sooner
    service.worker.follow()  # the queue placed

    now = {b.id: client.batches.retrieve(b.id) for b in (patient, urgent)}
    assert [now[b.id].queue_position for b in (urgent, patient)] == [1, 2]
    assert now[patient.id].meets_deadline is True and now[patient.id].deadline_at_risk_at is None
    late = now[urgent.id]
    assert late.meets_deadline is False and late.estimated_completion_at > late.expires_at
    assert late.created_at <= late.deadline_at_risk_at <= late.expires_at  # said before it expired
    service.worker.follow()  # flagged once
    store = Database(service.config.database_url)
    try:
        with store.session() as session:
            events = session.query(WebhookEvent).all()
            assert [(e.type, e.batch_id) for e in events] == [("batch.deadline_at_risk", urgent.id)]
    finally:
        store.dispose()
    assert "batch.deadline_at_risk" in service.http().get("/v1/webhook_event_types").json()["data"]


def test_a_window_the_batch_cannot_fit_by_its_models_measured_pace_is_a_400_at_create(start_service, tmp_path):
    service = start_service(completion_windows=("1h=1", "24h"))
    client = service.client()
    small = upload(client, tmp_path / "small.jsonl", rows(2, max_tokens=4))
    big = upload(client, tmp_path / "big.jsonl", rows(200, max_tokens=64))
    assert create(client, big, "1h").status == "validating"  # no measured batch of the model yet: no evidence
    wait_for(client, create(client, small, "24h").id, "completed")

    with pytest.raises(openai.BadRequestError) as refused:
        create(client, big, "1h")
    error = refused.value.body
    assert (error["code"], error["param"]) == ("deadline_unreachable", "completion_window")
    assert "'1h' leaves 1 s" in error["message"] and "Use a longer completion_window" in error["message"]
    before = len(client.batches.list(limit=100).data)
    assert create(client, big, "24h").status == "validating"  # the longer window fits
    assert len(client.batches.list(limit=100).data) == before + 1  # the refused one left nothing
