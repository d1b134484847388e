"""The Files API with the openai SDK: upload, list, retrieve, download, delete, and what uploads may be."""

from __future__ import annotations

import io

import openai
import pytest

from batch_dagster.api.uploads import sanitize_filename
from tests.helpers import rows, upload, wait_for


def test_upload_retrieve_list_download_delete(start_service, tmp_path):
    service = start_service(worker=False)
    client = service.client()
    path = tmp_path / "requests.jsonl"
    file_id = upload(client, path, rows(3))

    info = client.files.retrieve(file_id)
    assert info.id.startswith("file-") and info.object == "file" and info.purpose == "batch"
    assert info.filename == "requests.jsonl" and info.bytes == path.stat().st_size and info.created_at > 0
    assert client.files.content(file_id).content == path.read_bytes()
    assert [f.id for f in client.files.list()] == [file_id]
    assert client.files.list(purpose="batch_output").data == []

    deleted = client.files.delete(file_id)
    assert deleted.id == file_id and deleted.deleted is True and deleted.object == "file"
    for call in (lambda: client.files.retrieve(file_id), lambda: client.files.content(file_id),
                 lambda: client.files.delete(file_id)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert client.files.list().data == []
    assert list((service.data_dir / "files").iterdir()) == []


def test_files_list_pages_and_orders(start_service, tmp_path):
    service = start_service(worker=False)
    client = service.client()
    ids = [upload(client, tmp_path / f"f{i}.jsonl", rows(1)) for i in range(3)]
    page = client.files.list(limit=2)
    assert [f.id for f in page.data] == ids[::-1][:2] and page.has_more
    assert [f.id for f in client.files.list(limit=2)] == ids[::-1]
    assert [f.id for f in client.files.list(order="asc", limit=1)] == ids


def test_deleting_an_input_file_leaves_its_batch_intact(start_service, tmp_path):
    service = start_service()
    client = service.client()
    file_id = upload(client, tmp_path / "in.jsonl", rows(2))
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    client.files.delete(file_id)
    done = wait_for(client, batch.id, "completed")
    assert done.input_file_id == file_id and done.request_counts.completed == 2
    client.files.delete(done.output_file_id)
    with pytest.raises(openai.NotFoundError):
        client.files.content(done.output_file_id)
    assert client.files.content(done.error_file_id).content == b""


def test_upload_over_the_limit_is_413(start_service):
    service = start_service(worker=False, max_upload_bytes=4096)
    client = service.client()
    body = b"".join(b'{"custom_id": "r%d", "method": "POST"}\n' % i for i in range(400))
    assert 4096 < len(body) < 64 * 1024  # inside the request guard's slack: caught while storing
    with pytest.raises(openai.APIStatusError) as too_large:
        client.files.create(file=("big.jsonl", io.BytesIO(body)), purpose="batch")
    assert too_large.value.status_code == 413 and too_large.value.code == "file_too_large"
    huge = body * 40  # over the slack: refused by the guard before the app stores anything
    with pytest.raises(openai.APIStatusError) as too_large:
        client.files.create(file=("huge.jsonl", io.BytesIO(huge)), purpose="batch")
    assert too_large.value.status_code == 413
    with service.http() as http:  # a chunked upload declares no length: counted as it arrives
        head = b'--XX\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--XX\r\n' \
               b'Content-Disposition: form-data; name="file"; filename="c.jsonl"\r\n\r\n'

        def chunks():
            yield head
            for _ in range(40):
                yield body
            yield b"\r\n--XX--\r\n"

        chunked = http.post("/v1/files", content=chunks(), headers={"content-type": "multipart/form-data; boundary=XX"})
        assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "file_too_large"
    assert client.files.list().data == [] and not list((service.data_dir / "files").glob("*"))
    # The server still answers normally afterwards.
    small = client.files.create(file=("ok.jsonl", io.BytesIO(body[:1000].rsplit(b"\n", 1)[0] + b"\n")), purpose="batch")
    assert small.bytes < 1000


@pytest.mark.parametrize("filename, content, purpose, param", [
    ("data.csv", b'{"a": 1}\n', "batch", "file"),
    ("notes.jsonl", b"hello world\n", "batch", "file"),
    ("empty.jsonl", b"\n\n", "batch", "file"),
    ("latin1.jsonl", '{"custom_id": "é"}\n'.encode("latin-1"), "batch", "file"),
    ("tune.jsonl", b'{"a": 1}\n', "fine-tune", "purpose"),
])
def test_uploads_that_are_not_batch_jsonl_are_refused(shared_service, filename, content, purpose, param):
    client = shared_service().client()
    with pytest.raises(openai.BadRequestError) as refused:
        client.files.create(file=(filename, io.BytesIO(content)), purpose=purpose)
    assert refused.value.param == param


def test_filenames_are_sanitized(start_service):
    service = start_service(worker=False)
    client = service.client()
    created = client.files.create(file=("../../etc/pass;wd.jsonl", io.BytesIO(b'{"a": 1}\n')), purpose="batch")
    assert created.filename == "passwd.jsonl"
    stored = list((service.data_dir / "files").iterdir())
    assert [p.name for p in stored] == [f"{created.id}.jsonl"]
    with service.http() as http:
        response = http.get(f"/v1/files/{created.id}/content")
        assert 'filename="passwd.jsonl"' in response.headers["content-disposition"]
        # A raw multipart body can carry control characters the SDK would have escaped.
        body = (b'--XX\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
                b'--XX\r\nContent-Disposition: form-data; name="file"; filename="..\\a\x01b\x7f.jsonl"\r\n'
                b'Content-Type: application/octet-stream\r\n\r\n{"a": 1}\n\r\n--XX--\r\n')
        raw = http.post("/v1/files", content=body, headers={"content-type": "multipart/form-data; boundary=XX"})
        assert raw.status_code == 200 and raw.json()["filename"] == "ab.jsonl"


def test_sanitize_filename():
    assert sanitize_filename("C:\\Users\\me\\batch file.jsonl") == "batch file.jsonl"
    assert sanitize_filename("..") == "upload.jsonl" and sanitize_filename(None) == "upload.jsonl"
    # Format characters (Cf: bidi overrides, zero-width) and controls (Cc, C1 included) are dropped.
    assert sanitize_filename("evil\u202elnosj.exe.jsonl") == "evillnosj.exe.jsonl"
    assert sanitize_filename("a\u200bb\u2066c\u0085d\ufeff.jsonl") == "abcd.jsonl"
    assert sanitize_filename(".hidden.jsonl") == "hidden.jsonl"
    assert sanitize_filename('a<b>"c"|?*.jsonl') == "abc.jsonl"
    long = sanitize_filename("x" * 300 + ".jsonl")
    assert long.endswith(".jsonl") and len(long.encode()) <= 255
    assert sanitize_filename("résumé\u200b.jsonl").startswith("résumé")


def test_unknown_routes_and_methods_answer_in_the_error_shape(start_service):
    service = start_service(worker=False)
    with service.http() as http:
        response = http.get("/v1/nothing-here")
        assert response.status_code == 404
        assert response.json()["error"]["message"] == "Invalid URL (GET /v1/nothing-here)"
        assert http.put("/v1/files").status_code == 405
        assert http.get("/v1/files", params={"limit": 0}).json()["error"]["param"] == "limit"


def test_files_expire(start_service, tmp_path):
    service = start_service(worker=False)
    client = service.client()
    with open(tmp_path / "in.jsonl", "wb") as f:
        f.write(b'{"a": 1}\n')
    with open(tmp_path / "in.jsonl", "rb") as f:
        created = client.files.create(file=f, purpose="batch", expires_after={"anchor": "created_at", "seconds": 3600})
    assert created.expires_at == created.created_at + 3600
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=("x.jsonl", io.BytesIO(b'{"a": 1}\n')), purpose="batch",
                            expires_after={"anchor": "created_at", "seconds": 60})

    from sqlalchemy import update

    from batch_dagster.db import Database, FileRecord
    from batch_dagster.defs.sensors import api_batch_status_sensor, file_expiry_sensor

    store = Database(service.config.database_url)
    with store.session() as session:  # as if an hour had passed
        session.execute(update(FileRecord).where(FileRecord.id == created.id).values(expires_at=created.created_at))
        session.commit()
    store.dispose()
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(created.id)
    assert client.files.list().data == []
    assert (service.data_dir / "files" / f"{created.id}.jsonl").exists()
    import dagster as dg

    context = dg.build_sensor_context(instance=service.instance, resources=service.worker.resources)
    api_batch_status_sensor(context)  # follows batches only: expiry is its own sensor
    assert (service.data_dir / "files" / f"{created.id}.jsonl").exists()
    assert file_expiry_sensor(context).skip_message == "1 expired file(s) deleted."
    assert not (service.data_dir / "files" / f"{created.id}.jsonl").exists()
    assert file_expiry_sensor(context).skip_message == "0 expired file(s) deleted."



