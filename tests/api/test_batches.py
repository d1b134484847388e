"""Batches through the API with the openai SDK, run by the real pipeline on the fake engine."""

from __future__ import annotations

import json
import threading
import time

import dagster as dg
import httpx
import openai
import pytest

from batch_dagster.batchfile.folder import BatchFolder, batch_ids
from batch_dagster.batchfile.options import BatchOptions
from batch_dagster.batchfile.windows import Window
from batch_dagster.db import Database, repo
from batch_dagster.engine.models import Models
from tests.helpers import (
    CHAT_MODEL,
    KEY_A,
    KEY_B,
    FakeEngine,
    FakeVLLM,
    chat_request,
    fake_vllm,
    rows,
    upload,
    wait_for,
)


def lines(client, file_id) -> list[dict]:
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines() if line.strip()]


def test_whole_cycle(start_service, tmp_path):
    service = start_service(shard_size=2)
    client = service.client()
    requests = rows(7, max_tokens=8) + [chat_request("bad-temp", "hi", temperature=-1)]
    file_id = upload(client, tmp_path / "in.jsonl", requests)

    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h",
                                  metadata={"job": "nightly"},
                                  output_expires_after={"anchor": "created_at", "seconds": 7200})
    assert batch.status == "validating" and batch.id.startswith("batch_")
    assert batch.expires_at == batch.created_at + 86_400
    seen: list[str] = []
    done = wait_for(client, batch.id, "completed", seen=seen)

    # Forward only through the lifecycle (wait_for stops at completed, so seen ends there by construction).
    assert seen == [s for s in ("validating", "in_progress", "finalizing", "completed") if s in seen]
    assert done.request_counts.model_dump() == {"total": 8, "completed": 7, "failed": 1}
    assert done.model == CHAT_MODEL and done.metadata == {"job": "nightly"} and done.errors is None
    assert done.created_at <= done.in_progress_at <= done.finalizing_at <= done.completed_at
    assert done.failed_at is done.cancelled_at is done.expired_at is None

    out, err = lines(client, done.output_file_id), lines(client, done.error_file_id)
    ids = [line["custom_id"] for line in out + err]
    assert sorted(ids) == sorted(r["custom_id"] for r in requests)  # every custom_id exactly once
    assert [e["custom_id"] for e in err] == ["bad-temp"] and err[0]["response"]["status_code"] == 400
    usages = [line["response"]["body"]["usage"] for line in out]
    assert done.usage.input_tokens == sum(u["prompt_tokens"] for u in usages)
    assert done.usage.output_tokens == sum(u["completion_tokens"] for u in usages)
    assert done.usage.total_tokens == sum(u["total_tokens"] for u in usages) > 0

    output = client.files.retrieve(done.output_file_id)
    assert output.purpose == "batch_output" and output.filename == f"{batch.id}_output.jsonl"
    assert output.expires_at == output.created_at + 7200
    assert output.bytes == len(client.files.content(done.output_file_id).content)
    assert {f.id for f in client.files.list(purpose="batch_output")} == {done.output_file_id, done.error_file_id}

    # The same batch is a partition of the Dagster pipeline, with its lineage materialized.
    assert batch.id in service.instance.get_dynamic_partitions("batches")
    event = service.instance.get_latest_materialization_event(dg.AssetKey("batch_usage"))
    assert event.dagster_event.partition == batch.id
    [run] = service.instance.get_runs(dg.RunsFilter(tags={"dagster/partition": batch.id}))
    assert run.job_name == "batch_job" and run.tags["source"] == "api"


def test_invalid_file_fails_with_lines_and_codes(start_service, tmp_path):
    service = start_service()
    client = service.client()
    bad = [chat_request("a", "hi"), "{not json", chat_request("a", "again"), chat_request("b", "x", model="nope")]
    file_id = upload(client, tmp_path / "bad.jsonl", bad)
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    failed = wait_for(client, batch.id, {"failed", "completed"})

    assert failed.status == "failed" and failed.failed_at is not None
    # A batch that never ran counts no requests (as OpenAI's do); what was wrong is in errors.data.
    assert failed.request_counts.model_dump() == {"total": 0, "completed": 0, "failed": 0}
    assert [(e.code, e.line) for e in failed.errors.data] == [
        ("invalid_json", 2), ("duplicate_custom_id", 3), ("mixed_models", 4)]
    assert failed.errors.data[1].param == "custom_id" and failed.errors.data[0].message
    assert failed.output_file_id is None and failed.error_file_id is None
    assert service.engine.calls == []


