"""Two keys on one service, one of them an attacker: no request of key A reaches key B's objects, directly or
through a retry chain, and a not-found answer is the same whether B's object exists or nothing does."""

from __future__ import annotations

import openai
import pytest
from sqlalchemy import update

from batch_dagster.db import BatchRecord, Database
from tests.helpers import KEY_A, KEY_B, FakeEngine, file_lines, rows, upload, wait_for

CHAT = "/v1/chat/completions"
MISSING = {"file": "file-00000000000000000000000000000000", "batch": "batch_00000000000000000000000000000000",
           "endpoint": "we_00000000000000000000000000000000"}


def completed_batch(client, path, n: int = 3, **create):
    batch = client.batches.create(input_file_id=upload(client, path, rows(n)), endpoint=CHAT,
                                  completion_window="24h", **create)
    return wait_for(client, batch.id, "completed")


def test_metadata_cannot_name_a_retry_parent(start_service, tmp_path):
    """The spoof of issue 18: A names B's batch as its parent and reads B's lines through its merged output."""
    service = start_service()
    a, b = service.client(KEY_A), service.client(KEY_B)
    victim = completed_batch(b, tmp_path / "b.jsonl")
    with pytest.raises(openai.BadRequestError) as refused:
        a.batches.create(input_file_id=upload(a, tmp_path / "a.jsonl", rows(1, prefix="a")), endpoint=CHAT,
                         completion_window="24h", metadata={"job": "x", "parent_batch_id": victim.id})
    error = refused.value.body
    assert error["code"] == "reserved_metadata_key" and error["param"] == "metadata"
    assert "'parent_batch_id' is reserved" in error["message"]
    # Nothing was created for A, and B's output is still B's alone.
    assert a.batches.list().data == []
    assert len(file_lines(b, victim.output_file_id)) == 3


def test_a_merged_chain_stops_at_another_owners_batch(start_service, tmp_path):
    """A stored parent of another owner (a row migrated from spoofed metadata, another writer) is never followed."""
    service = start_service()
    a, b = service.client(KEY_A), service.client(KEY_B)
    victim = completed_batch(b, tmp_path / "b.jsonl")
    own = completed_batch(a, tmp_path / "a.jsonl", n=2)
    store = Database(service.config.database_url)
    with store.session() as session:  # the parent both ways the old and the new code read it
        session.execute(update(BatchRecord).where(BatchRecord.id == own.id).values(
            parent_batch_id=victim.id, meta={"parent_batch_id": victim.id}))
        session.commit()
    store.dispose()
    merged = file_lines(a, own.output_file_id, merged=True)
    assert sorted(x["custom_id"] for x in merged) == ["r0", "r1"]
    assert merged == file_lines(a, own.output_file_id)
    assert file_lines(a, own.error_file_id, merged=True) == []


def test_a_retry_chain_of_ones_own_batches_still_merges(start_service, tmp_path):
    service = start_service(engine=FakeEngine(fail_once={"r1"}))
    a = service.client(KEY_A)
    parent = completed_batch(a, tmp_path / "a.jsonl")
    child = wait_for(a, a.post(f"/batches/{parent.id}/retry", cast_to=openai.types.Batch).id, "completed")
    assert child.metadata == {"parent_batch_id": parent.id}
    with Database(service.config.database_url).session() as session:
        assert session.get(BatchRecord, _pk(session, child.id)).parent_batch_id == parent.id
    assert sorted(x["custom_id"] for x in file_lines(a, child.output_file_id, merged=True)) == ["r0", "r1", "r2"]
    # B cannot retry A's batch, nor read the merged output of A's retry.
    b = service.client(KEY_B)
    with pytest.raises(openai.NotFoundError):
        b.post(f"/batches/{parent.id}/retry", cast_to=openai.types.Batch)
    with pytest.raises(openai.NotFoundError):
        file_lines(b, child.output_file_id, merged=True)


def _pk(session, batch_id: str) -> int:
    return session.query(BatchRecord.pk).filter(BatchRecord.id == batch_id).scalar()


