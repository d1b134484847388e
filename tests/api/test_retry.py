"""Retrying a batch's failed requests (POST /v1/batches/{id}/retry, an extension) and reading merged results."""

from __future__ import annotations

import json

import dagster as dg
import openai
import pytest

from tests.helpers import FakeEngine, chat_request, file_lines, rows, upload, wait_for

CHAT = "/v1/chat/completions"


def retry(client, batch_id: str):
    return client.post(f"/batches/{batch_id}/retry", cast_to=openai.types.Batch)


def test_retry_reruns_only_server_failures_and_merges_with_the_parent(start_service, tmp_path):
    engine = FakeEngine(fail_once={"r1", "r4"})
    service = start_service(shard_size=2, engine=engine)
    client = service.client()
    requests = rows(6, max_tokens=8) + [chat_request("bad-temp", "hi", temperature=-1)]
    parent = client.batches.create(input_file_id=upload(client, tmp_path / "in.jsonl", requests), endpoint=CHAT,
                                   completion_window="24h", metadata={"job": "nightly"})
    parent = wait_for(client, parent.id, "completed")
    assert parent.request_counts.failed == 3
    codes = {e["custom_id"]: e["response"]["status_code"] for e in file_lines(client, parent.error_file_id)}
    assert codes == {"r1": 500, "r4": 500, "bad-temp": 400}

    engine.fail_once = {"r4"}  # r4 fails again in the child
    child = retry(client, parent.id)
    assert child.id != parent.id and child.status == "validating"
    assert child.metadata == {"job": "nightly", "parent_batch_id": parent.id} and child.endpoint == CHAT
    # A batch's retries are found by their parent (the key is reserved for writes only).
    found = client.batches.list(extra_query={"metadata[parent_batch_id]": parent.id})
    assert [b.id for b in found] == [child.id]
    child = wait_for(client, child.id, "completed")
    assert child.request_counts.model_dump() == {"total": 2, "completed": 1, "failed": 1}
    assert child.model == parent.model
    # The child ran the parent's original bodies, and only the 5xx ones (never the 400).
    assert engine.calls[-1] == ["r4", "r1"]  # the longest first
    alone = file_lines(client, child.output_file_id)
    assert [x["custom_id"] for x in alone] == ["r1"]
    assert alone[0]["response"]["body"]["choices"][0]["message"]["content"] == "echo: question 1 word"

    merged_out = file_lines(client, child.output_file_id, merged=True)
    merged_err = file_lines(client, child.error_file_id, merged=True)
    assert sorted(x["custom_id"] for x in merged_out + merged_err) == sorted(r["custom_id"] for r in requests)
    assert sorted(x["custom_id"] for x in merged_out) == ["r0", "r1", "r2", "r3", "r5"]
    assert sorted(x["custom_id"] for x in merged_err) == ["bad-temp", "r4"]

    # A retry of the retry: merged reads go through both ancestors, still every custom_id once.
    grandchild = wait_for(client, retry(client, child.id).id, "completed")
    assert grandchild.metadata["parent_batch_id"] == child.id and grandchild.request_counts.total == 1
    merged_out = file_lines(client, grandchild.output_file_id, merged=True)
    merged_err = file_lines(client, grandchild.error_file_id, merged=True)
    assert sorted(x["custom_id"] for x in merged_out + merged_err) == sorted(r["custom_id"] for r in requests)
    assert sorted(x["custom_id"] for x in merged_out) == [f"r{i}" for i in range(6)]
    assert [x["custom_id"] for x in merged_err] == ["bad-temp"]
    # The parent's own file with merged=true is just itself.
    assert len(file_lines(client, parent.output_file_id, merged=True)) == 4
    with pytest.raises(openai.BadRequestError, match="not a batch's output"):
        file_lines(client, parent.input_file_id, merged=True)

    # Nothing retryable left: a clear 400.
    with pytest.raises(openai.BadRequestError, match="no request to retry"):
        retry(client, grandchild.id)
    with pytest.raises(openai.NotFoundError):
        retry(service.client("sk-test-b"), parent.id)  # another owner's batch


def test_retry_of_a_cancelled_batch_runs_what_never_ran(start_service, tmp_path):
    service = start_service(worker=False)
    client = service.client()
    requests = rows(3)
    batch = client.batches.create(input_file_id=upload(client, tmp_path / "in.jsonl", requests), endpoint=CHAT,
                                  completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="only a batch that has ended"):
        retry(client, batch.id)
    client.batches.cancel(batch.id)
    service.start_worker()
    cancelled = wait_for(client, batch.id, {"cancelled", "completed", "failed"})
    assert cancelled.status == "cancelled"

    child = wait_for(client, retry(client, batch.id).id, "completed")
    assert child.request_counts.model_dump() == {"total": 3, "completed": 3, "failed": 0}
    merged_out = file_lines(client, child.output_file_id, merged=True)
    merged_err = file_lines(client, child.error_file_id, merged=True)
    assert sorted(x["custom_id"] for x in merged_out) == sorted(r["custom_id"] for r in requests)
    assert merged_err == []