def test_requests_whose_url_is_not_the_batch_endpoint_fail_validation(start_service, tmp_path):
    service = start_service()
    client = service.client()
    file_id = upload(client, tmp_path / "chat.jsonl", rows(2))  # chat requests
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h")
    failed = wait_for(client, batch.id, {"failed", "completed"})
    assert failed.status == "failed"
    assert [(e.code, e.line, e.param) for e in failed.errors.data] == [("invalid_url", 1, "url"), ("invalid_url", 2, "url")]
    assert service.engine.calls == []


def test_list_pagination(start_service, tmp_path):
    service = start_service(worker=False)
    client = service.client()
    file_id = upload(client, tmp_path / "in.jsonl", rows(2))
    created = [client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                     completion_window="24h").id for _ in range(5)]
    newest_first = created[::-1]

    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == newest_first[:2] and first.has_more
    second = client.batches.list(limit=2, after=first.data[-1].id)
    assert [b.id for b in second.data] == newest_first[2:4] and second.has_more
    last = client.batches.list(limit=2, after=second.data[-1].id)
    assert [b.id for b in last.data] == newest_first[4:] and not last.has_more
    assert [b.id for b in client.batches.list(limit=2)] == newest_first  # the SDK pages on its own

    with service.http() as http:
        page = http.get("/v1/batches", params={"limit": 3}).json()
        assert page["object"] == "list" and page["first_id"] == newest_first[0] and page["last_id"] == newest_first[2]
        assert http.get("/v1/batches", params={"limit": 101}).status_code == 400
        assert http.get("/v1/batches", params={"after": "batch_unknown"}).status_code == 404
    assert client.batches.list().data[0].request_counts.total == 0


def test_list_filters_by_status_metadata_and_creation_time(start_service, tmp_path):
    service = start_service(worker=False)
    client = service.client()
    file_id = upload(client, tmp_path / "in.jsonl", rows(2))

    def create(**metadata):
        return client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h",
                                     metadata=metadata or None).id

    red, blue, plain = create(team="red", run="7"), create(team="blue"), create()
    client.batches.cancel(blue)

    def listed(**query) -> list[str]:  # the SDK reaches the extensions with extra_query, and pages over them
        return [b.id for b in client.batches.list(limit=1, extra_query=query)]

    assert listed(**{"metadata[team]": "red"}) == [red]
    assert listed(**{"metadata[team]": "red", "metadata[run]": "8"}) == []
    assert listed(status="cancelling") == [blue] and listed(status="validating") == [plain, red]
    created = client.batches.retrieve(red).created_at
    assert set(listed(created_after=created)) == {red, blue, plain} and listed(created_before=created) == []
    with service.http() as http:
        for query, param in (({"status": "done"}, "status"), ({"created_after": "-1"}, "created_after"),
                             ({"created_before": str(2**71)}, "created_before"),
                             ({"metadata[" + "k" * 65 + "]": "v"}, "metadata"), ({"metadata[k]": "v" * 513}, "metadata"),
                             ({"metadata[team]": "r\x00d"}, "metadata")):  # a NUL: PostgreSQL's 500 before
            response = http.get("/v1/batches", params=query)
            assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
            assert len(response.text) < 1000  # the client's value is not echoed whole
        body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h",
                "metadata": {"team": "r\x00d"}}
        assert http.post("/v1/batches", json=body).status_code == 400


def test_a_batchs_priority_is_bounded_and_shown(start_service, tmp_path):
    service = start_service(worker=False, key_max_priority=3)
    client = service.client()
    file_id = upload(client, tmp_path / "in.jsonl", rows(2))

    def create(**extra):
        return client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h",
                                     extra_body=extra)

    assert create().model_extra["priority"] == 0
    urgent = create(priority=3)
    assert urgent.model_extra["priority"] == 3 and client.batches.retrieve(urgent.id).model_extra["priority"] == 3
    assert create(priority=-10).model_extra["priority"] == -10  # any key may lower its own
    for priority, code in ((4, "priority_not_allowed"), (11, "invalid_request"), (-11, "invalid_request")):
        with pytest.raises(openai.BadRequestError) as refused:
            create(priority=priority)
        assert refused.value.code == code and refused.value.param == "priority", refused.value


