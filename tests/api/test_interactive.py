"""One base URL for batch and interactive calls: the API forwards /v1/chat/completions, /v1/completions,
/v1/embeddings and /v1/responses to the model's warm fleet (here a small fake router that records what it gets), under
the same keys, with the caller's cache_salt, within its key's calls in flight, its answers passed on byte for byte and
chunk by chunk; /v1/models lists the registry. (tests/system/test_interactive.py: the real engine behind serve.)"""

from __future__ import annotations

import asyncio
import json
import math
import queue
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import openai
import pytest

from batch_dagster.db import Database, keys
from batch_dagster.db.fleets import record_fleet
from batch_dagster.db.models import FleetRecord
from batch_dagster.db.repo import owner_of_key
from batch_dagster.engine.budget import Budget, ServerMetrics
from batch_dagster.features.interactive import NO_FLEET_RETRY_S
from batch_dagster.features.scope import cache_salt
from batch_dagster.serve.fleets import WarmFleets
from tests.api.test_cache_salt import run, salted_service
from tests.helpers import CHAT_MODEL, EMBED_MODEL, KEY_A, KEY_B, chat_request

# An answer as a router sends it, its own spacing and key order: passed on, it must arrive byte for byte.
ANSWER = (b'{"id":"chatcmpl-1",  "object":"chat.completion","created":1,"model":"smollm2-135m-instruct",'
          b'"choices":[{"index":0,"message":{"role":"assistant","content":"Paris."},"finish_reason":"stop"}],'
          b'"usage":{"prompt_tokens":12,"total_tokens":15,"completion_tokens":3}}')
EVENTS = [b'data: {"choices":[{"delta":{"content":"Pa"}}]}\n\n', b'data: {"choices":[{"delta":{"content":"ris"}}]}\n\n',
          b'data: {"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":2,"total_tokens":14}}\n\n',
          b"data: [DONE]\n\n"]


@dataclass
class Seen:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


@dataclass
class FakeRouter:
    """A router stand-in on loopback: it records each request, answers ANSWER (or `status` and `body`), streams EVENTS
    to a call that asks `stream`, each event after the first only once the test puts something in `gate` (or, to a
    call that asks `endless`, the first event again and again until the connection is gone), and reports the requests
    it holds as vLLM's `vllm:num_requests_running` on /metrics."""

    status: int = 200
    body: bytes = ANSWER
    seen: list[Seen] = field(default_factory=list)
    gate: queue.Queue = field(default_factory=queue.Queue)
    open: int = 0
    config_info: str = 'vllm:cache_config_info{block_size="16",enable_prefix_caching="False",engine="0"} 1.0\n'
    disconnected: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        router = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                text = f"vllm:num_requests_running {router.open}\nvllm:num_requests_waiting 0\n{router.config_info}".encode()
                self._answer(200, text if self.path == "/metrics" else b"{}", "text/plain")

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                router.seen.append(Seen(self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                router.open += 1
                try:
                    if body.get("stream"):
                        self.endless = bool(body.get("endless"))
                        return self._stream()
                    self._answer(router.status, router.body, "application/json")
                finally:
                    router.open -= 1

            def _stream(self) -> None:
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("x-request-id", "stream-1")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                try:
                    for i, event in enumerate(EVENTS):
                        while i and self.endless:
                            self.wfile.write(b"%x\r\n%s\r\n" % (len(EVENTS[0]), EVENTS[0]))
                            self.wfile.flush()
                            time.sleep(0.05)
                        if i:
                            router.gate.get(timeout=20)
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                except (BrokenPipeError, ConnectionResetError):
                    router.disconnected.set()

            def _answer(self, status: int, body: bytes, kind: str) -> None:
                self.send_response(status)
                self.send_header("content-type", kind)
                self.send_header("content-length", str(len(body)))
                self.send_header("x-request-id", "router-1")
                self.send_header("access-control-allow-origin", "*")  # the router's CORS: not the API's to pass on
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def router():
    fake = FakeRouter()
    yield fake
    for _ in range(len(EVENTS)):
        fake.gate.put(None)  # a stream a test left open ends
    fake.close()


def chat(model: str = CHAT_MODEL, **fields) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "The capital of France?"}], **fields}