def test_cli_retry_creates_the_child_the_daemon_runs(start_service, tmp_path, monkeypatch, capsys):
    from batch_dagster.cli import main

    service = start_service(shard_size=10, engine=FakeEngine(fail_once={"r0", "r2"}))
    client = service.client()
    parent = client.batches.create(input_file_id=upload(client, tmp_path / "in.jsonl", rows(3)), endpoint=CHAT,
                                   completion_window="24h")
    parent = wait_for(client, parent.id, "completed")
    monkeypatch.setenv("BATCH_DATABASE_URL", service.config.database_url)
    with pytest.raises(SystemExit) as exit_:
        main(["retry", parent.id, "--json"])
    assert exit_.value.code == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["parent_batch_id"] == parent.id and printed["requests"] == 2
    child = wait_for(client, printed["id"], "completed")  # the worker (the daemon's sensor) launched it
    assert child.metadata == {"parent_batch_id": parent.id}
    assert sorted(x["custom_id"] for x in file_lines(client, child.output_file_id)) == ["r0", "r2"]

    with pytest.raises(SystemExit) as exit_:
        main(["retry", child.id])
    assert exit_.value.code == 1 and "no request to retry" in capsys.readouterr().err


def test_retry_after_the_engine_crashed_on_a_shard_past_its_retries(start_service, tmp_path):
    engine = FakeEngine(crash_times=3)  # the first shard crashes on every attempt: engine_error lines
    service = start_service(shard_size=2, engine=engine)
    client = service.client()
    requests = rows(4)
    parent = wait_for(client, client.batches.create(
        input_file_id=upload(client, tmp_path / "in.jsonl", requests), endpoint=CHAT, completion_window="24h").id,
        "completed", timeout_s=120)
    err = file_lines(client, parent.error_file_id)
    assert len(err) == 2 and {e["response"]["body"]["error"]["code"] for e in err} == {"engine_error"}

    child = wait_for(client, retry(client, parent.id).id, "completed")
    assert child.request_counts.model_dump() == {"total": 2, "completed": 2, "failed": 0}
    assert sorted(x["custom_id"] for x in file_lines(client, child.output_file_id)) == sorted(e["custom_id"] for e in err)
    merged = file_lines(client, child.output_file_id, merged=True)
    assert sorted(x["custom_id"] for x in merged) == sorted(r["custom_id"] for r in requests)
    assert file_lines(client, child.error_file_id, merged=True) == []


def test_a_batch_whose_run_failed_for_good_keeps_its_shards_and_retries_the_rest(start_service, tmp_path):
    def fail_from_the_second_shard(call: int) -> None:
        if call >= 2:
            raise dg.Failure("the batch store is unreachable (injected)", allow_retries=False)

    engine = FakeEngine(on_call=fail_from_the_second_shard)
    service = start_service(shard_size=2, engine=engine)
    client = service.client()
    requests = rows(6, max_tokens=8)
    parent = client.batches.create(input_file_id=upload(client, tmp_path / "in.jsonl", requests), endpoint=CHAT,
                                   completion_window="24h")
    parent = wait_for(client, parent.id, {"failed", "completed"})

    assert parent.status == "failed" and parent.failed_at is not None
    assert parent.request_counts.model_dump() == {"total": 6, "completed": 2, "failed": 4}
    [error] = parent.errors.data
    assert error.code == "pipeline_error" and "injected" in error.message
    out, err = file_lines(client, parent.output_file_id), file_lines(client, parent.error_file_id)
    kept = engine.calls[0]
    assert [x["custom_id"] for x in out] == kept  # the shard that committed before the run failed
    assert sorted(x["custom_id"] for x in out + err) == sorted(r["custom_id"] for r in requests)  # each once
    assert {e["error"]["code"] for e in err} == {"batch_failed"}
    assert all("run failed" in e["error"]["message"] for e in err)
    # Billed: the two answers only.
    assert parent.usage.output_tokens == sum(x["response"]["body"]["usage"]["completion_tokens"] for x in out) > 0

    engine.on_call = None
    child = wait_for(client, retry(client, parent.id).id, "completed")
    assert child.request_counts.model_dump() == {"total": 4, "completed": 4, "failed": 0}
    assert sorted(engine.calls[-2] + engine.calls[-1]) == sorted(e["custom_id"] for e in err)  # only the rest ran
    merged_out = file_lines(client, child.output_file_id, merged=True)
    assert sorted(x["custom_id"] for x in merged_out) == sorted(r["custom_id"] for r in requests)
    assert file_lines(client, child.error_file_id, merged=True) == []


def test_a_retry_is_held_to_the_keys_priority_bound_as_it_stands(start_service, tmp_path):
    """A parent created at priority 5 while the key could ask it; the key's bound lowered to 0 since: its retry runs
    at 0, never above what the key may ask now."""
    from batch_dagster.db import Database, keys, repo
    from tests.helpers import KEY_A

    service = start_service(engine=FakeEngine(fail_once={"r1"}), key_max_priority=5)
    client = service.client()
    parent = client.batches.create(input_file_id=upload(client, tmp_path / "in.jsonl", rows(3)), endpoint=CHAT,
                                   completion_window="24h", extra_body={"priority": 5})
    parent = wait_for(client, parent.id, "completed")
    assert parent.model_extra["priority"] == 5 and parent.request_counts.failed == 1
    with Database(service.config.database_url).session() as session:
        name = keys.labels(session)[repo.owner_of_key(KEY_A)]
        keys.set_limits(session, name, keys.Limits(max_priority=0))
    child = retry(client, parent.id)
    assert child.model_extra["priority"] == 0
    assert wait_for(client, child.id, "completed").request_counts.completed == 1