def test_a_gone_ancestor_is_named_by_its_id_not_by_where_it_was_stored(start_service, tmp_path):
    service = start_service(engine=FakeEngine(fail_once={"r1"}))
    a = service.client(KEY_A)
    parent = completed_batch(a, tmp_path / "a.jsonl")
    child = wait_for(a, a.post(f"/batches/{parent.id}/retry", cast_to=openai.types.Batch).id, "completed")
    with Database(service.config.database_url).session() as session:
        from batch_dagster.db import FileRecord

        path = session.query(FileRecord.path).filter(FileRecord.id == parent.output_file_id).scalar()
    service.storage.open().delete(path)
    with service.http(KEY_A) as http:
        answer = http.get(f"/v1/files/{child.output_file_id}/content", params={"merged": "true"})
    assert answer.status_code == 404
    message = answer.json()["error"]["message"]
    assert parent.output_file_id in message
    for internal in (str(service.data_dir), path, "file:", "s3://", "/batches/"):
        assert internal not in message, message


def _answers(http, requests) -> list[tuple[int, dict]]:
    out = []
    for method, url, body in requests:
        response = http.request(method, url, json=body)
        out.append((response.status_code, response.json()))
    return out


def test_not_found_is_the_same_for_another_keys_object_and_for_none(start_service, tmp_path):
    service = start_service(webhook_allow=("127.0.0.1",))
    b = service.client(KEY_B)
    victim = completed_batch(b, tmp_path / "b.jsonl")
    with service.http(KEY_B) as http:
        hook = http.post("/v1/webhook_endpoints", json={"url": "http://127.0.0.1:9/hook"}).json()
    theirs = {"file": victim.output_file_id, "batch": victim.id, "endpoint": hook["id"],
              "input": victim.input_file_id, "error": victim.error_file_id}
    missing = {**MISSING, "input": "file-11111111111111111111111111111111",
               "error": "file-22222222222222222222222222222222"}

    def requests(ids: dict[str, str]) -> list[tuple[str, str, dict | None]]:
        return [
            ("GET", f"/v1/files/{ids['file']}", None),
            ("GET", f"/v1/files/{ids['file']}/content", None),
            ("GET", f"/v1/files/{ids['file']}/content?merged=true", None),
            ("GET", f"/v1/files/{ids['error']}/content", None),
            ("DELETE", f"/v1/files/{ids['input']}", None),
            ("GET", f"/v1/files?after={ids['file']}", None),
            ("POST", "/v1/batches", {"input_file_id": ids["input"], "endpoint": CHAT, "completion_window": "24h"}),
            ("GET", f"/v1/batches/{ids['batch']}", None),
            ("POST", f"/v1/batches/{ids['batch']}/cancel", None),
            ("POST", f"/v1/batches/{ids['batch']}/retry", None),
            ("GET", f"/v1/batches?after={ids['batch']}", None),
            ("GET", f"/v1/webhook_endpoints/{ids['endpoint']}", None),
            ("DELETE", f"/v1/webhook_endpoints/{ids['endpoint']}", None),
            ("GET", f"/v1/webhook_endpoints?after={ids['endpoint']}", None),
        ]

    with service.http(KEY_A) as http:
        foreign, absent = _answers(http, requests(theirs)), _answers(http, requests(missing))

    def masked(answers, ids):
        text = repr(answers)
        for name, object_id in ids.items():
            text = text.replace(object_id, f"<{name}>")
        return text

    assert all(status == 404 for status, _ in foreign), foreign
    assert masked(foreign, theirs) == masked(absent, missing)
    # B's objects are all still there, untouched.
    assert len(file_lines(b, victim.output_file_id)) == 3 and b.batches.retrieve(victim.id).status == "completed"
    with service.http(KEY_B) as http:
        assert http.get(f"/v1/webhook_endpoints/{hook['id']}").status_code == 200


def test_a_batch_of_ten_thousand_bad_lines_is_a_small_object(start_service, tmp_path):
    """The validation report it is made from stays small with 20 MB of bad values too (tests/core/test_echo_bounds);
    here the whole way through the API, with smaller values so that the test stays quick."""
    service = start_service()
    client = service.client()
    value = "v" * 500
    lines = [rows(1)[0] | {"custom_id": f"r{i}", "url": f"/v1/{value}"} for i in range(10_000)]
    file_id = upload(client, tmp_path / "bad.jsonl", lines)
    assert client.files.retrieve(file_id).bytes > 5_000_000
    batch = client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h",
                                  metadata={f"k{i}": "x" * 512 for i in range(16)})  # the most metadata allowed
    failed = wait_for(client, batch.id, {"failed", "completed"}, timeout_s=120)
    assert failed.status == "failed" and len(failed.errors.data) == 101
    assert failed.errors.data[-1].code == "more_errors" and "9900 more" in failed.errors.data[-1].message
    assert len(client.batches.retrieve(batch.id).to_json()) < 64 * 1024
    with service.http() as http:
        assert len(http.get("/v1/batches").content) < 64 * 1024