def test_the_file_list_answers_a_page_by_default_and_the_sdk_reads_them_all(start_service, tmp_path):
    """A long history is read a page at a time (100 by default, not 10,000 rows in one call); the SDK's list
    follows the pages."""
    service = start_service(worker=False)
    client = service.client()
    ids = [upload(client, tmp_path / f"f{i}.jsonl", rows(1)) for i in range(3)]
    with service.http() as http:
        params = http.get("/openapi.json").json()["paths"]["/v1/files"]["get"]["parameters"]
        assert {p["name"]: p["schema"].get("default") for p in params}["limit"] == 100
        page = http.get("/v1/files", params={"limit": 2}).json()
        assert len(page["data"]) == 2 and page["has_more"] is True
    assert sorted(f.id for f in client.files.list(limit=2)) == sorted(ids)


def test_the_store_uploads_and_batch_folders_are_readable_by_their_owner_only(start_service, tmp_path):
    """Under the usual umask (022, which leaves files world-readable), the SQLite store (it keeps webhook secrets),
    an upload and a batch's folder are created for the service's user alone: files 0600, folders 0700."""
    import os
    import stat

    from batch_dagster.db import Database
    from tests.helpers import KEY_A

    def mode(path) -> int:
        return stat.S_IMODE(path.stat().st_mode)

    before = os.umask(0o022)
    try:
        service = start_service()
        client = service.client(KEY_A)
        file_id = upload(client, tmp_path / "in.jsonl", rows(2))
        batch = wait_for(client, client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                                       completion_window="24h").id, "completed")
    finally:
        os.umask(before)
    store = service.data_dir / "api.db"
    Database(service.config.database_url).dispose()
    assert {p.name: mode(p) for p in service.data_dir.glob("api.db*")} == {
        p.name: 0o600 for p in service.data_dir.glob("api.db*")} and mode(store) == 0o600  # and its -wal, -shm
    files = service.data_dir / "files"
    assert mode(files / f"{file_id}.jsonl") == 0o600 and mode(files) == 0o700
    folder = service.data_dir / "batches" / batch.id
    assert mode(folder) == 0o700 and mode(folder.parent) == 0o700
    modes = {p.name: mode(p) for p in folder.glob("*") if p.is_file()}
    assert modes and set(modes.values()) == {0o600}, modes
