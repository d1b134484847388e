"""The batch dispatcher's budget (engine/budget.py) and the server engine within it, against a stand-in vLLM server
whose /metrics the test drives: it yields to other clients' requests at once, grows back additively while the
servers keep up and multiplicatively once they are its own, halves on latency, 429s and errors, and a request a
busy server answers 429 or 503 is sent again, never failed."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from batch_dagster.batchfile import contract as c
from batch_dagster.engine.base import EngineCrash
from batch_dagster.engine.budget import Budget, Held, Reading
from batch_dagster.engine.server import ServerEngine
from tests.helpers import ApiServer, free_port

METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="m"}} {running}
vllm:num_requests_running{{engine="1",model_name="m"}} 1.0
vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}
vllm:num_requests_waiting_by_reason{{engine="0",model_name="m",reason="capacity"}} 99.0
vllm:time_to_first_token_seconds_sum{{engine="0",model_name="m"}} {ttft_sum}
vllm:time_to_first_token_seconds_count{{engine="0",model_name="m"}} {ttft_count}
vllm:inter_token_latency_seconds_sum{{engine="0",model_name="m"}} {itl_sum}
vllm:inter_token_latency_seconds_count{{engine="0",model_name="m"}} {itl_count}
vllm:inter_token_latency_seconds_bucket{{engine="0",le="0.01",model_name="m"}} 3.0
"""


def reading(running: float = 0, waiting: float = 0, ttft: float = 0.1, itl: float = 0.02, tokens: int = 0,
            base: Reading = Reading()) -> Reading:
    """`base` and, since it, `tokens` tokens at `itl` s each and a tenth as many first tokens at `ttft`."""
    return Reading(running, waiting, base.ttft_sum + ttft * tokens / 10, base.ttft_count + tokens / 10,
                   base.itl_sum + itl * tokens, base.itl_count + tokens)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_vllm_servers_metrics_are_read_summed_over_its_engines():
    text = METRICS.format(running=3.0, waiting=2.0, ttft_sum=1.5, ttft_count=10.0, itl_sum=2.0, itl_count=100.0)
    assert Reading.parse(text) == Reading(4.0, 2.0, 1.5, 10.0, 2.0, 100.0)
    with pytest.raises(ValueError, match="not a vLLM server"):
        Reading.parse("# an OpenAI-compatible server that is not vLLM\nrequests_total 3\n")


def test_the_budget_doubles_alone_yields_at_once_to_others_then_grows_one_by_one():
    clock = Clock()
    budget = Budget(64, adaptive=True, clock=clock)
    assert budget.limit == 1  # it starts small
    for expected in (2, 4, 8, 16, 32, 64, 64):
        clock.now += 0.5
        budget.observe(reading(running=budget.limit), in_flight=budget.limit)  # its own requests only
        assert budget.limit == expected and not budget.shared
    clock.now += 0.5
    budget.observe(reading(running=64 + 2), in_flight=64)  # two requests of someone else
    assert budget.limit == 1 and budget.shared
    budget.held = [Held() for _ in range(5)]  # five still out: the limit binds
    last = reading(running=3, tokens=100)
    for expected in (2, 3, 4):
        clock.now += 0.5
        last = reading(running=3, tokens=100, base=last)  # latencies steady
        budget.observe(last, in_flight=5)
        assert budget.limit == expected
    clock.now += 0.5
    budget.observe(reading(running=3, tokens=100, itl=0.03, base=last), in_flight=5)  # 50% slower tokens
    assert budget.limit == 2
    budget.held = []
    clock.now += 6  # quiet for longer than QUIET_S: the fleet is its own again
    budget.observe(reading(running=0), in_flight=0)
    assert not budget.shared and budget.limit == 4


def test_429s_and_errors_halve_the_budget_once_per_interval_and_waiting_requests_too():
    clock = Clock()
    budget = Budget(64, adaptive=True, clock=clock)
    budget.limit = 32
    budget.answered(429)
    budget.answered(503)  # in the same interval: one halving
    assert budget.limit == 16
    clock.now += 0.5
    budget.answered(None)  # no answer at all
    assert budget.limit == 8
    budget.answered(200)
    assert budget.answered_at == clock.now and budget.limit == 8
    clock.now += 0.5
    budget.observe(reading(running=9), in_flight=8)  # someone else: the floor
    clock.now += 0.5
    budget.held = [Held()]
    budget.observe(reading(running=2, waiting=1), in_flight=1)  # a request waits: no growth
    assert budget.limit == 1
    fixed = Budget(64)
    fixed.answered(429)
    fixed.observe(reading(running=99), in_flight=0)
    assert fixed.limit == 64  # a fixed budget is BATCH_VLLM_MAX_CONCURRENCY, whatever happens


