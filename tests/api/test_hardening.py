"""What no client can do to the API: make it read an unbounded body, read a body before the key is checked,
echo its input back at length, store text it cannot give back, or get a 500 (issue #13)."""

from __future__ import annotations

import json
import select
import socket
import time

import httpx
import pytest

from batch_dagster.batchfile.folder import BatchFolder
from batch_dagster.db import BatchRecord, Database
from batch_dagster.storage import LocalStorage
from tests.helpers import KEY_A, rows, upload, wait_for

CHAT = "/v1/chat/completions"


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text[:300]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def raw_request(port: int, head: bytes, body: bytes = b"", timeout_s: float = 10) -> bytes:
    """Send a request's head (and part of a body) on a plain socket; the status line of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(head + body)
        return sock.recv(65536).split(b"\r\n", 1)[0]


def test_json_bodies_past_the_limit_are_413_declared_or_chunked(start_service):
    service = start_service(worker=False, max_json_body_bytes=4096)
    body = json.dumps({"input_file_id": "file-x", "endpoint": CHAT, "completion_window": "24h",
                       "metadata": {"k": "v" * 5000}}).encode()
    with service.http() as http:
        error = assert_error(http.post("/v1/batches", content=body, headers={"content-type": "application/json"}), 413)
        assert error["code"] == "request_too_large" and "4096" in error["message"]

        def chunks():
            for i in range(0, len(body), 1000):
                yield body[i:i + 1000]

        chunked = http.post("/v1/batches", content=chunks(), headers={"content-type": "application/json"})
        assert chunked.request.headers.get("transfer-encoding") == "chunked"
        assert assert_error(chunked, 413)["code"] == "request_too_large"
        # Under the limit the request goes through to the route (a 404 for the unknown file).
        assert_error(http.post("/v1/batches", json={"input_file_id": "file-x", "endpoint": CHAT,
                                                    "completion_window": "24h"}), 404, "input_file_id")


@pytest.mark.parametrize("path", ["/v1/files", "/v1/batches"])
@pytest.mark.parametrize("auth", [b"", b"Authorization: Bearer sk-wrong\r\n"])
def test_a_request_without_a_right_key_is_refused_before_its_body_is_read(shared_service, path, auth):
    service = shared_service()
    # 300 MB declared, none of it sent: the 401 comes from the headers alone (a server reading the body first
    # would wait for it until the socket times out).
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: multipart/form-data; boundary=x\r\n"
            f"Content-Length: {300 * 1024 * 1024}\r\n").encode() + auth + b"\r\n"
    assert raw_request(int(service.url.rsplit(":", 1)[1]), head, b"--x\r\n") == b"HTTP/1.1 401 Unauthorized"


def test_error_messages_echo_only_a_short_prefix_of_the_input(start_service):
    service = start_service(worker=False)
    long_id = "file-" + "x" * 200_000
    with service.http() as http:
        for response in (
            http.post("/v1/batches", json={"input_file_id": long_id, "endpoint": CHAT, "completion_window": "24h"}),
            http.get(f"/v1/files/{long_id[:20_000]}"),
            http.get("/v1/batches", params={"after": long_id[:20_000]}),
            http.post("/v1/batches", json={"input_file_id": "f", "endpoint": "/v1/" + "e" * 200_000,
                                           "completion_window": "24h"}),
        ):
            error = assert_error(response, response.status_code)
            assert response.status_code in (400, 404) and len(error["message"]) < 200, error["message"][:300]
            assert "…" in error["message"]


def test_a_failed_batch_object_stays_small_whatever_its_file_held(start_service, tmp_path):
    """A 1 MB url and a model named in 1 MB are quoted short; 5,000 bad lines list 100 errors and a count."""
    service = start_service()
    client = service.client()
    huge = "x" * (1 << 20)
    files = {"long": [rows(1)[0] | {"url": huge}, rows(1)[0] | {"custom_id": "b", "body": {"model": huge}}],
             "many": [rows(1)[0] | {"custom_id": f"r{i}", "url": "/v1/nope"} for i in range(5000)]}
    for name, lines in files.items():
        file_id = upload(client, tmp_path / f"{name}.jsonl", lines)
        batch = client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
        failed = wait_for(client, batch.id, {"failed", "completed"}, timeout_s=120)
        assert failed.status == "failed" and failed.errors is not None and failed.errors.object == "list"
        assert len(client.batches.retrieve(batch.id).to_json()) < 48 * 1024
        with service.http() as http:
            assert len(http.get("/v1/batches").content) < 64 * 1024
        assert all(len(e.message) < 200 for e in failed.errors.data)
        if name == "many":
            assert len(failed.errors.data) == 101 and failed.errors.data[-1].code == "more_errors"
            assert "4900 more" in failed.errors.data[-1].message
        assert failed.model is None or len(failed.model) < 300


SURROGATE_BODIES = [  # raw JSON: FILE is an uploaded file's id, CHAT the chat endpoint
    ('{"input_file_id": "\\ud800", "endpoint": "CHAT", "completion_window": "24h"}', "input_file_id"),
    ('{"input_file_id": "FILE", "endpoint": "CHAT", "completion_window": "24h", "metadata": {"k": "\\udfff"}}',
     "metadata.k"),
    ('{"input_file_id": "FILE", "endpoint": "CHAT", "completion_window": "24h", "metadata": {"\\ud83d": "v"}}',
     None),
    ('{"input_file_id": "FILE", "endpoint": "\\ud800", "completion_window": "24h"}', "endpoint"),
    ('{"input_file_id": "FILE\\u0000", "endpoint": "CHAT", "completion_window": "24h"}', "input_file_id"),
]


def test_invalid_unicode_anywhere_is_a_400_and_a_create_leaves_nothing_behind(start_service, tmp_path):
    service = start_service(worker=False)
    client = service.client()
    file_id = upload(client, tmp_path / "in.jsonl", rows(1))
    with service.http() as http:
        for body, param in SURROGATE_BODIES:
            response = http.post("/v1/batches", content=body.replace("FILE", file_id).replace("CHAT", CHAT).encode(),
                                 headers={"content-type": "application/json"})
            error = assert_error(response, 400)
            if param is not None:
                assert error["param"] == param
            assert error["type"] == "invalid_request_error"
        # Path and query parameters, percent-encoded invalid UTF-8 and NUL.
        for url in ("/v1/files/%ED%A0%80", "/v1/batches/%ED%A0%80", "/v1/files/%00/content",
                    "/v1/batches?after=%ED%A0%80", "/v1/files?purpose=%00", "/v1/batches/%ff%fe/cancel"):
            response = http.post(url) if url.endswith("cancel") else http.get(url)
            assert response.status_code in (400, 404), (url, response.text[:200])
            assert_error(response, response.status_code)
        # A filename that is not UTF-8, or holds controls, still gives a clean File (or a clean 400).
        for name in (b"\xed\xa0\x80.jsonl", b"a\x00b\x1b.jsonl"):
            multipart = (b"--b\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n--b\r\n"
                         b"Content-Disposition: form-data; name=\"file\"; filename=\"" + name + b"\"\r\n\r\n"
                         + json.dumps(rows(1)[0]).encode() + b"\n\r\n--b--\r\n")
            response = http.post("/v1/files", content=multipart,
                                 headers={"content-type": "multipart/form-data; boundary=b"})
            assert response.status_code == 200, response.text[:200]
            assert all(c.isprintable() for c in response.json()["filename"])
        assert http.get("/v1/batches").json()["data"] == []
    # Nothing written for any of the refused creates: no row (above), no batch folder.
    batches_dir = service.data_dir / "batches"
    assert not batches_dir.exists() or list(batches_dir.iterdir()) == []


def test_one_odd_stored_value_never_breaks_a_listing(start_service, tmp_path):
    """A row whose metadata holds what validation now refuses (a lone surrogate, a non-string, as an older
    version or another writer could have stored) still lists, retrieves and cancels."""
    service = start_service(worker=False)
    client = service.client()
    ok = client.batches.create(input_file_id=upload(client, tmp_path / "in.jsonl", rows(1)), endpoint=CHAT,
                               completion_window="24h")
    store = Database(service.config.database_url)
    with store.session() as session:
        row = session.get(BatchRecord, session.query(BatchRecord.pk).filter_by(id=ok.id).scalar())
        row.meta = {"bad\ud800": "\udfffvalue", "n": 5, "nested": {"a": [1]}}
        row.errors = [{"code": "x", "message": "\ud800", "line": "one", "param": 5}, "not an error"]
        row.usage = {"input_tokens": "many"}
        session.commit()
    # A second batch whose folder holds a validation document that cannot be read.
    broken = client.batches.create(input_file_id=upload(client, tmp_path / "in2.jsonl", rows(1)), endpoint=CHAT,
                                   completion_window="24h")
    storage = LocalStorage(service.data_dir)
    storage.write_bytes(BatchFolder(storage, broken.id).key(BatchFolder.VALIDATION), b"{not json")
    store.dispose()
    with service.http() as http:
        listed = http.get("/v1/batches")
        assert listed.status_code == 200, listed.text[:300]
        assert [b["id"] for b in listed.json()["data"]] == [broken.id, ok.id]
        batch = listed.json()["data"][1]
        assert batch["errors"]["data"] == [{"code": "x", "message": "?", "param": "5", "line": None}]
        assert batch["id"] == ok.id and batch["metadata"]["n"] == "5" and batch["metadata"]["nested"] == '{"a": [1]}'
        assert http.get(f"/v1/batches/{ok.id}").status_code == 200
        assert http.post(f"/v1/batches/{ok.id}/cancel").status_code == 200
        # The batch with the damaged folder answers as stored, on its own and when cancelled.
        alone = http.get(f"/v1/batches/{broken.id}")
        assert alone.status_code == 200 and alone.json()["status"] == "validating", alone.text[:300]
        cancelled = http.post(f"/v1/batches/{broken.id}/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelling", cancelled.text[:300]


def test_unsupported_methods_are_405_with_allow(start_service):
    service = start_service(worker=False)
    with service.http() as http:
        for method, path, allowed in [("TRACE", "/v1/batches", {"GET", "POST"}),
                                      ("PUT", "/v1/files/file-x", {"GET", "DELETE"}), ("DELETE", "/v1/batches/b", {"GET"})]:
            response = http.request(method, path)
            assert_error(response, 405)
            assert set(response.headers["allow"].replace(" ", "").split(",")) == allowed, response.headers


def test_openapi_documents_the_real_responses(start_service):
    service = start_service(worker=False)
    with service.http(api_key=None) as http:
        schema = http.get("/openapi.json").json()
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            codes = set(operation["responses"])
            assert "422" not in codes and {"200", "400", "401", "404", "413"} <= codes, (method, path, codes)
            # Anthropic's Message Batches answer errors in Anthropic's shape (api/anthropic_shape.py).
            error = "AnthropicError" if path.startswith("/v1/messages/") else "ErrorResponse"
            assert operation["responses"]["401"]["content"]["application/json"]["schema"] == {
                "$ref": f"#/components/schemas/{error}"}
    content = schema["paths"]["/v1/files/{file_id}/content"]["get"]["responses"]["200"]["content"]
    assert list(content) == ["application/octet-stream"]
    create = schema["components"]["schemas"]["CreateBatchRequest"]["properties"]
    assert create["completion_window"]["enum"] == ["1h", "24h"] and CHAT in create["endpoint"]["enum"]
    assert schema["components"]["schemas"]["Body_create_file_v1_files_post"]["properties"]["purpose"]["enum"] == [
        "batch"]


def test_keys_are_checked_before_404_and_405(start_service):
    service = start_service(worker=False)
    with service.http(api_key=None) as http:
        assert_error(http.get("/v1/nowhere"), 401)
        assert_error(http.request("TRACE", "/v1/batches"), 401)
    with service.http(api_key=KEY_A) as http:
        assert_error(http.get("/v1/nowhere"), 404)


def refused_and_closed(port: int, head: bytes, chunk: bytes, budget: int = 150 * 1024 * 1024) -> tuple[bytes, int]:
    """Send `head`, then `chunk`s (up to `budget` bytes) as fast as the server takes them, reading its answer as it
    comes, until the server closes; (the answer's status line, bytes sent). Fails if it is open after 5 s."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(head)
        sock.setblocking(False)
        answer, sent, pending, deadline = b"", 0, chunk, time.monotonic() + 5
        try:
            while time.monotonic() < deadline:
                readable, writable, _ = select.select([sock], [sock] if sent < budget else [], [], 0.05)
                if readable:
                    data = sock.recv(65536)
                    if not data:
                        return answer.split(b"\r\n", 1)[0], sent  # closed
                    answer += data
                if writable:
                    n = sock.send(pending)
                    sent, pending = sent + n, pending[n:] or chunk
        except (BrokenPipeError, ConnectionResetError):
            return answer.split(b"\r\n", 1)[0], sent
        if sent >= budget:
            pytest.fail(f"the server read all {sent} bytes of a refused body")
        pytest.fail(f"still open after 5 s and {sent} bytes")


BIG = 150 * 1024 * 1024


@pytest.mark.parametrize(("auth", "framing", "status"), [
    (b"", f"Content-Length: {BIG}", b"401"),
    (b"", "Transfer-Encoding: chunked", b"401"),
    (f"Authorization: Bearer {KEY_A}\r\n".encode(), f"Content-Length: {BIG}", b"413"),
    (f"Authorization: Bearer {KEY_A}\r\n".encode(), "Transfer-Encoding: chunked", b"413"),
], ids=["401-declared", "401-chunked", "413-declared", "413-chunked"])
def test_a_refused_body_is_not_read_past_a_small_bound(shared_service, auth, framing, status):
    service = shared_service(max_upload_bytes=1 << 20)
    port = int(service.url.rsplit(":", 1)[1])
    head = (f"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: multipart/form-data; boundary=x\r\n"
            f"{framing}\r\n").encode() + auth + b"\r\n"
    data = b"x" * 65536
    chunk = b"%x\r\n%s\r\n" % (len(data), data) if "chunked" in framing else data
    # A well-formed upload's start, so that the app reads on (the 413 then comes from the limit, not the form).
    form = b'--x\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n'
    first = b"%x\r\n%s\r\n" % (len(form), form) if "chunked" in framing else form
    started = time.monotonic()
    line, sent = refused_and_closed(port, head + first, chunk)  # the answer read before the close
    assert line.startswith(b"HTTP/1.1 " + status), line
    # Closed within a couple of seconds, with a small part of the body sent (what socket buffers took).
    assert time.monotonic() - started < 4 and sent < 40 * 1024 * 1024, sent


def test_a_refusal_says_connection_close_and_a_client_reads_it_whole(start_service):
    service = start_service(worker=False)
    with httpx.Client(base_url=service.url) as http:
        response = http.post("/v1/batches", json={"input_file_id": "f"})
        assert response.status_code == 401 and response.headers["connection"] == "close"
        assert assert_error(response, 401)["code"] == "missing_api_key"


def test_an_api_served_under_a_root_path_checks_keys_and_answers(start_service, tmp_path):
    """Behind a proxy that serves the API under a prefix and strips it (uvicorn's --root-path: the app sees the
    prefix in every path), every /v1 route is guarded and answered as at the root: the guard reads the path the
    routes match."""
    from batch_dagster.api.app import create_app
    from tests.helpers import ApiServer

    service = start_service(worker=False)
    with ApiServer(create_app(service.config), root_path="/prefix") as server, \
            httpx.Client(base_url=server.url, timeout=30) as http:  # as the proxy forwards
        assert_error(http.get("/v1/files"), 401)  # no key: refused by the guard, not a 500 from the route
        keyed = {"Authorization": f"Bearer {KEY_A}"}
        file_id = http.post("/v1/files", headers=keyed, files={"file": ("a.jsonl", b'{"custom_id": "a"}\n')},
                            data={"purpose": "batch"}).json()["id"]
        assert http.get(f"/v1/files/{file_id}", headers=keyed).json()["id"] == file_id
        assert http.get("/v1/batches", headers=keyed).status_code == 200
        assert_error(http.post("/v1/batches", headers=keyed, content=b"x" * (2 << 20)), 413)  # the body's limit holds
