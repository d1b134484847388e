"""Idempotent creates (issue #50): an `Idempotency-Key` on POST /v1/files and /v1/batches, through the openai SDK's
`extra_headers`. A repeat answers the first object; another body is a 409; keys are the owner's, bounded, kept
BATCH_IDEMPOTENCY_TTL_S, deleted by the retention sensor; parallel repeats make one object; limits count a first
create only. Collected again on PostgreSQL by tests/system/test_tenancy_postgres.py."""

from __future__ import annotations

import dagster as dg
import openai
import pytest
from sqlalchemy import func, select, update

from batch_dagster.db import Database, repo
from batch_dagster.db.models import BatchRecord, FileRecord, IdempotencyRecord
from batch_dagster.defs.retention import Retention, history_retention_sensor
from tests.api.test_tenancy_limits import in_parallel, slow_store  # noqa: F401  (the fixture)
from tests.helpers import KEY_A, KEY_B, rows, upload, write_jsonl

CHAT = "/v1/chat/completions"


def keyed(key: str) -> dict:
    return {"extra_headers": {"Idempotency-Key": key}}


def create(client, file_id: str, key: str, **body):
    return client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h", **body, **keyed(key))


def upload_keyed(client, path, key: str, **kwargs) -> str:
    with open(path, "rb") as f:
        return client.files.create(file=f, purpose="batch", **kwargs, **keyed(key)).id


def count(service, model, **where) -> int:
    store = Database(service.config.database_url)
    try:
        with store.session() as session:
            query = select(func.count()).select_from(model)
            for name, value in where.items():
                query = query.where(getattr(model, name) == value)
            return session.scalar(query) or 0
    finally:
        store.dispose()


def expire_keys(service) -> None:
    """Every key's time is up, as BATCH_IDEMPOTENCY_TTL_S after its first use."""
    store = Database(service.config.database_url)
    with store.session() as session:
        session.execute(update(IdempotencyRecord).values(expires_at=repo.now() - 1))
        session.commit()
    store.dispose()


def test_a_repeated_batch_create_answers_the_first_batch_and_another_body_is_a_409(start_service, tmp_path):
    service = start_service(worker=False)
    a = service.client(KEY_A)
    file_id = upload(a, tmp_path / "in.jsonl", rows(2))
    first = create(a, file_id, "job-1", metadata={"run": "1"})
    again = a.batches.with_raw_response.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h",
                                               metadata={"run": "1"}, **keyed("job-1"))
    assert again.status_code == 200 and again.parse().id == first.id
    assert again.parse().metadata == {"run": "1"}
    with pytest.raises(openai.ConflictError) as conflict:
        create(a, file_id, "job-1", metadata={"run": "2"})
    error = conflict.value.body
    assert (error["code"], error["param"], error["type"]) == (
        "idempotency_key_reused", "Idempotency-Key", "invalid_request_error")
    assert "'job-1'" in error["message"] and "POST /v1/batches" in error["message"]
    assert [b.id for b in a.batches.list()] == [first.id]  # one batch; the conflict wrote nothing
    assert count(service, BatchRecord) == 1
    other = create(a, file_id, "job-2", metadata={"run": "1"})  # another key: another batch
    assert other.id != first.id
    assert create(a, file_id, "job-1", metadata={"run": "1"}).id == first.id  # the first key still answers its own


def test_a_repeated_upload_answers_the_first_file_and_stores_nothing_more(start_service, tmp_path):
    """The SDK sends each upload as a new multipart form (its own boundary): the repeat is told by the file's bytes,
    name, purpose and expiry, hashed as it streamed in."""
    service = start_service(worker=False)
    a = service.client(KEY_A)
    path = write_jsonl(tmp_path / "in.jsonl", rows(3))
    first = upload_keyed(a, path, "upload-1")
    assert upload_keyed(a, path, "upload-1") == first
    assert [f.id for f in a.files.list()] == [first]
    assert len(list((service.data_dir / "files").rglob("*.jsonl"))) == 1  # no second copy was kept
    write_jsonl(path, rows(4))  # the same name, other bytes
    with pytest.raises(openai.ConflictError) as conflict:
        upload_keyed(a, path, "upload-1")
    assert conflict.value.body["code"] == "idempotency_key_reused"
    with pytest.raises(openai.ConflictError):  # the same bytes with another expiry are another request
        upload_keyed(a, write_jsonl(path, rows(3)), "upload-1",
                     expires_after={"anchor": "created_at", "seconds": 3600})
    with pytest.raises(openai.ConflictError) as elsewhere:  # a key stands for one request, whatever the route
        create(a, first, "upload-1")
    assert "POST /v1/files" in elsewhere.value.body["message"]
    assert [f.id for f in a.files.list()] == [first]
    assert len(list((service.data_dir / "files").rglob("*.jsonl"))) == 1


def test_a_key_is_its_owners_alone(start_service, tmp_path):
    """Two keys sending the same Idempotency-Key each get their own objects, never the other's."""
    service = start_service(worker=False)
    a, b = service.client(KEY_A), service.client(KEY_B)
    path = write_jsonl(tmp_path / "in.jsonl", rows(2))
    file_a, file_b = upload_keyed(a, path, "shared"), upload_keyed(b, path, "shared")
    assert file_a != file_b
    assert [f.id for f in b.files.list()] == [file_b]
    batch_a = create(a, file_a, "shared-batch")
    with pytest.raises(openai.NotFoundError):  # B's repeat of A's body names A's file: not B's to use
        create(b, file_a, "shared-batch")
    batch_b = create(b, file_b, "shared-batch")
    assert batch_b.id != batch_a.id and batch_b.input_file_id == file_b
    assert [x.id for x in b.batches.list()] == [batch_b.id]
    assert create(a, file_a, "shared-batch").id == batch_a.id