def test_a_batch_keeps_what_its_creator_asked_on_its_row_and_in_its_folder_alike(start_service, tmp_path):
    """The store takes the create's BatchRequest whole: the batch's row and its folder's batch.json hold the same
    request (the pipeline reads the folder's, the API the row's), and the Batch object shows it."""
    service = start_service(worker=False, key_max_priority=3)
    client = service.client()
    file_id = upload(client, tmp_path / "in.jsonl", rows(2))
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h",
                                  metadata={"job": "nightly"}, extra_body={"priority": 2, "reuse": True},
                                  output_expires_after={"anchor": "created_at", "seconds": 7200})
    with Database(service.config.database_url).session() as session:
        row = repo.get_batch(session, repo.owner_of_key(KEY_A), batch.id)
        assert row is not None
        asked = row.request
    kept = BatchFolder(service.storage.open(), batch.id).batch_request()
    assert kept == asked and kept.owner == repo.owner_of_key(KEY_A) and kept.input_file_id == file_id
    assert (kept.endpoint, kept.model, kept.metadata, kept.output_expires_after) == (
        "/v1/chat/completions", CHAT_MODEL, {"job": "nightly"}, 7200)
    assert kept.window == Window("24h", 86_400) and kept.options == BatchOptions(priority=2, reuse=True)
    shown = client.batches.retrieve(batch.id)
    assert (shown.endpoint, shown.completion_window, shown.metadata, shown.model, shown.input_file_id) == (
        "/v1/chat/completions", "24h", {"job": "nightly"}, CHAT_MODEL, file_id)
    assert (shown.model_extra["priority"], shown.model_extra["reuse"], shown.model_extra["max_cost"]) == (2, True, None)


def test_by_default_no_key_may_raise_its_priority(start_service, tmp_path):
    """BATCH_KEY_MAX_PRIORITY's default: a key may lower its batches' priority, never put them ahead of everyone."""
    client = start_service(worker=False).client()
    file_id = upload(client, tmp_path / "in.jsonl", rows(2))
    with pytest.raises(openai.BadRequestError) as refused:
        client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h",
                              extra_body={"priority": 1})
    assert refused.value.code == "priority_not_allowed"
    lowered = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h",
                                    extra_body={"priority": -1})
    assert lowered.model_extra["priority"] == -1


