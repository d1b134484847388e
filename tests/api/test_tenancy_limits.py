"""Per-key limits (issue #18): batches not yet ended and bytes of files stored, each answered past its limit with a
429 in OpenAI's shape; and keys with names (`name:key`) are the same owners as the bare keys they name."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import openai
import pytest

from batch_dagster.db import Database, keys, repo
from batch_dagster.features.quotas import stored_bytes
from tests.helpers import KEY_A, KEY_B, rows, upload, wait_for, write_jsonl

CHAT = "/v1/chat/completions"


def create(client, file_id: str):
    return client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")


def test_a_key_past_its_unfinished_batches_gets_a_429_and_others_do_not(start_service, tmp_path):
    service = start_service(worker=False, key_max_active_batches=2)
    a, b = service.client(KEY_A), service.client(KEY_B)
    file_a = upload(a, tmp_path / "a.jsonl", rows(2))
    first, _ = create(a, file_a), create(a, file_a)
    with pytest.raises(openai.RateLimitError) as refused:
        create(a, file_a)
    error = refused.value.body
    assert (error["code"], error["type"]) == ("batch_limit_exceeded", "rate_limit_exceeded")
    assert "BATCH_KEY_MAX_ACTIVE_BATCHES" in error["message"]
    create(b, upload(b, tmp_path / "b.jsonl", rows(2)))  # the limit is per key
    a.batches.cancel(first.id)  # being cancelled: counted until it has ended (its run is still to come)
    with pytest.raises(openai.RateLimitError):
        create(a, file_a)
    with Database(service.config.database_url).session() as session:  # as the status sensor ends it
        row = repo.get_batch(session, repo.owner_of_key(KEY_A), first.id)
        assert row is not None
        row.status = "cancelled"
        session.commit()
    assert create(a, file_a).status == "validating"  # one ended: room for one more
    with pytest.raises(openai.RateLimitError):
        create(a, file_a)


def test_create_then_cancel_never_passes_the_active_batch_limit(start_service, tmp_path):
    """Sixteen creates, each cancelled at once, under a limit of one: a batch being cancelled counts until it has
    ended, so the second create is refused and one batch (not sixteen) waits for a run; once it has ended, there is
    room again."""
    service = start_service(worker=False, key_max_active_batches=1)
    a = service.client(KEY_A)
    file_id = upload(a, tmp_path / "a.jsonl", rows(2))
    made, codes = [], []
    for _ in range(16):
        try:
            batch = create(a, file_id)
        except openai.RateLimitError as exc:
            codes.append(exc.body["code"])  # type: ignore[index]
            continue
        made.append(batch)
        assert a.batches.cancel(batch.id).status == "cancelling"
    assert len(made) == 1 and codes == ["batch_limit_exceeded"] * 15
    with Database(service.config.database_url).session() as session:
        assert [b.id for b in repo.batches_to_launch(session)] == [made[0].id]  # one run to come
    service.start_worker()
    assert wait_for(a, made[0].id, {"cancelled", "completed", "failed"}).status == "cancelled"
    assert create(a, file_id).status == "validating"


def test_a_key_past_its_stored_bytes_gets_a_429_until_it_deletes(start_service, tmp_path):
    service = start_service(worker=False, key_max_stored_bytes=3000)
    a, b = service.client(KEY_A), service.client(KEY_B)
    first = upload(a, tmp_path / "a1.jsonl", rows(10))
    size = a.files.retrieve(first).bytes
    assert 1500 < size <= 3000, size  # two of these do not fit
    with pytest.raises(openai.RateLimitError) as refused:
        upload(a, tmp_path / "a2.jsonl", rows(10))
    assert refused.value.body["code"] == "storage_limit_exceeded"
    assert [f.id for f in a.files.list()] == [first]  # the refused upload left nothing
    upload(b, tmp_path / "b.jsonl", rows(10))  # per key
    a.files.delete(first)
    upload(a, tmp_path / "a3.jsonl", rows(10))


def test_a_named_key_is_the_owner_of_the_bare_key_it_names(start_service, tmp_path):
    """Naming a key (BATCH_API_KEYS=name:key) changes how the UI shows its owner, not which rows are its."""
    service = start_service(worker=False, api_keys=(KEY_A,))
    file_id = upload(service.client(KEY_A), tmp_path / "a.jsonl", rows(2))
    named = start_service(worker=False, api_keys=(f"alice:{KEY_A}", KEY_B))
    assert named.client(KEY_A).files.retrieve(file_id).id == file_id
    with pytest.raises(openai.AuthenticationError):
        named.client(f"alice:{KEY_A}").files.list()  # the name is no part of the key
    with Database(named.config.database_url).session() as session:
        assert keys.authenticate(session, KEY_A) == keys.Caller(repo.owner_of_key(KEY_A), "alice")
        assert keys.authenticate(session, KEY_B).owner == repo.owner_of_key(KEY_B)


def in_parallel(n: int, call: Callable[[int], object]) -> list[object]:
    """`call(i)` for i in range(n), each from a thread of its own, all released at once; each answer or exception."""
    start, answers = threading.Barrier(n), [None] * n

    def one(i: int) -> None:
        start.wait()
        try:
            answers[i] = call(i)
        except Exception as exc:  # the caller sorts answers from refusals
            answers[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return answers


@pytest.fixture
def slow_store(monkeypatch):
    """The store's copies and writes take a third of a second, as a large input's do: long enough for every parallel
    request to be inside its create or upload at once."""
    from batch_dagster.storage import LocalStorage

    def slowly(method):
        def slow(*args, **kwargs):
            time.sleep(0.3)
            return method(*args, **kwargs)
        return slow

    monkeypatch.setattr(LocalStorage, "copy", slowly(LocalStorage.copy))
    monkeypatch.setattr(LocalStorage, "writing", slowly(LocalStorage.writing))


def refused(answers: list[object], code: str) -> int:
    return sum(isinstance(a, openai.RateLimitError) and a.body["code"] == code for a in answers)  # type: ignore[index]


def test_parallel_creates_never_pass_the_active_batch_limit(start_service, tmp_path, slow_store):
    """Eight clients create at once with room for one: one batch exists after, seven got their 429, and the
    refused creates left no folder (the count and the insert are one step per key; the input copy is not)."""
    service = start_service(worker=False, key_max_active_batches=1)
    file_id = upload(service.client(), tmp_path / "in.jsonl", rows(10))
    answers = in_parallel(8, lambda _: create(service.client(), file_id))
    made = [a for a in answers if isinstance(a, openai.types.Batch)]
    assert len(made) == 1 and refused(answers, "batch_limit_exceeded") == 7, answers
    assert [b.id for b in service.client().batches.list()] == [made[0].id]
    assert sorted(p.name for p in (service.data_dir / "batches").iterdir()) == [made[0].id]
    # A retry is a create: it waits for room as well.
    with pytest.raises(openai.RateLimitError):
        service.client().post(f"/batches/{made[0].id}/retry", cast_to=openai.types.Batch)


def test_parallel_uploads_never_pass_the_stored_bytes_limit(start_service, tmp_path, slow_store):
    """With room for three files, eight parallel uploads store three: each sees the others' bytes."""
    size = write_jsonl(tmp_path / "in.jsonl", rows(10)).stat().st_size
    service = start_service(worker=False, key_max_stored_bytes=size * 3, key_max_uploads=None)

    def send(i: int) -> str:
        with open(tmp_path / "in.jsonl", "rb") as f:
            return service.client().files.create(file=(f"u{i}.jsonl", f), purpose="batch").id

    answers = in_parallel(8, send)
    kept = [a for a in answers if isinstance(a, str)]
    assert len(kept) == 3 and refused(answers, "storage_limit_exceeded") == 5, answers
    assert sorted(f.id for f in service.client().files.list()) == sorted(kept)
    assert len(list((service.data_dir / "files").iterdir())) == 3  # a refused upload's bytes are deleted


