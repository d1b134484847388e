"""Answer reuse for file batches: the `reuse` option (an extension of the create body, shown on the Batch and kept by a
retry) and the operator's default (BATCH_REUSE_ANSWERS). A reused line says so and is billed at zero; only
deterministic requests are reused."""

from __future__ import annotations

import json

import openai
import pytest

from tests.helpers import FakeEngine, chat_request, upload, wait_for

DETERMINISTIC = [chat_request(f"q{i}", f"question number {i}", temperature=0, max_tokens=8) for i in range(4)]


def run(client, tmp_path, rows, name: str, **extra):
    file_id = upload(client, tmp_path / f"{name}.jsonl", rows)
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h",
                                  extra_body=extra)
    batch = wait_for(client, batch.id, "completed")
    lines = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    return batch, {line["custom_id"]: line for line in lines}


def test_a_batch_that_asks_reuses_the_answers_of_an_earlier_one_billed_at_zero(start_service, tmp_path):
    service = start_service(shard_size=2)
    client = service.client()
    first, lines = run(client, tmp_path, DETERMINISTIC, "first", reuse=True)
    assert not any("reused" in line for line in lines.values()) and first.usage.total_tokens > 0
    assert first.model_extra["reuse"] is True  # the option as the Batch shows it
    calls = len(service.engine.calls)

    rows = [*DETERMINISTIC, chat_request("new", "a question never asked", temperature=0, max_tokens=8),
            chat_request("sampled", "question number 0")]  # temperature 1: never reused
    second, again = run(client, tmp_path, rows, "second", reuse=True)
    assert {cid for cid, line in again.items() if line.get("reused")} == {f"q{i}" for i in range(4)}
    for cid in ("q0", "q3"):  # the answer as first computed
        assert again[cid]["response"]["body"]["choices"] == lines[cid]["response"]["body"]["choices"]
    ran = [cid for call in service.engine.calls[calls:] for cid in call]
    assert sorted(ran) == ["new", "sampled"]
    assert second.request_counts.completed == 6
    billed = sum(again[c]["response"]["body"]["usage"]["total_tokens"] for c in ("new", "sampled"))
    assert second.usage.total_tokens == billed  # the 4 reused lines cost nothing

    # Without asking (and no operator default), nothing is reused.
    third, plain = run(client, tmp_path, DETERMINISTIC, "third")
    assert not any(line.get("reused") for line in plain.values()) and third.usage.total_tokens > 0
    assert third.model_extra["reuse"] is None  # unset: the operator's default decides


def test_a_retry_batch_reuses_as_its_parent_asked(start_service, tmp_path):
    """The retry inherits the parent's options whole: its one request, answered meanwhile by another batch, is
    reused rather than run again."""
    engine = FakeEngine(fail_once={"late"})
    service = start_service(engine=engine)
    client = service.client()
    late = chat_request("late", "a question answered late", temperature=0, max_tokens=8)
    parent = client.batches.create(input_file_id=upload(client, tmp_path / "parent.jsonl", [late]),
                                   endpoint="/v1/chat/completions", completion_window="24h", extra_body={"reuse": True})
    assert wait_for(client, parent.id, "completed").request_counts.failed == 1  # its one answer failed: not kept
    run(client, tmp_path, [late], "answers_it", reuse=True)  # another batch answers it, and keeps the answer
    calls = len(engine.calls)
    child = client.post(f"/batches/{parent.id}/retry", cast_to=openai.types.Batch)
    assert child.model_extra["reuse"] is True
    child = wait_for(client, child.id, "completed")
    lines = [json.loads(line) for line in client.files.content(child.output_file_id).text.splitlines()]
    assert [(line["custom_id"], line.get("reused")) for line in lines] == [("late", True)]
    assert len(engine.calls) == calls and child.usage.total_tokens == 0


def test_the_operator_default_reuses_unless_a_batch_says_no(start_service, tmp_path):
    service = start_service(reuse_answers=True)
    client = service.client()
    run(client, tmp_path, DETERMINISTIC, "first")
    _, reused = run(client, tmp_path, DETERMINISTIC, "second")
    assert all(line.get("reused") for line in reused.values())
    _, computed = run(client, tmp_path, DETERMINISTIC, "third", reuse=False)
    assert not any(line.get("reused") for line in computed.values())


def test_reuse_must_be_a_boolean(start_service, tmp_path):
    client = start_service(worker=False).client()
    file_id = upload(client, tmp_path / "in.jsonl", DETERMINISTIC)
    with pytest.raises(openai.BadRequestError) as caught:
        client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h",
                              extra_body={"reuse": "yes"})
    assert caught.value.body["param"] == "reuse"


def test_a_request_asked_three_times_in_a_batch_runs_once_and_is_billed_once(start_service, tmp_path):
    service = start_service(shard_size=4)
    client = service.client()
    same = {"temperature": 0, "max_tokens": 8}
    rows = [chat_request(cid, "the same question", **same) for cid in ("s1", "s2", "s3")]
    rows += [chat_request("other", "another question", **same), chat_request("sampled", "the same question")]
    batch, lines = run(client, tmp_path, rows, "repeats", reuse=True)
    ran = sorted(cid for call in service.engine.calls for cid in call)
    assert ran == ["other", "s1", "sampled"]  # the sampled one (temperature 1) is not the same request
    assert [lines[cid]["response"]["body"]["choices"] for cid in ("s2", "s3")] == \
        [lines["s1"]["response"]["body"]["choices"]] * 2
    assert [lines[cid].get("reused") for cid in ("s1", "s2", "s3")] == [None, True, True]
    assert batch.request_counts.completed == 5
    billed = sum(lines[cid]["response"]["body"]["usage"]["total_tokens"] for cid in ("s1", "other", "sampled"))
    assert batch.usage.total_tokens == billed