class Fleet:
    """A stand-in vLLM server: chat completions that take `work_s`, answering 429 or 503 (vLLM's JSON) to some,
    and /metrics counting its requests in flight plus `others` of another client."""

    def __init__(self, work_s: float = 0.05, busy_every: int = 0, busy_status: int = 429) -> None:
        self.app, self.work_s, self.busy_every, self.busy_status = FastAPI(), work_s, busy_every, busy_status
        self.in_flight, self.most, self.others, self.sent, self.aborted = 0, 0, 0, 0, 0
        self.others_since: float | None = None
        self.timeline: list[tuple[float, int]] = []  # (when, requests in flight) at each arrival
        self.answered: list[str] = []
        count = itertools.count(1)

        @self.app.post("/v1/chat/completions")
        async def complete(request: Request):
            body = await request.json()
            self.sent += 1
            if self.busy_every and next(count) % self.busy_every == 0:
                return JSONResponse({"error": {"message": "The engine is currently busy", "type": "Busy",
                                               "code": self.busy_status}}, status_code=self.busy_status)
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
            self.timeline.append((time.monotonic(), self.in_flight))
            try:
                until = time.monotonic() + self.work_s
                while time.monotonic() < until:  # vLLM aborts a request whose client went away
                    if await request.is_disconnected():
                        self.aborted += 1
                        return PlainTextResponse("", status_code=499)
                    await asyncio.sleep(0.02)
            finally:
                self.in_flight -= 1
            self.answered.append(body["messages"][0]["content"])
            usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
            return {"id": "chatcmpl-1", "object": "chat.completion", "usage": usage, "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]}

        @self.app.get("/metrics")
        def metrics():
            return PlainTextResponse(METRICS.format(running=self.in_flight + self.others - 1, waiting=0, ttft_sum=0,
                                                    ttft_count=0, itl_sum=0, itl_count=0))


def requests(n: int) -> list:
    return [(f"r{i}", {"model": "m", "messages": [{"role": "user", "content": f"q{i}"}]}) for i in range(n)]


def test_an_adaptive_budget_keeps_to_its_floor_while_others_use_the_server_and_takes_back_what_was_out():
    fleet = Fleet(work_s=1.5)
    with ApiServer(fleet.app) as server:
        engine = ServerEngine([server.url], max_concurrency=16, budget="adaptive")

        def someone_arrives() -> None:
            time.sleep(2.0)  # the budget has grown meanwhile: the server is its own
            fleet.others, fleet.others_since = 3, time.monotonic()

        threading.Thread(target=someone_arrives, daemon=True).start()
        lines = engine.run(c.CHAT, requests(24))
    assert sorted(line["custom_id"] for line in lines) == sorted(f"r{i}" for i in range(24))
    assert all(c.is_success(line) for line in lines)
    # Every request answered (one taken back just as the server finished it is answered again: its line is still
    # written once, above).
    assert set(fleet.answered) == {f"q{i}" for i in range(24)}
    assert fleet.most >= 4  # it grew while alone
    assert fleet.aborted >= 1  # what was out beyond the floor was taken back (and sent again)
    # Once it saw the others, it fell to the floor, then grew back one at a time, at most one a reading (0.5 s):
    # measured from when it fell, not from a fixed delay, which a loaded machine stretches.
    assert fleet.others_since is not None
    after = [(at, in_flight) for at, in_flight in fleet.timeline if at > fleet.others_since]
    fell = next(at for at, in_flight in after if in_flight <= 2)
    for at, in_flight in after:
        if at > fell:
            assert in_flight <= 3 + (at - fell) / 0.5, (at - fell, in_flight)


def test_a_busy_server_never_fails_a_request_and_the_fixed_budget_is_the_concurrency():
    for status in (429, 503):
        fleet = Fleet(busy_every=3, busy_status=status)
        with ApiServer(fleet.app) as server:
            lines = ServerEngine([server.url], max_concurrency=8, failover_s=2).run(c.CHAT, requests(30))
        assert all(c.is_success(line) for line in lines) and len(lines) == 30
        assert fleet.sent > 30 and sorted(fleet.answered) == sorted(f"q{i}" for i in range(30))
        assert fleet.most == 8


def test_a_fleet_that_only_ever_answers_busy_fails_the_shard_only_if_it_is_a_503():
    class AlwaysBusy(Fleet):
        def __init__(self, status: int) -> None:
            super().__init__(busy_every=1, busy_status=status)

    fleet = AlwaysBusy(503)  # no request ever answered: the fleet is as good as away
    with ApiServer(fleet.app) as server, pytest.raises(EngineCrash, match="busy"):
        ServerEngine([server.url], failover_s=1.0, budget="adaptive").run(c.CHAT, requests(2))
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(EngineCrash, match="No server answered"):
        ServerEngine([dead], failover_s=1.0, budget="adaptive").run(c.CHAT, requests(2))
