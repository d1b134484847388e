"""An idempotent retry under a dropped connection (issue #50), with the official `openai` SDK against serve on the
real engine: a proxy between them passes the SDK's POST /v1/batches to the API, which commits the batch and answers,
and closes the client's connection instead of passing the answer on. The SDK retries on its own (a connection error);
with its Idempotency-Key the retry answers the batch the first request made, which then runs once. Without a key the
same retry makes a second batch: the SDK sends no idempotency header of its own (openai-python's
`_idempotency_header` is None: it makes a key per call, `stainless-python-retry-...`, and never sends it)."""

from __future__ import annotations

import contextlib
import json
import socket
import threading

import openai
import pytest

from tests.helpers import CHAT_MODEL, SERVE_API_KEY, file_lines, write_jsonl
from tests.system.test_clients import CAPITALS, question, serve  # noqa: F401  (the module's serve)

pytestmark = pytest.mark.engine


class DroppingProxy:
    """A TCP proxy to `port` on loopback that, on its first connection, passes the request on, reads the API's whole
    answer and closes the connection without passing it; every later connection is passed through both ways. It keeps
    the answer it dropped and the head of every request it saw."""

    def __init__(self, port: int):
        self.target = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.dropped: bytes | None = None
        self.heads: list[bytes] = []
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            first = self.connections == 1
            threading.Thread(target=self._serve, args=(client, first), daemon=True).start()

    def _serve(self, client: socket.socket, drop: bool) -> None:
        server = socket.create_connection(("127.0.0.1", self.target))
        upstream = threading.Thread(target=self._pipe, args=(client, server, True), daemon=True)
        upstream.start()
        if drop:
            self.dropped = _read_answer(server)
            # The API committed and answered; the client never sees it. Shut down, not only closed: a close leaves
            # the connection open while the upstream thread still reads it, and the SDK retried only at its timeout.
            for s in (client, server):
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            return
        self._pipe(server, client, False)

    def _pipe(self, source: socket.socket, dest: socket.socket, requests: bool) -> None:
        try:
            while data := source.recv(65536):
                if requests and data[:5] in (b"POST ", b"GET /"):
                    self.heads.append(data.split(b"\r\n\r\n", 1)[0])
                dest.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, dest):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.listener.close()


def _read_answer(server: socket.socket) -> bytes:
    """One whole HTTP answer (its Content-Length's worth of body) from `server`."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += server.recv(65536)
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += server.recv(65536)
    return head + b"\r\n\r\n" + body


def through(proxy: DroppingProxy):
    from openai import OpenAI

    return OpenAI(base_url=f"http://127.0.0.1:{proxy.port}/v1", api_key=SERVE_API_KEY, max_retries=2, timeout=60)


def header(head: bytes, name: bytes) -> bytes | None:
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == name:
            return value.strip()
    return None


def test_a_retry_after_a_dropped_answer_makes_one_batch_with_its_key_and_two_without(serve, tmp_path):  # noqa: F811
    direct = serve.client()
    rows = [{"custom_id": country, "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": CHAT_MODEL, "messages": question(country), "max_tokens": 16, "temperature": 0}}
            for country in CAPITALS]
    with open(write_jsonl(tmp_path / "capitals.jsonl", rows), "rb") as f:
        file_id = direct.files.create(file=f, purpose="batch").id

    keyed = DroppingProxy(serve.api_port)
    batch = through(keyed).batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                          completion_window="24h", extra_headers={"Idempotency-Key": "capitals-1"})
    keyed.close()
    assert keyed.dropped is not None and keyed.dropped.startswith(b"HTTP/1.1 200")
    committed = json.loads(keyed.dropped.split(b"\r\n\r\n", 1)[1])
    assert committed["id"] == batch.id  # the answer the client never saw named the batch its retry got
    first, retry = keyed.heads
    assert header(first, b"idempotency-key") == header(retry, b"idempotency-key") == b"capitals-1"
    assert (header(first, b"x-stainless-retry-count"), header(retry, b"x-stainless-retry-count")) == (b"0", b"1")
    mine = [b for b in direct.batches.list() if b.input_file_id == file_id]
    assert [b.id for b in mine] == [batch.id]

    # The control: the same drop without a key, and the SDK's own retry makes a second batch (cancelled at once).
    bare = DroppingProxy(serve.api_port)
    twin = through(bare).batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                        completion_window="24h")
    bare.close()
    lost = json.loads(bare.dropped.split(b"\r\n\r\n", 1)[1])["id"]  # type: ignore[union-attr]
    assert lost != twin.id
    assert not [h for h in bare.heads if header(h, b"idempotency-key") is not None]
    for extra in (lost, twin.id):
        with contextlib.suppress(openai.BadRequestError):  # small: it may have ended already
            direct.batches.cancel(extra)

    done = serve.wait_for(batch.id, {"completed", "failed", "expired", "cancelled"}, 600)
    assert done.status == "completed", done
    assert done.request_counts.total == len(CAPITALS) and done.request_counts.completed == len(CAPITALS)
    lines = file_lines(direct, done.output_file_id)
    assert sorted(line["custom_id"] for line in lines) == sorted(CAPITALS)  # each request answered once
    answers = {line["custom_id"]: line["response"]["body"]["choices"][0]["message"]["content"] for line in lines}
    assert sum(city.lower() in answers[country].lower() for country, city in CAPITALS.items()) >= 3, answers
