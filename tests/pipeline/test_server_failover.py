"""The server engine when servers go away: requests are resent elsewhere, nothing is lost, and only when no
server answers for the failover window does the shard fail (so the step retries it)."""

from __future__ import annotations

import itertools
import socket
from contextlib import ExitStack

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse

from batch_dagster.batchfile import contract as c
from batch_dagster.engine.base import EngineCrash
from batch_dagster.engine.health import Health
from batch_dagster.engine.server import ServerEngine
from tests.helpers import ApiServer, free_port


def chat_server(fail_first: int = 0, status: int = 503, text: bool = False) -> tuple[FastAPI, list[str]]:
    """A stand-in OpenAI server: answers `status` to its first `fail_first` requests (in plain text, as a router
    does, when `text`), then a chat completion."""
    app, seen, count = FastAPI(), [], itertools.count()

    @app.post("/v1/chat/completions")
    def complete(body: dict):
        seen.append(body["messages"][0]["content"])
        if next(count) < fail_first:
            if text:
                return PlainTextResponse("Request failed: error sending request for url", status_code=status)
            return JSONResponse({"error": {"message": "no healthy worker"}}, status_code=status)
        if body.get("temperature") == -1:
            return JSONResponse({"error": {"message": "temperature must be >= 0", "param": "temperature"}},
                                status_code=400)
        usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
        return {"id": "chatcmpl-1", "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}], "usage": usage}

    return app, seen


def requests(n: int, **params) -> list:
    return [(f"r{i}", {"model": "m", "messages": [{"role": "user", "content": f"q{i}"}], **params}) for i in range(n)]


def test_a_dead_server_costs_nothing_when_another_answers():
    app, seen = chat_server()
    with ApiServer(app) as good:
        dead = f"http://127.0.0.1:{free_port()}"
        lines = ServerEngine([dead, good.url], failover_s=30).run(c.CHAT, requests(10))
    assert sorted(line["custom_id"] for line in lines) == [f"r{i}" for i in range(10)]
    assert all(c.is_success(line) for line in lines)
    assert sorted(seen) == sorted(f"q{i}" for i in range(10))  # each request answered once, by the live server


@pytest.mark.timeout(120)
def test_a_hung_servers_requests_go_to_another_and_none_wait_the_request_timeout(caplog):
    """A server that takes connections and answers nothing (as one stopped with SIGSTOP): its requests are given
    up once its health probes have gone unanswered for hung_after_s, and the live server answers each once."""
    app, seen = chat_server()
    with ApiServer(app) as good, socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(64)  # the kernel completes the connections; nobody reads them
        engine = ServerEngine([f"http://127.0.0.1:{hung.getsockname()[1]}", good.url], timeout_s=600,
                              failover_s=600, hung_after_s=1)
        lines = engine.run(c.CHAT, requests(10))
    assert sorted(line["custom_id"] for line in lines) == [f"r{i}" for i in range(10)]
    assert all(c.is_success(line) for line in lines)
    assert sorted(seen) == sorted(f"q{i}" for i in range(10))
    assert any(f"{engine.base_urls[0]} has answered nothing for" in r.getMessage() for r in caplog.records), caplog.text


def test_a_server_is_hung_only_after_answering_nothing_for_the_window_and_is_used_again_once_it_answers():
    now = [0.0]
    health = Health(["a", "b"], hung_after_s=20, clock=lambda: now[0])
    now[0] = 19
    health.probed("a", False)
    assert not health.hung("a") and health.choose(0) == "a"
    now[0] = 20
    health.probed("a", False)
    health.probed("b", True)
    assert health.hung("a") and not health.hung("b")
    assert [health.choose(i) for i in range(2)] == ["b", "b"]
    health.probed("b", False)  # b's probe failed once: it answered 0 s ago, not hung
    assert not health.hung("b")
    now[0] = 41
    health.probed("b", False)
    assert [health.choose(i) for i in range(2)] == ["a", "b"]  # all hung: each keeps its own
    health.probed("a", True)
    assert not health.hung("a") and health.choose(1) == "a"


def test_a_router_with_no_healthy_replica_is_waited_out():
    app, seen = chat_server(fail_first=4, status=503)
    with ApiServer(app) as router:
        lines = ServerEngine([router.url], failover_s=30).run(c.CHAT, requests(3))
    assert all(c.is_success(line) for line in lines) and len(lines) == 3
    assert len(seen) == 3 + 4


def test_a_routers_plain_text_500_for_a_dead_replica_is_resent():
    app, seen = chat_server(fail_first=5, status=500, text=True)
    with ApiServer(app) as router:
        lines = ServerEngine([router.url], failover_s=30).run(c.CHAT, requests(2))
    assert all(c.is_success(line) for line in lines) and len(seen) == 2 + 5


def test_no_server_for_the_whole_window_fails_the_shard():
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(EngineCrash, match="No server answered"):
        ServerEngine([dead], failover_s=1.0).run(c.CHAT, requests(2))


def test_request_errors_stay_request_errors():
    app, _ = chat_server()
    with ExitStack() as stack:
        server = stack.enter_context(ApiServer(app))
        lines = ServerEngine([server.url], failover_s=5).run(c.CHAT, requests(2, temperature=-1))
    assert [line["response"]["status_code"] for line in lines] == [400, 400]
    assert lines[0]["response"]["body"]["error"]["param"] == "temperature"


def test_a_server_error_becomes_the_request_error_line_after_a_few_attempts():
    app, seen = chat_server(fail_first=100, status=500)
    with ApiServer(app) as server:
        [line] = ServerEngine([server.url], failover_s=5).run(c.CHAT, requests(1))
    assert line["response"]["status_code"] == 500 and line["response"]["body"]["error"]["code"] == c.ENGINE_ERROR
    assert len(seen) == 3


def test_bodies_go_to_the_replicas_a_router_lists_as_they_are():
    # A router re-serializes a request in its own types (vllm-router drops a chat tool's `strict`): the engine asks it
    # for its healthy workers and sends each body to them unchanged; a URL that lists none is used as it is.
    worker, bodies = FastAPI(), []

    @worker.post("/v1/chat/completions")
    def complete(body: dict):
        bodies.append(body)
        return {"id": "x", "object": "chat.completion", "choices": [], "usage": {"prompt_tokens": 1}}

    with ApiServer(worker) as replica:
        router = FastAPI()
        workers = [{"url": replica.url, "is_healthy": True}, {"url": "http://127.0.0.1:9", "is_healthy": False}]
        router.get("/workers")(lambda: {"workers": workers})
        router.post("/v1/chat/completions")(lambda: JSONResponse({"error": {"message": "not here"}}, status_code=500))
        with ApiServer(router) as front:
            tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": True}}
            sent = requests(2, tools=[tool], tool_choice="required")
            engine = ServerEngine([front.url], failover_s=5)
            lines = engine.run(c.CHAT, sent)
            assert [line["response"]["status_code"] for line in lines] == [200, 200]
            # Every field, nested ones included (the two go at once: in either order).
            assert sorted(bodies, key=repr) == sorted((body for _, body in sent), key=repr)
            direct = ServerEngine([replica.url], failover_s=5)  # a vLLM server lists no workers: used as it is
            assert [line["response"]["status_code"] for line in direct.run(c.CHAT, sent)] == [200, 200]