def test_a_batch_counts_its_own_input_copy_and_its_working_files(start_service, tmp_path):
    """Upload, create, delete the upload: the key still keeps the batch's copy of its input, then (once it has run)
    every byte of its folder: its working files and its output and error files."""
    service = start_service(shard_size=2, key_max_stored_bytes=1 << 30)
    client = service.client()
    file_id = upload(client, tmp_path / "in.jsonl", rows(10))
    size = client.files.retrieve(file_id).bytes
    batch = create(client, file_id)
    client.files.delete(file_id)
    owner = repo.owner_of_key(KEY_A)
    with Database(service.config.database_url).session() as session:
        assert stored_bytes(session, owner) == size  # its folder's copy of the deleted upload
    done = wait_for(client, batch.id, "completed")
    folder = sum(p.stat().st_size for p in (service.data_dir / "batches" / batch.id).rglob("*") if p.is_file())
    assert folder > 3 * size  # its input copy, requests and shards at least, and its results
    with Database(service.config.database_url).session() as session:
        assert stored_bytes(session, owner) == folder  # every byte it keeps; its output and error files as Files
    assert client.files.retrieve(done.output_file_id).bytes > 0


def upload_head(service, size: int, *, key: str = KEY_A, expect: bool = False) -> tuple[bytes, bytes]:
    """A raw upload's request head declaring a `size`-byte file, and the form's bytes before the file."""
    form = b'--x\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n' \
           b'--x\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n'
    end = b"\r\n--x--\r\n"
    head = (f"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
            "Content-Type: multipart/form-data; boundary=x\r\n"
            f"Content-Length: {len(form) + size + len(end)}\r\n" + ("Expect: 100-continue\r\n" if expect else "")
            + "\r\n").encode()
    return head, form


