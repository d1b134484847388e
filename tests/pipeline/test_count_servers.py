"""A served model's count goes to its servers' /render routes (engine/counting.py ServerCount): what a server refuses
is refused, a server without the routes (no --enable-scale-out, an old vLLM) hands the count to the count worker,
a server that renders too long stops the count at that body. The servers here are a stand-in on loopback; the
worker renders words (tests/word_render.py); tests/system/test_count_worker.py runs a real vLLM server."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from batch_dagster.batchfile import contract as c
from batch_dagster.engine import counting, tokens
from batch_dagster.engine.models import Models
from batch_dagster.settings import Settings
from tests.helpers import CHAT_MODEL, count_words

ASKED: list[str] = []


class Replica(BaseHTTPRequestHandler):
    """Renders a body as one token per word of its last message: FORBID answers as a vLLM without
    --enable-scale-out, REFUSE as vLLM refusing the body, SLOW after 3 s."""

    def _answer(self, status: int, payload: object) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/v1/models":
            return self._answer(200, {"data": [{"id": CHAT_MODEL, "max_model_len": 777}]})
        self._answer(404, {"detail": "Not Found"})

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        text = body["messages"][-1]["content"]
        ASKED.append(text)
        if self.path != c.CHAT + "/render":
            return self._answer(404, {"detail": "Not Found"})
        if "FORBID" in text:
            return self._answer(403, {"error": {"message": "Scale-out endpoints are disabled.", "code": 403}})
        if "REFUSE" in text:
            return self._answer(400, {"error": {"message": "refused", "code": 400}})
        if "SLOW" in text:
            time.sleep(3)
        self._answer(200, {"token_ids": list(range(len(text.split())))})

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def replica() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Replica)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    ASKED.clear()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    counting.close_workers()


def body(text: str) -> dict:
    return {"model": CHAT_MODEL, "messages": [{"role": "user", "content": text}]}


def test_a_served_models_bodies_are_counted_by_its_servers_until_they_cannot(replica, monkeypatch):
    count_words(monkeypatch)
    count, context_length = Models.from_settings(Settings.from_env()).counter(CHAT_MODEL, servers=[replica])
    assert context_length == 2048  # the registry's max_model_len first; else the servers' (777 here)
    assert count(c.CHAT, body("one two three")) == [3] and count(c.CHAT, body("REFUSE this")) is None
    assert ASKED == ["one two three", "REFUSE this"]
    # A 403 is no refusal of the body: the worker counts it, and the rest (before, such an answer counted 0 tokens).
    assert count(c.CHAT, body("FORBID four five")) == [3] and count(c.CHAT, body("six")) == [1]
    assert ASKED == ["one two three", "REFUSE this", "FORBID four five"]


def test_a_server_that_renders_past_the_bound_stops_the_count_at_that_body(replica, monkeypatch):
    count_words(monkeypatch)
    monkeypatch.setattr(tokens, "LINE_TIMEOUT_S", 1.0)
    count, _ = Models.from_settings(Settings.from_env()).counter(CHAT_MODEL, servers=[replica])
    with pytest.raises(tokens.CountTimeout, match="did not render within 1 s"):
        count(c.CHAT, body("SLOW words"))