def served(start_service, router: FakeRouter, **settings):
    return start_service(worker=False, fleet_urls={CHAT_MODEL: router.url}, **settings)


def test_a_call_is_answered_as_the_router_answers_it_and_the_router_never_sees_the_callers_key(start_service,
                                                                                                router):
    service = served(start_service, router, vllm_api_key="sk-fleet")
    answer = service.http().post("/v1/chat/completions", json=chat(temperature=0))
    assert answer.status_code == 200 and answer.content == ANSWER  # the router's bytes, not a re-serialization
    assert answer.headers["x-request-id"] == "router-1" and answer.headers["content-type"] == "application/json"
    assert "access-control-allow-origin" not in answer.headers
    [seen] = router.seen
    assert seen.path == "/v1/chat/completions" and seen.body["temperature"] == 0
    assert seen.headers["authorization"] == "Bearer sk-fleet" and KEY_A not in json.dumps(seen.headers)
    # The SDK reads it as any answer.
    reply = service.client().chat.completions.create(model=CHAT_MODEL, messages=chat()["messages"])
    assert reply.choices[0].message.content == "Paris." and reply.usage.completion_tokens == 3
    # The router's error, status and body, as it sent them.
    router.status, router.body = 400, b'{"error": {"message": "bad n", "type": "BadRequestError", "code": 400}}'
    refused = service.http().post("/v1/completions", json={"model": CHAT_MODEL, "prompt": "x", "n": -1})
    assert refused.status_code == 400 and refused.content == router.body
    assert [s.path for s in router.seen] == ["/v1/chat/completions"] * 2 + ["/v1/completions"]


def test_every_call_needs_a_live_key(start_service, router):
    service = served(start_service, router)
    store = Database(service.config.database_url)
    with store.session() as session:
        _, key = keys.create(session, "agent")
    assert service.http(key).post("/v1/chat/completions", json=chat()).status_code == 200
    with store.session() as session:
        keys.revoke(session, "agent")
    store.dispose()
    for api_key in (None, "sk-unknown", key):
        for method, path in (("POST", "/v1/chat/completions"), ("POST", "/v1/embeddings"), ("GET", "/v1/models")):
            answer = service.http(api_key).request(method, path, json=chat() if method == "POST" else None)
            assert answer.status_code == 401, (api_key, path)
            assert answer.json()["error"]["code"] in ("missing_api_key", "invalid_api_key")
    assert len(router.seen) == 1  # none of the refused calls reached the fleet