def port_of(service) -> int:
    return int(service.url.rsplit(":", 1)[1])


def test_an_upload_past_the_keys_room_is_refused_from_its_declared_length(start_service, tmp_path):
    """A key with 1,000 bytes of room declares a 4 MiB upload: answered 429 from the headers, before a byte of the
    body is read (a server that read first would wait here for the body it was promised)."""
    import socket

    service = start_service(worker=False, key_max_stored_bytes=3000)
    upload(service.client(), tmp_path / "a.jsonl", rows(10))  # about 2,000 bytes of the 3,000
    head, _ = upload_head(service, 4 << 20)
    with socket.create_connection(("127.0.0.1", port_of(service)), timeout=5) as sock:
        sock.sendall(head)
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 429") and b"storage_limit_exceeded" in answer, answer[:300]


def test_a_streamed_upload_stops_at_the_keys_room_without_the_app_taking_a_byte_past_it(start_service, tmp_path,
                                                                                        monkeypatch):
    """Chunked (no declared length), the file's bytes are counted as they arrive: the upload is answered 429 once
    they pass the key's room, and the app (its form parser's spooled file) never got more than the room."""
    from starlette.datastructures import UploadFile

    from tests.api.test_hardening import refused_and_closed

    written = []
    original = UploadFile.write

    async def counted(self, data: bytes) -> None:
        written.append(len(data))
        await original(self, data)

    monkeypatch.setattr(UploadFile, "write", counted)
    service = start_service(worker=False, key_max_stored_bytes=300_000, max_upload_bytes=100 << 20)
    head, form = upload_head(service, 0)
    head = head.replace(b"Content-Length: ", b"X-Was: ").replace(b"\r\n\r\n", b"\r\nTransfer-Encoding: chunked\r\n\r\n")
    data = b'{"custom_id": "a"}\n' * 3000
    chunk = b"%x\r\n%s\r\n" % (len(data), data)
    line, sent = refused_and_closed(port_of(service), head + b"%x\r\n%s\r\n" % (len(form), form), chunk)
    assert line.startswith(b"HTTP/1.1 429"), line
    assert sum(written) <= 300_000 and sent < 40 << 20, (sum(written), sent)
    assert service.client().files.list().data == []


def test_a_key_has_a_bounded_number_of_uploads_at_once(start_service, tmp_path):
    """Two uploads of one key streaming (BATCH_KEY_MAX_UPLOADS=2): its third is answered 429 at once, another key's
    goes through, and once one of the two has ended the key may upload again."""
    import socket

    service = start_service(worker=False, key_max_uploads=2)
    held = []
    for _ in range(2):
        head, form = upload_head(service, 1000, expect=True)
        sock = socket.create_connection(("127.0.0.1", port_of(service)), timeout=5)
        sock.sendall(head)
        assert sock.recv(100).startswith(b"HTTP/1.1 100 Continue")  # admitted: the app waits for its body
        sock.sendall(form + b"{}" * 100)
        held.append(sock)
    with pytest.raises(openai.RateLimitError) as refused_upload:
        upload(service.client(KEY_A), tmp_path / "a.jsonl", rows(2))
    assert refused_upload.value.body["code"] == "too_many_uploads"  # type: ignore[index]
    assert "BATCH_KEY_MAX_UPLOADS" in refused_upload.value.body["message"]  # type: ignore[index]
    upload(service.client(KEY_B), tmp_path / "b.jsonl", rows(2))  # per key
    held.pop().close()
    deadline = time.monotonic() + 5
    while True:  # the closed upload's slot comes back once the server has seen it go
        try:
            upload(service.client(KEY_A), tmp_path / "a.jsonl", rows(2))
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    held.pop().close()