def test_keys_are_isolated_and_wrong_keys_refused(start_service, tmp_path):
    service = start_service(worker=False)
    a, b = service.client(KEY_A), service.client(KEY_B)
    file_id = upload(a, tmp_path / "in.jsonl", rows(2))
    batch = a.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")

    for call in (lambda: b.files.retrieve(file_id), lambda: b.files.content(file_id), lambda: b.files.delete(file_id),
                 lambda: b.batches.retrieve(batch.id), lambda: b.batches.cancel(batch.id),
                 lambda: b.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                          completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert b.batches.list().data == [] and b.files.list().data == []
    assert [x.id for x in a.batches.list()] == [batch.id]

    with pytest.raises(openai.AuthenticationError) as refused:
        service.client("sk-wrong").batches.list()
    assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
    with service.http(api_key=None) as http:
        response = http.get(f"/v1/batches/{batch.id}")
        assert response.status_code == 401
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_create_rejects_bad_requests(start_service, tmp_path):
    service = start_service(worker=False)
    client = service.client()
    file_id = upload(client, tmp_path / "in.jsonl", rows(2))

    def create(**overrides):
        params = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        return client.batches.create(**{**params, **overrides})

    for overrides, param in [
        ({"completion_window": "48h"}, "completion_window"),
        ({"endpoint": "/v1/moderations"}, "endpoint"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k": "v" * 513}}, "metadata"),
    ]:
        with pytest.raises(openai.BadRequestError) as rejected:
            create(**overrides)
        assert rejected.value.param == param, overrides
        assert rejected.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        create(input_file_id="file-doesnotexist")
    with service.http() as http:
        response = http.post("/v1/batches", json={"endpoint": "/v1/chat/completions"})
        assert response.status_code == 400 and response.json()["error"]["param"] == "input_file_id"
    assert client.batches.list().data == []


def test_cancel_mid_run_keeps_partial_results(start_service, tmp_path):
    engine = FakeEngine()
    reached, release = threading.Event(), threading.Event()

    def hold_second_shard(call: int) -> None:
        if call == 2:
            reached.set()
            release.wait(30)

    engine.on_call = hold_second_shard
    service = start_service(shard_size=2, engine=engine)
    client = service.client()
    requests = rows(6)
    batch = client.batches.create(input_file_id=upload(client, tmp_path / "in.jsonl", requests),
                                  endpoint="/v1/chat/completions", completion_window="24h")
    assert reached.wait(30)
    service.worker.follow()  # what the daemon's status sensor does every few seconds while the run goes on
    running = client.batches.retrieve(batch.id)
    # request_counts move per committed shard, not only at the end.
    assert running.status == "in_progress" and running.request_counts.model_dump() == {
        "total": 6, "completed": 2, "failed": 0}
    assert running.usage.output_tokens > 0

    # The committed shard's lines, readable while the rest runs (extension), the same as the output file's.
    partial = client.get(f"/batches/{batch.id}/partial_output", cast_to=httpx.Response)
    early = [json.loads(line) for line in partial.text.splitlines()]
    assert partial.headers["content-type"] == "application/jsonl"
    assert [line["custom_id"] for line in early] == ["r5", "r4"]  # the first shard: the longest work first
    with pytest.raises(openai.NotFoundError):
        service.client(KEY_B).get(f"/batches/{batch.id}/partial_output", cast_to=httpx.Response)

    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at is not None
    assert client.batches.retrieve(batch.id).status == "cancelling"
    release.set()
    cancelled = wait_for(client, batch.id, {"cancelled", "completed"})

    assert cancelled.status == "cancelled" and cancelled.cancelled_at >= cancelled.cancelling_at
    assert cancelled.finalizing_at is None
    assert cancelled.request_counts.model_dump() == {"total": 6, "completed": 4, "failed": 2}
    out, err = lines(client, cancelled.output_file_id), lines(client, cancelled.error_file_id)
    assert sorted(line["custom_id"] for line in out + err) == sorted(r["custom_id"] for r in requests)
    assert len(out) == 4 and {e["error"]["code"] for e in err} == {"batch_cancelled"}
    assert out[:2] == early  # the output holds the early lines, then the rest
    final = client.get(f"/batches/{batch.id}/partial_output", cast_to=httpx.Response)
    assert [json.loads(line) for line in final.text.splitlines()] == out
    assert cancelled.usage.output_tokens == sum(l["response"]["body"]["usage"]["completion_tokens"] for l in out)
    with pytest.raises(openai.BadRequestError):
        client.batches.cancel(batch.id)


def test_cancel_before_launch_runs_nothing(start_service, tmp_path, monkeypatch):
    counted: list[str] = []
    count = Models.counter
    monkeypatch.setattr(Models, "counter", lambda self, model, **kw: counted.append(model) or count(self, model, **kw))
    service = start_service(worker=False, key_daily_budget=1.0)  # a budget needs the tokens of a batch that runs
    client = service.client()
    requests = rows(3)
    batch = client.batches.create(input_file_id=upload(client, tmp_path / "in.jsonl", requests),
                                  endpoint="/v1/chat/completions", completion_window="24h")
    assert client.batches.cancel(batch.id).status == "cancelling"
    assert client.batches.cancel(batch.id).status == "cancelling"  # idempotent
    service.start_worker()
    cancelled = wait_for(client, batch.id, {"cancelled", "completed", "failed"})

    assert cancelled.status == "cancelled" and cancelled.in_progress_at is not None
    assert cancelled.request_counts.model_dump() == {"total": 3, "completed": 0, "failed": 3}
    assert lines(client, cancelled.output_file_id) == []
    err = lines(client, cancelled.error_file_id)
    assert sorted(e["custom_id"] for e in err) == sorted(r["custom_id"] for r in requests)
    assert {e["error"]["code"] for e in err} == {"batch_cancelled"}
    assert service.engine.calls == []
    assert counted == [] and cancelled.model_extra["estimate"] is None  # its requests listed, none tokenized


def test_expiry_with_a_short_window(start_service, tmp_path):
    engine = FakeEngine()
    service = start_service(shard_size=2, window_s=5, engine=engine)

    def outlast_the_window(call: int) -> None:  # shard 1 runs inside the window and ends after it
        if call == 1:
            [batch_id] = batch_ids(service.storage.open())
            deadline = service.storage.folder(batch_id).deadline()
            assert deadline is not None
            time.sleep(max(0.0, deadline.expires_at - time.time()) + 0.2)

    engine.on_call = outlast_the_window
    client = service.client()
    requests = rows(6)
    batch = client.batches.create(input_file_id=upload(client, tmp_path / "in.jsonl", requests),
                                  endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.expires_at - batch.created_at == 5
    expired = wait_for(client, batch.id, {"expired", "completed"})

    assert expired.status == "expired" and expired.expired_at >= expired.expires_at
    assert expired.request_counts.model_dump() == {"total": 6, "completed": 2, "failed": 4}
    out, err = lines(client, expired.output_file_id), lines(client, expired.error_file_id)
    assert sorted(line["custom_id"] for line in out + err) == sorted(r["custom_id"] for r in requests)
    assert {e["error"]["code"] for e in err} == {"batch_expired"}
    assert len(engine.calls) == 1


class BrokenRecordVLLM(FakeVLLM):
    """Fails the last step of the run, after the outputs are merged: a failure that is not the input's."""

    def model_record(self, model):
        raise RuntimeError("the model record is unavailable")


def test_a_failed_run_fails_the_batch(start_service, tmp_path):
    service = start_service(vllm=fake_vllm(f"broken-{tmp_path.name}", FakeEngine(), BrokenRecordVLLM))
    client = service.client()
    batch = client.batches.create(input_file_id=upload(client, tmp_path / "in.jsonl", rows(2)),
                                  endpoint="/v1/chat/completions", completion_window="24h")
    failed = wait_for(client, batch.id, {"failed", "completed"})
    assert failed.status == "failed"
    [error] = failed.errors.data
    assert error.code == "pipeline_error" and "batch_usage" in error.message and "model record" in error.message
    # Every shard had committed before the last step failed: the batch keeps both answers.
    assert failed.request_counts.model_dump() == {"total": 2, "completed": 2, "failed": 0}
    assert sorted(x["custom_id"] for x in lines(client, failed.output_file_id)) == ["r0", "r1"]
    assert lines(client, failed.error_file_id) == []


def test_a_failed_run_fails_the_batch_only_once_dagster_stops_retrying(start_service, tmp_path):
    service = start_service(worker=False)
    client = service.client()
    batch = client.batches.create(input_file_id=upload(client, tmp_path / "in.jsonl", rows(4)),
                                  endpoint="/v1/chat/completions", completion_window="24h")
    from batch_dagster.defs.sensors import api_batch_sensor, api_batch_status_sensor

    def tick(sensor):
        return sensor(dg.build_sensor_context(instance=service.instance, resources=service.worker.resources))

    launched = tick(api_batch_sensor)
    assert [r.run_key for r in launched.run_requests] == [batch.id]
    service.instance.add_dynamic_partitions("batches", [batch.id])
    # Its run worker died. With run_retries on (dagster.yaml), Dagster tags the failed run `will_retry`
    # and the daemon re-executes it as a new run of the same partition: the batch waits for that run.
    first = dg.DagsterRun(job_name="batch_job", status=dg.DagsterRunStatus.FAILURE,
                          tags={"dagster/partition": batch.id, "dagster/failure_reason": "UNEXPECTED_TERMINATION",
                                "dagster/will_retry": "true"})
    service.instance.add_run(first)
    tick(api_batch_status_sensor)
    assert client.batches.retrieve(batch.id).status == "validating"
    assert isinstance(tick(api_batch_sensor), dg.SkipReason)  # Dagster relaunches it, not the sensor

    # The retry dies too, and Dagster will not retry it again: now the batch fails, with the reason.
    retry = dg.DagsterRun(job_name="batch_job", status=dg.DagsterRunStatus.STARTED,
                          tags={"dagster/partition": batch.id, "dagster/parent_run_id": first.run_id,
                                "dagster/root_run_id": first.run_id, "dagster/retry_number": "1"})
    service.instance.add_run(retry)
    service.instance.add_run_tags(first.run_id, {"dagster/auto_retry_run_id": retry.run_id})
    tick(api_batch_status_sensor)
    assert client.batches.retrieve(batch.id).status == "validating"
    service.instance.report_run_failed(retry, "Execution was interrupted unexpectedly.")
    service.instance.add_run_tags(retry.run_id, {"dagster/will_retry": "false"})
    tick(api_batch_status_sensor)

    failed = client.batches.retrieve(batch.id)
    assert failed.status == "failed" and failed.failed_at is not None
    [error] = failed.errors.data
    assert error.code == "pipeline_error" and "interrupted unexpectedly" in error.message
    assert f"Dagster run {retry.run_id}, retry 1" in error.message
    assert len(service.instance.get_runs(dg.RunsFilter(tags={"dagster/partition": batch.id}))) == 2