def test_a_stream_is_passed_on_event_by_event(start_service, router):
    service = served(start_service, router)
    got = []
    with service.http().stream("POST", "/v1/chat/completions", json=chat(stream=True)) as answer:
        assert answer.status_code == 200 and answer.headers["content-type"] == "text/event-stream"
        assert answer.headers["x-request-id"] == "stream-1"
        for chunk in answer.iter_raw():
            got.append(chunk)
            # The router sends the next event only now: had the API waited for the whole answer, nothing would come.
            router.gate.put(None)
    assert b"".join(got) == b"".join(EVENTS)
    assert got[0] == EVENTS[0] and len(got) >= len(EVENTS)
    # The SDK's stream reads the same events.
    for _ in EVENTS:
        router.gate.put(None)
    stream = service.client().chat.completions.create(model=CHAT_MODEL, messages=chat()["messages"], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "Paris"


def test_a_client_that_leaves_mid_stream_ends_the_routers_request_and_frees_its_place(start_service, router):
    service = served(start_service, router, key_max_interactive_calls=1)
    with service.http().stream("POST", "/v1/chat/completions", json=chat(stream=True, endless=True)) as answer:
        next(answer.iter_raw())  # then gone
    assert router.disconnected.wait(10)  # the API closed its connection to the router, whose writes then fail
    deadline = time.time() + 10
    while (status := service.http().post("/v1/chat/completions", json=chat()).status_code) == 429:
        assert time.time() < deadline, "the stream's place was never given back"
        time.sleep(0.1)
    assert status == 200


def test_a_key_past_its_calls_in_flight_gets_429_and_other_keys_go_on(start_service, router):
    service = served(start_service, router, key_max_interactive_calls=1)
    with service.http(KEY_A).stream("POST", "/v1/chat/completions", json=chat(stream=True)) as held:
        chunks = held.iter_raw()  # (kept: an iterator dropped closes the connection)
        next(chunks)  # key A's one call is in flight
        refused = service.http(KEY_A).post("/v1/embeddings", json={"model": CHAT_MODEL, "input": "x"})
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        error = refused.json()["error"]
        assert error["code"] == "too_many_interactive_calls" and error["type"] == "rate_limit_exceeded"
        assert "BATCH_KEY_MAX_INTERACTIVE_CALLS" in error["message"]
        with pytest.raises(openai.RateLimitError):
            service.client(KEY_A).chat.completions.create(model=CHAT_MODEL, messages=chat()["messages"])
        assert service.http(KEY_B).post("/v1/chat/completions", json=chat()).status_code == 200
        for _ in EVENTS:
            router.gate.put(None)
        assert b"".join(chunks).endswith(EVENTS[-1])
    assert service.http(KEY_A).post("/v1/chat/completions", json=chat()).status_code == 200
    assert len(router.seen) == 3  # the refused calls never reached the fleet


def test_an_unknown_model_is_openais_404_and_is_never_forwarded(start_service, router):
    service = served(start_service, router)
    with pytest.raises(openai.NotFoundError) as raised:
        service.client().chat.completions.create(model="gpt-4o", messages=chat()["messages"])
    assert raised.value.code == "model_not_found"
    assert raised.value.body["message"] == "The model `gpt-4o` does not exist or you do not have access to it."
    long = service.http().post("/v1/responses", json={"model": "x" * 100_000, "input": "hi"})
    assert long.status_code == 404 and len(long.json()["error"]["message"]) < 200  # a client's value, bounded
    assert service.http().get("/v1/models/gpt-4o").status_code == 404
    for body in (b"not json", b"[1]", b'{"messages": []}'):
        answer = service.http().post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert answer.status_code == 400 and answer.json()["error"]["message"]
    assert router.seen == []


def test_a_model_without_a_warm_fleet_is_503_with_retry_after_and_how_to_start_one(start_service, router):
    service = served(start_service, router)
    answer = service.http().post("/v1/embeddings", json={"model": EMBED_MODEL, "input": "hi"})
    assert answer.status_code == 503 and answer.headers["retry-after"] == str(NO_FLEET_RETRY_S)
    error = answer.json()["error"]
    assert error["code"] == "no_warm_fleet" and "BATCH_FLEET_MODELS" in error["message"]
    assert f"batch-dagster fleet {EMBED_MODEL}" in error["message"]
    assert router.seen == []


def test_a_sleeping_fleet_answers_503_until_warm_and_the_call_wakes_it(start_service, router):
    service = start_service(worker=False)
    store = Database(service.config.database_url)
    with store.session() as session:
        record_fleet(session, CHAT_MODEL, router.url, "asleep", start_s=12.3)
    asleep = service.http().post("/v1/chat/completions", json=chat())
    assert asleep.status_code == 503 and asleep.headers["retry-after"] == "13"
    assert asleep.json()["error"]["code"] == "fleet_not_warm"
    with store.session() as session:  # what serve's fleets read to wake it (serve/fleets.py)
        assert session.get(FleetRecord, CHAT_MODEL).called_at >= int(time.time()) - 5
        record_fleet(session, CHAT_MODEL, router.url, "warm")
    time.sleep(1.1)  # the API reads the fleets' states again after a second
    assert service.http().post("/v1/chat/completions", json=chat()).status_code == 200
    store.dispose()


def test_a_router_that_does_not_answer_is_a_503_with_retry_after(start_service, router):
    url = router.url
    router.close()
    service = start_service(worker=False, fleet_urls={CHAT_MODEL: url})
    answer = service.http().post("/v1/chat/completions", json=chat())
    assert answer.status_code == 503 and answer.headers["retry-after"]
    assert answer.json()["error"]["code"] == "fleet_unreachable"


def test_a_body_past_the_json_limit_is_refused_before_it_is_forwarded(start_service, router):
    service = served(start_service, router, max_json_body_bytes=4096)
    answer = service.http().post("/v1/chat/completions", json=chat(messages=[{"role": "user", "content": "x" * 8000}]))
    assert answer.status_code == 413 and router.seen == []


def test_each_keys_calls_carry_the_salt_its_batches_carry(start_service, router, tmp_path):
    service, engine = salted_service(start_service, tmp_path, fleet_urls={CHAT_MODEL: router.url})
    run(service.client(KEY_A), tmp_path, [chat_request("a1", "the same long prompt")], "a")
    for key, own in ((KEY_A, None), (KEY_B, None), (KEY_A, "user-42"), (KEY_B, "user-42")):
        body = {"model": CHAT_MODEL, "prompt": "the same long prompt"} | ({"cache_salt": own} if own else {})
        assert service.http(key).post("/v1/completions", json=body).status_code == 200
    a, b, a_own, b_own = (seen.body["cache_salt"] for seen in router.seen)
    assert a == engine.salts["a1"]  # one part of the prefix cache for a key's batches and its interactive calls
    assert a == cache_salt(f"owner:{owner_of_key(KEY_A)}", "") and re.fullmatch(r"[0-9a-f]{64}", a)
    assert len({a, b, a_own, b_own}) == 4  # none shared across keys, a call's own salt within its key's part


def test_shared_owners_share_the_interactive_salt(start_service, router):
    service = served(start_service, router, shared_owners=("*",))
    for key in (KEY_A, KEY_B):
        service.http(key).post("/v1/responses", json={"model": CHAT_MODEL, "input": "hi"})
    assert router.seen[0].body["cache_salt"] == router.seen[1].body["cache_salt"]


@pytest.mark.parametrize("shared", [(), ("*",)])
def test_embeddings_whose_salt_the_router_drops_never_reach_a_prefix_cache_unless_all_share_it(start_service, router,
                                                                                               shared):
    router.config_info = router.config_info.replace('caching="False"', 'caching="True"')
    service = start_service(worker=False, fleet_urls={EMBED_MODEL: router.url, CHAT_MODEL: router.url},
                            shared_owners=shared)
    answer = service.http().post("/v1/embeddings", json={"model": EMBED_MODEL, "input": "a secret prefix"})
    if shared:
        assert answer.status_code == 200 and [s.path for s in router.seen] == ["/v1/embeddings"]
        return
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "prefix_cache_not_isolated"
    assert "enable_prefix_caching = false" in answer.json()["error"]["message"] and router.seen == []
    # Calls whose cache_salt the router passes on go through.
    assert service.http().post("/v1/chat/completions", json=chat()).status_code == 200


def test_models_lists_the_registry_and_says_which_have_a_warm_fleet(start_service, router):
    service = served(start_service, router)
    listed = service.client().models.list()
    by_id = {m.id: m for m in listed.data}
    assert set(by_id) == {CHAT_MODEL, EMBED_MODEL}
    assert by_id[CHAT_MODEL].object == "model" and by_id[CHAT_MODEL].owned_by == "batch-dagster"
    assert by_id[CHAT_MODEL].model_extra["fleet"] == "warm" and by_id[EMBED_MODEL].model_extra["fleet"] is None
    assert by_id[EMBED_MODEL].model_extra["endpoints"][0] == "/v1/embeddings"
    assert service.client().models.retrieve(CHAT_MODEL).id == CHAT_MODEL


def test_calls_are_counted_by_key_and_model_on_the_operators_listener(start_service, router):
    service = served(start_service, router, api_keys=(f"alice:{KEY_A}",))
    http = service.http()
    http.post("/v1/chat/completions", json=chat())
    http.post("/v1/chat/completions", json={"model": "y" * 300, "messages": []})
    with http.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as answer:
        for _ in answer.iter_raw():
            router.gate.put(None)
    text = httpx.get(service.metrics_url).text
    ok = f'key="alice",model="{CHAT_MODEL}",status="200"'
    assert re.search(r'batch_dagster_interactive_calls_total\{endpoint="/v1/chat/completions",' + ok + r"\} 2\.0", text)
    assert 'model="other",status="404"' in text and "yyyy" not in text  # a client's model is never a label
    # Tokens from the answer's usage (ANSWER's 12 + 3) and from the stream's last usage event (12 + 2).
    assert f'batch_dagster_interactive_tokens_total{{key="alice",kind="input",model="{CHAT_MODEL}"}} 24.0' in text
    assert f'batch_dagster_interactive_tokens_total{{key="alice",kind="output",model="{CHAT_MODEL}"}} 5.0' in text
    assert f'batch_dagster_interactive_in_flight{{key="alice",model="{CHAT_MODEL}"}} 0.0' in text


def read_servers(url: str):
    async def read():
        async with httpx.AsyncClient() as client:
            return await ServerMetrics(client, [url]).read()

    return asyncio.run(read())


def test_the_batch_budget_sees_interactive_calls_on_the_servers_and_yields(start_service, router):
    """The adaptive budget reads the servers' own metrics (engine/budget.py): an interactive call in flight through
    the API is a request the servers hold that is not the dispatcher's, so the budget drops to its floor."""
    service = served(start_service, router)
    budget = Budget(64, adaptive=True)
    budget.limit = 32
    budget.observe(read_servers(router.url), in_flight=0)
    assert not budget.shared and budget.limit == 64
    with service.http().stream("POST", "/v1/chat/completions", json=chat(stream=True)) as answer:
        chunks = answer.iter_raw()
        next(chunks)
        reading = read_servers(router.url)
        assert reading.running == 1
        budget.observe(reading, in_flight=0)
        assert budget.shared and budget.limit == budget.floor
        for _ in EVENTS:
            router.gate.put(None)


@dataclass
class StandInFleet:
    """What serve's WarmFleets asks of a fleet, without processes."""

    model: str
    url: str = "http://127.0.0.1:9"
    asleep: bool = False
    woken: int = 0

    def heal(self) -> None:
        pass

    def ready(self) -> bool:
        return True

    def sleep(self) -> None:
        self.asleep = True

    def wake(self) -> None:
        self.asleep, self.woken = False, self.woken + 1


def test_serve_keeps_a_fleet_in_interactive_use_warm_and_wakes_a_sleeping_one_for_a_call(tmp_path):
    store = Database(f"sqlite:///{tmp_path / 'store.db'}")
    store.upgrade()
    fleet = StandInFleet(CHAT_MODEL)
    fleets = WarmFleets({CHAT_MODEL: fleet}, store, idle_s=60)  # type: ignore[dict-item]
    with store.session() as session:
        record_fleet(session, CHAT_MODEL, fleet.url, "warm")

    def tick(*, called_s_ago: float | None) -> None:
        with store.session() as session:  # when the API last recorded a call of the model (Fleets.called)
            session.get(FleetRecord, CHAT_MODEL).called_at = None if called_s_ago is None else \
                int(time.time() - called_s_ago)
            session.commit()
        fleets._asked_at = -math.inf  # (serve asks the store every DEMAND_EVERY_S)
        fleets.tick()

    fleets.last_busy[CHAT_MODEL] = time.monotonic() - 120  # no batch for two minutes, past idle_s
    tick(called_s_ago=0)
    assert not fleet.asleep  # an interactive call just now: in use
    tick(called_s_ago=None)
    assert not fleet.asleep  # the call counted as work: idle_s runs from it
    fleets.last_busy[CHAT_MODEL] = time.monotonic() - 120
    tick(called_s_ago=100)
    assert fleet.asleep  # the last call long before the last look: idle
    tick(called_s_ago=0)
    assert not fleet.asleep and fleet.woken == 1
    with store.session() as session:
        assert session.get(FleetRecord, CHAT_MODEL).state == "starting"
    store.dispose()