def test_an_expired_key_is_free_again_and_the_retention_sensor_deletes_it(start_service, tmp_path):
    service = start_service(worker=False)
    a = service.client(KEY_A)
    file_id = upload(a, tmp_path / "in.jsonl", rows(2))
    first = create(a, file_id, "daily")
    expire_keys(service)
    second = create(a, file_id, "daily", metadata={"day": "2"})  # past its time the key is a new one, any body
    assert second.id != first.id
    assert create(a, file_id, "daily", metadata={"day": "2"}).id == second.id
    assert count(service, IdempotencyRecord) == 1
    expire_keys(service)
    context = dg.build_sensor_context(instance=service.instance, resources={
        **service.worker.resources, "retention": Retention(history_retention_s=0)})  # history kept: keys still go
    history_retention_sensor(context)
    assert count(service, IdempotencyRecord) == 0
    assert {b.id for b in a.batches.list()} == {first.id, second.id}  # the objects stay


@pytest.mark.parametrize("value", ["", "x" * 256, "tab\there", "caf\xe9", b"\xff\xfe"])
def test_a_key_that_is_not_1_to_255_printable_ascii_is_a_400(shared_service, tmp_path, value):
    service = shared_service()
    with service.http() as http:
        value = value if isinstance(value, bytes) else value.encode("latin-1")
        answer = http.post("/v1/batches", headers={"Idempotency-Key": value}, json={
            "input_file_id": "file-x", "endpoint": CHAT, "completion_window": "24h"})
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert (error["param"], error["code"]) == ("Idempotency-Key", "invalid_idempotency_key")
        twice = http.post("/v1/batches", headers=[("Idempotency-Key", "k"), ("Idempotency-Key", "k2")], json={
            "input_file_id": "file-x", "endpoint": CHAT, "completion_window": "24h"})
        assert twice.status_code == 400 and twice.json()["error"]["param"] == "Idempotency-Key"
        longest = http.post("/v1/batches", headers={"Idempotency-Key": "~" * 255}, json={
            "input_file_id": "file-x", "endpoint": CHAT, "completion_window": "24h"})
        assert longest.status_code == 404 and longest.json()["error"]["param"] == "input_file_id"  # the key is fine
    with open(write_jsonl(tmp_path / "in.jsonl", rows(1)), "rb") as f:
        files = {"file": ("in.jsonl", f)}
        with service.http() as http:
            refused = http.post("/v1/files", headers={"Idempotency-Key": "x" * 256}, files=files,
                                data={"purpose": "batch"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "Idempotency-Key"


def test_a_repeat_is_never_counted_against_the_keys_limits(start_service, tmp_path):
    """At its limits a key still gets its first objects back by their keys; a new create is refused."""
    path = write_jsonl(tmp_path / "in.jsonl", rows(10))
    size = path.stat().st_size
    service = start_service(worker=False, key_max_active_batches=1, key_max_stored_bytes=2 * size)
    a = service.client(KEY_A)
    file_id = upload_keyed(a, path, "upload")
    batch = create(a, file_id, "batch")  # with its folder's copy of the input, the key's storage is full
    assert upload_keyed(a, path, "upload") == file_id  # not held to the room a second copy would need
    assert create(a, file_id, "batch").id == batch.id  # not a second active batch
    with pytest.raises(openai.RateLimitError) as refused:
        create(a, file_id, "another batch")
    assert refused.value.body["code"] in ("batch_limit_exceeded", "storage_limit_exceeded")
    with pytest.raises(openai.RateLimitError):
        upload_keyed(a, path, "another upload")


def test_parallel_repeats_make_one_batch_and_one_file(start_service, tmp_path, slow_store):  # noqa: F811
    """Eight clients send the same create with the same key at once, each inside its slow copy together: the store's
    unique key lets one commit; the seven others answer its object, and take back what they wrote."""
    service = start_service(worker=False, key_max_active_batches=1, key_max_uploads=None)
    a = service.client(KEY_A)
    path = write_jsonl(tmp_path / "in.jsonl", rows(2))
    files = in_parallel(8, lambda _: upload_keyed(a, path, "same upload"))
    assert all(isinstance(f, str) for f in files), files
    assert len(set(files)) == 1 and [f.id for f in a.files.list()] == files[:1]
    assert len(list((service.data_dir / "files").rglob("*.jsonl"))) == 1
    made = in_parallel(8, lambda _: create(a, files[0], "same batch"))
    assert all(isinstance(b, openai.types.Batch) for b in made), made  # none refused by the limit of one
    assert len({b.id for b in made}) == 1  # type: ignore[union-attr]
    assert count(service, BatchRecord) == 1 and count(service, FileRecord, purpose="batch") == 1
    folders = [p for p in (service.data_dir / "batches").iterdir() if p.is_dir()]
    assert [p.name for p in folders] == [made[0].id]  # type: ignore[union-attr]  # the losers' folders are gone
