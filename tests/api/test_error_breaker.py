"""The error-rate breaker: a batch whose first lines nearly all fail stops before the rest run, `failed` with
`error_rate_exceeded`, what it finished kept and every request in its output or error file once; the operator's
rate (BATCH_ERROR_BREAKER_RATE among the first BATCH_ERROR_BREAKER_LINES) or the batch's own `error_breaker_rate`.
Only the requests' own failures count: the service's (a fleet that is down, an engine out of memory) never stop a
batch."""

from __future__ import annotations

import json

import openai
import pytest

from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile.contract import RequestCounts
from batch_dagster.batchfile.failure import breaker_tripped
from batch_dagster.batchfile.results import CommittedShard
from tests.helpers import rows, upload, wait_for

CREATE = {"endpoint": "/v1/chat/completions", "completion_window": "24h"}


def lines(client, file_id: str | None) -> list[dict]:
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()] if file_id else []


def test_a_batch_whose_first_lines_all_fail_stops_and_keeps_what_it_finished(start_service, tmp_path):
    service = start_service(shard_size=2, error_breaker_lines=4)
    client = service.client()
    batch_rows = rows(10, max_tokens=4)
    service.engine.refuse = {r["custom_id"] for r in batch_rows}  # every line the engine runs is refused (400)
    batch = client.batches.create(input_file_id=upload(client, tmp_path / "in.jsonl", batch_rows), **CREATE)
    stopped = wait_for(client, batch.id, {"failed", "completed"})
    assert stopped.status == "failed" and len(service.engine.calls) == 2  # 4 lines ran; the other 3 shards never
    assert [e.code for e in stopped.errors.data] == [c.ERROR_RATE_EXCEEDED], stopped.errors
    assert "BATCH_ERROR_BREAKER_RATE" in stopped.errors.data[0].message
    errors = lines(client, stopped.error_file_id)
    assert sorted(e["custom_id"] for e in errors) == sorted(r["custom_id"] for r in batch_rows)  # each once
    codes = [e["error"]["code"] if e.get("error") else e["response"]["body"]["error"]["code"] for e in errors]
    assert codes.count(c.ERROR_RATE_EXCEEDED) == 6, codes  # the not-run ones say why
    assert stopped.request_counts.model_dump() == {"total": 10, "completed": 0, "failed": 10}


def test_a_batch_may_set_its_own_rate_and_a_half_failing_batch_runs_on_by_default(start_service, tmp_path):
    service = start_service(shard_size=2, error_breaker_lines=4)
    client = service.client()
    batch_rows = rows(8, max_tokens=4)
    file_id = upload(client, tmp_path / "in.jsonl", batch_rows)
    service.engine.refuse = {r["custom_id"] for r in batch_rows[::2]}  # half fail: under 0.95
    done = wait_for(client, client.batches.create(input_file_id=file_id, **CREATE).id, {"failed", "completed"})
    assert done.status == "completed" and done.request_counts.failed == 4
    strict = client.batches.create(input_file_id=file_id, **CREATE, extra_body={"error_breaker_rate": 0.5})
    assert strict.model_extra["error_breaker_rate"] == 0.5
    stopped = wait_for(client, strict.id, {"failed", "completed"})
    assert stopped.status == "failed" and [e.code for e in stopped.errors.data] == [c.ERROR_RATE_EXCEEDED]
    assert stopped.request_counts.completed == 2  # the successes it finished are kept
    for bad in (0, 1.5, "0.5"):
        with pytest.raises(openai.BadRequestError):
            client.batches.create(input_file_id=file_id, **CREATE, extra_body={"error_breaker_rate": bad})


def shard(completed: int, failed: int, **codes: int) -> CommittedShard:
    """A committed shard's summary: `failed` lines, of which `codes` (the rest are the requests' own 400s)."""
    own = failed - sum(codes.values())
    return CommittedShard(0, RequestCounts(total=completed + failed, completed=completed, failed=failed),
                          error_codes={**({c.INVALID_REQUEST: own} if own else {}), **codes})


def test_the_breaker_waits_for_its_sample_and_is_off_at_zero():
    half, bad = shard(1, 1), shard(0, 2)
    assert not breaker_tripped([bad], 4, 0.95)  # too few lines yet
    assert breaker_tripped([bad, bad], 4, 0.95) and not breaker_tripped([bad, half], 4, 0.95)
    assert breaker_tripped([bad, half], 4, 0.75)
    assert not breaker_tripped([bad, bad], 0, 0.95) and not breaker_tripped([bad, bad], 4, None)


def test_the_services_own_failures_never_trip_the_breaker():
    """An engine that failed (a fleet down: engine_error; out of memory) is not the batch's fault: those lines are
    left out of the sample and of the failed share."""
    down, oom, bad = shard(0, 2, engine_error=2), shard(0, 2, out_of_memory=2), shard(0, 2)
    assert not breaker_tripped([down, down, down], 4, 0.95)
    assert not breaker_tripped([oom, down, bad], 4, 0.5)  # 2 lines of the requests' own: under the sample
    assert breaker_tripped([down, bad, bad], 4, 0.95)  # 4 of their own, all failed
    assert not breaker_tripped([shard(1, 1, engine_error=1), shard(1, 1, engine_error=1)], 2, 0.5)  # 0 of 2 own


def test_a_fleet_that_is_down_fails_its_lines_but_never_stops_the_batch(start_service, tmp_path):
    service = start_service(shard_size=2, error_breaker_lines=4)
    client = service.client()
    batch_rows = rows(8, max_tokens=4)
    service.engine.fail_code = c.ENGINE_ERROR  # every server answers 503: the engine's failure, not the requests'
    service.engine.fail_once = {r["custom_id"] for r in batch_rows}
    batch = client.batches.create(input_file_id=upload(client, tmp_path / "in.jsonl", batch_rows), **CREATE)
    done = wait_for(client, batch.id, {"failed", "completed"})
    assert done.status == "completed" and done.errors is None and len(service.engine.calls) == 4  # every shard ran
    codes = {e["response"]["body"]["error"]["code"] for e in lines(client, done.error_file_id)}
    assert codes == {c.ENGINE_ERROR} and done.request_counts.failed == 8  # each line says what happened to it
